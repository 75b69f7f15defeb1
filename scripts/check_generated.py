#!/usr/bin/env python3
"""Checks that a generated file is what its generator writes now: runs the generator and compares
its output with the committed file. Exits 1 with the command that regenerates it when they differ
(CTest: check_wgmma_bf16).

usage: python3 scripts/check_generated.py GENERATOR OUTPUT  (paths relative to the repository)"""
import os
import subprocess
import sys


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    generator, output = sys.argv[1], sys.argv[2]
    fresh = subprocess.run([sys.executable, os.path.join(repo, generator)], check=True, capture_output=True,
                           text=True).stdout
    with open(os.path.join(repo, output), encoding="utf-8") as f:
        committed = f.read()
    if fresh != committed:
        print("{} is not what {} writes; regenerate it:\n    python3 {} > {}".format(output, generator, generator,
                                                                                   output))
        return 1
    print("check_generated: {} matches {}".format(output, generator))
    return 0


if __name__ == "__main__":
    sys.exit(main())
