#!/usr/bin/env python3
"""scripts/prepare_data.py on bad input: a one-line error and exit 1, never a traceback, for a
missing input, a non-UTF-8 file and an output that cannot be written; a warning (and exit 0) for
data without a single target token; the `bytes` tokenizer's output read back by
`moetrain data-stats`; image parts (with Pillow): a truncated image is exit 3, a good one its patches.

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
    check_images(args, work)
    print("PASS (prepare_data)")


def check_images(args, work):
    """Image parts: a truncated image is exit 3 naming the file and the record; a good one gives its
    placeholders and the .images/.patches files. Needs Pillow, else says so and checks nothing more."""
    try:
        from PIL import Image
    except ImportError:
        print("SKIPPED (images): this Python has no Pillow")
        return
    Image.new("RGB", (60, 40), (200, 10, 10)).save(os.path.join(work, "red.png"))
    with open(os.path.join(work, "red.png"), "rb") as f:
        head = f.read(50)
    with open(os.path.join(work, "cut.png"), "wb") as f:
        f.write(head)
    chat = '{{"messages": [{{"role": "user", "content": [{{"type": "image", "image": "{}"}}]}}, ' \
           '{{"role": "assistant", "content": "red"}}]}}\n'
    with open(os.path.join(work, "cut.jsonl"), "w") as f:
        f.write('{"text": "first"}\n' + chat.format("cut.png"))
    result = run(args, work, "--input", "cut.jsonl", "--output", "cut")
    assert result.returncode == 3 and "cut.jsonl:2" in result.stderr and "cut.png" in result.stderr and \
        "Traceback" not in result.stderr, "truncated image: exit {} {!r}".format(result.returncode, result.stderr)
    with open(os.path.join(work, "red.jsonl"), "w") as f:
        f.write(chat.format("red.png"))
    result = run(args, work, "--input", "red.jsonl", "--output", "red")
    # 60 x 40 -> 56 x 28: a grid of 2 x 4 patches, 1 x 2 tokens of 258.
    assert result.returncode == 0 and "1 images, 8 patches, placeholder token 258" in result.stdout, result.stdout
    assert os.path.getsize(os.path.join(work, "red.patches")) == 8 * 3 * 14 * 14 * 4
    with open(os.path.join(work, "red.bin"), "rb") as f:
        tokens = f.read()
    assert tokens.count(bytes([2, 1])) == 2, "expected two placeholders (258 as uint16)"


if __name__ == "__main__":
    main()
