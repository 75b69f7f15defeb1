#!/usr/bin/env python3
"""scripts/prepare_data.py on bad input: a one-line error and exit 1, never a traceback, for a
missing input, a non-UTF-8 file and an output that cannot be written; a warning (and exit 0) for
data without a single target token; the `bytes` tokenizer's output read back by
`moetrain data-stats`.

usage: prepare_data_test.py --source REPO --moetrain MOETRAIN --work DIR"""
import os
import subprocess
import sys

import script_test_args


def run(args, work, *extra):
    command = [sys.executable, os.path.join(args.source, "scripts", "prepare_data.py"), "--tokenizer", "bytes"]
    return subprocess.run(command + list(extra), cwd=work, capture_output=True, text=True)


def expect_one_line_error(result, what, expected):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, "{}: exit {} (stderr {!r})".format(what, result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, "{}: a traceback:\n{}".format(what, result.stderr)
    assert len(lines) == 1 and expected in lines[0], "{}: expected one line with {!r}, got {!r}".format(
        what, expected, result.stderr)


def main():
    args = script_test_args.parse_args()
    work = args.work

    expect_one_line_error(run(args, work, "--input", "absent.jsonl", "--output", "out"), "missing input",
                          "cannot read --input absent.jsonl: No such file or directory")

    with open(os.path.join(work, "latin1.jsonl"), "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    expect_one_line_error(run(args, work, "--input", "latin1.jsonl", "--output", "out"), "non-UTF-8 input",
                          "latin1.jsonl:2: not UTF-8 (byte 14 of the line is 0xe9)")

    with open(os.path.join(work, "good.jsonl"), "w") as f:
        f.write('{"text": "hello"}\n')
    with open(os.path.join(work, "a_file"), "w") as f:
        f.write("x")
    expect_one_line_error(run(args, work, "--input", "good.jsonl", "--output", "a_file/out"), "unwritable output",
                          "cannot write --output a_file/out")

    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}]}\n')
    result = run(args, work, "--input", "prompts.jsonl", "--output", "prompts")
    assert result.returncode == 0, result.stderr
    assert "warning: no token is a training target" in result.stderr, result.stderr
    result = run(args, work, "--input", "good.jsonl", "--output", "good")
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr

    stats = subprocess.run([args.moetrain, "data-stats", os.path.join(work, "prompts")], capture_output=True,
                           text=True)
    assert stats.returncode == 0 and "mask ratio 0.0000" in stats.stdout, stats.stdout + stats.stderr
    print("PASS (prepare_data)")


if __name__ == "__main__":
    main()
