#!/usr/bin/env python3
"""Check that a safetensors file written by moetrain loads in Python's `safetensors` with the
right dtypes, shapes, values and __metadata__.

Make the file with the C++ test (it writes $TMPDIR/moetrain_written.safetensors, or the path in
the environment variable MOETRAIN_INTEROP_OUT):
    MOETRAIN_INTEROP_OUT=/tmp/moetrain_written.safetensors build/tests/test_safetensors "[interop]"
    python3 scripts/check_safetensors_interop.py /tmp/moetrain_written.safetensors
The values follow the formula in scripts/make_safetensors_fixture.py. Exit status 0 when every
tensor matches, 1 otherwise. --pure-python reads the file with struct + json instead of the
library: a local formula check only, not an interop proof.
"""
import argparse
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_safetensors_fixture import FIXTURE_TENSORS, FORMULA_NOTE, fixture_values  # noqa: E402

DTYPE_SIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}


def load_with_library(path):
    """{name: (dtype, shape, flat values)} and the metadata, read by Python's safetensors."""
    from safetensors import safe_open
    try:
        import torch  # noqa: F401
        framework = "pt"
    except ImportError:
        framework = "numpy"
    torch_names = {"torch.float32": "F32", "torch.float64": "F64", "torch.float16": "F16",
                   "torch.bfloat16": "BF16", "torch.int32": "I32", "torch.int64": "I64",
                   "torch.uint8": "U8", "torch.bool": "BOOL"}
    numpy_names = {"float32": "F32", "float64": "F64", "float16": "F16", "int32": "I32", "int64": "I64",
                   "uint8": "U8", "bool": "BOOL"}
    tensors = {}
    with safe_open(path, framework=framework) as f:
        metadata = f.metadata() or {}
        for name in f.keys():
            try:
                t = f.get_tensor(name)
            except Exception as e:  # numpy has no bfloat16
                print("warning: cannot check %s without torch: %s" % (name, e), file=sys.stderr)
                tensors[name] = None
                continue
            if framework == "pt":
                flat = t.reshape(-1)
                values = flat.double().tolist() if t.is_floating_point() else flat.tolist()
                tensors[name] = (torch_names[str(t.dtype)], tuple(t.shape), values)
            else:
                tensors[name] = (numpy_names[str(t.dtype)], tuple(t.shape), t.reshape(-1).tolist())
    print("loaded %s with safetensors (%s)" % (path, framework))
    return tensors, metadata


def load_pure_python(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n:]
    formats = {"F32": "f", "F64": "d", "F16": "e", "I32": "i", "I64": "q", "U8": "B", "BOOL": "?"}
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = data[begin:end]
        dtype = entry["dtype"]
        count = (end - begin) // DTYPE_SIZES[dtype]
        if dtype == "BF16":
            values = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack("<%dH" % count, raw)]
        else:
            values = list(struct.unpack("<%d%s" % (count, formats[dtype]), raw))
        tensors[name] = (dtype, tuple(entry["shape"]), values)
    print("read %s with struct + json (NOT the safetensors library: a formula check only)" % path)
    return tensors, metadata


def check(path, tensors, metadata):
    problems = []
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    if (8 + n) % 8 != 0:
        problems.append("data section starts at byte %d, not 8-byte aligned" % (8 + n))
    if metadata.get("formula") != FORMULA_NOTE:
        problems.append("__metadata__ formula is %r, expected %r" % (metadata.get("formula"), FORMULA_NOTE))
    if metadata.get("producer") != "moetrain":
        problems.append("__metadata__ producer is %r, expected 'moetrain'" % metadata.get("producer"))
    expected_names = {name for name, _, _ in FIXTURE_TENSORS}
    if set(tensors) != expected_names:
        problems.append("tensor names differ: extra %s, missing %s" % (
            sorted(set(tensors) - expected_names), sorted(expected_names - set(tensors))))
    checked = 0
    for name, dtype, shape in FIXTURE_TENSORS:
        if tensors.get(name) is None:
            continue
        got_dtype, got_shape, got_values = tensors[name]
        if got_dtype != dtype or got_shape != tuple(shape):
            problems.append("%s: %s %s, expected %s %s" % (name, got_dtype, got_shape, dtype, tuple(shape)))
            continue
        expected = fixture_values(dtype, shape)
        wrong = [(i, g, e) for i, (g, e) in enumerate(zip(got_values, expected)) if g != e]
        if wrong or len(got_values) != len(expected):
            problems.append("%s: %d of %d values differ, first %s" % (name, len(wrong), len(expected), wrong[:3]))
        checked += 1
    for p in problems:
        print("MISMATCH " + p)
    print("%s: %d tensors checked, %d problems" % (path, checked, len(problems)))
    return not problems


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="file written by moetrain (default: $MOETRAIN_INTEROP_OUT, "
                        "else $TMPDIR/moetrain_written.safetensors)")
    parser.add_argument("--pure-python", action="store_true", help="read with struct + json, not the library")
    args = parser.parse_args()
    path = args.path or os.environ.get("MOETRAIN_INTEROP_OUT") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "moetrain_written.safetensors")
    if args.pure_python:
        tensors, metadata = load_pure_python(path)
    else:
        try:
            import safetensors  # noqa: F401
        except ImportError:
            sys.exit("error: Python's safetensors is not installed here; run this on a machine that has it, "
                     "or use --pure-python for a local formula check")
        tensors, metadata = load_with_library(path)
    sys.exit(0 if check(path, tensors, metadata) else 1)


if __name__ == "__main__":
    main()
