"""The command line the ctest scripts of tests/scripts share: the moetrain binary, the source tree
and a scratch directory that each run starts empty."""

import argparse
import os
import shutil


def parse_args():
    """--moetrain BINARY --source REPO --work DIR (all required); DIR is emptied (created if absent)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--moetrain", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    return args
