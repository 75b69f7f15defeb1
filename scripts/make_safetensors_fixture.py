#!/usr/bin/env python3
"""Write tests/fixtures/safetensors/python_written.safetensors with Python's `safetensors`.

The C++ test `safetensors` (tests/unit/test_safetensors.cpp) loads that file and checks every
value against the same formula, proving that files written by Python load in moetrain.
scripts/check_safetensors_interop.py checks the other direction with the same formula.

The formula (fixture_value below; the C++ test has a copy of it), for element i of a tensor in
row-major order:
    F32, F64, F16, BF16:  ((7 * i) % 61 - 30) / 4      exact in every float type
    I32:                  100000 * i - 300000
    I64:                  3000000000 * i - 5           needs more than 32 bits
    U8:                   (37 * i) % 256
    BOOL:                 i % 3 == 0

Usage, on a machine with safetensors (and torch for the BF16 tensor; numpy alone writes the rest):
    python3 scripts/make_safetensors_fixture.py
Without the library, --pure-python writes the same tensors with struct + json to a DIFFERENT
file (pure_python_written.safetensors): useful to check the formula locally, never a substitute
for the real library's output.
"""
import argparse
import json
import os
import struct
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(REPO, "tests", "fixtures", "safetensors")
LIBRARY_OUTPUT = os.path.join(FIXTURE_DIR, "python_written.safetensors")
PURE_PYTHON_OUTPUT = os.path.join(FIXTURE_DIR, "pure_python_written.safetensors")

# Must equal kFormulaNote in tests/unit/test_safetensors.cpp: both sides store it in __metadata__.
FORMULA_NOTE = "values: scripts/make_safetensors_fixture.py fixture_value"

# (name, safetensors dtype, shape): the same list as fixture_entries() in the C++ test.
FIXTURE_TENSORS = [
    ("f32.matrix", "F32", (3, 5)),
    ("f64.vector", "F64", (7,)),
    ("f16.cube", "F16", (2, 3, 4)),
    ("bf16.matrix", "BF16", (4, 6)),
    ("i32.vector", "I32", (10,)),
    ("i64.vector", "I64", (4,)),
    ("u8.matrix", "U8", (3, 3)),
    ("bool.vector", "BOOL", (5,)),
    ("f32.scalar", "F32", ()),
    ("f32.empty", "F32", (0, 3)),
]


def fixture_value(dtype, i):
    if dtype in ("F32", "F64", "F16", "BF16"):
        return ((7 * i) % 61 - 30) / 4.0
    if dtype == "I32":
        return 100000 * i - 300000
    if dtype == "I64":
        return 3000000000 * i - 5
    if dtype == "U8":
        return (37 * i) % 256
    if dtype == "BOOL":
        return i % 3 == 0
    raise ValueError("no formula for dtype " + dtype)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def fixture_values(dtype, shape):
    """The flat, row-major values of one tensor as Python numbers."""
    return [fixture_value(dtype, i) for i in range(numel(shape))]


def build_with_torch(torch):
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
              "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}
    tensors = {}
    for name, dtype, shape in FIXTURE_TENSORS:
        values = fixture_values(dtype, shape)
        # Float values go through float64 (exact) and are rounded once to the target type (exact too).
        source_dtype = torch.float64 if dtype in ("F32", "F64", "F16", "BF16") else dtypes[dtype]
        tensors[name] = torch.tensor(values, dtype=source_dtype).to(dtypes[dtype]).reshape(shape).contiguous()
    return tensors


def build_with_numpy(np):
    dtypes = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I64": np.int64,
              "U8": np.uint8, "BOOL": np.bool_}
    tensors = {}
    for name, dtype, shape in FIXTURE_TENSORS:
        if dtype == "BF16":
            print("warning: torch is not installed, so the BF16 tensor is left out "
                  "(the C++ test then warns that bf16 interop is unchecked)", file=sys.stderr)
            continue
        tensors[name] = np.array(fixture_values(dtype, shape), dtype=dtypes[dtype]).reshape(shape)
    return tensors


def write_with_library(path):
    import safetensors
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    metadata = {"formula": FORMULA_NOTE}
    try:
        import torch
        from safetensors.torch import save_file
        metadata["producer"] = "make_safetensors_fixture.py: safetensors %s, torch %s" % (
            safetensors.__version__, torch.__version__)
        save_file(build_with_torch(torch), path, metadata=metadata)
    except ImportError:
        import numpy as np
        from safetensors.numpy import save_file
        metadata["producer"] = "make_safetensors_fixture.py: safetensors %s, numpy %s" % (
            safetensors.__version__, np.__version__)
        save_file(build_with_numpy(np), path, metadata=metadata)
    print("wrote %s with %s" % (path, metadata["producer"]))


PACK_FORMATS = {"F32": "f", "F64": "d", "F16": "e", "I32": "i", "I64": "q", "U8": "B", "BOOL": "?"}


def pack_values(dtype, values):
    if dtype == "BF16":  # the top half of the float32 bits; exact for these values
        return b"".join(struct.pack("<H", struct.unpack("<I", struct.pack("<f", v))[0] >> 16) for v in values)
    return struct.pack("<%d%s" % (len(values), PACK_FORMATS[dtype]), *values)


def write_pure_python(path):
    header = {"__metadata__": {"formula": FORMULA_NOTE, "producer": "make_safetensors_fixture.py --pure-python"}}
    data = b""
    for name, dtype, shape in FIXTURE_TENSORS:
        blob = pack_values(dtype, fixture_values(dtype, shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text + data)
    print("wrote %s WITHOUT the safetensors library (a formula check, not an interop proof)" % path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output path (default: the fixture path for the chosen mode)")
    parser.add_argument("--pure-python", action="store_true",
                        help="write with struct + json instead of the library, to " + PURE_PYTHON_OUTPUT)
    args = parser.parse_args()
    if args.pure_python:
        path = args.out or PURE_PYTHON_OUTPUT
        if os.path.abspath(path) == LIBRARY_OUTPUT:
            sys.exit("error: %s must come from the safetensors library; --pure-python may not write it" % path)
        write_pure_python(path)
        return
    try:
        import safetensors  # noqa: F401
    except ImportError:
        sys.exit("error: Python's safetensors is not installed here; run this on a machine that has it "
                 "(pip install safetensors numpy torch), or use --pure-python for a local formula check")
    write_with_library(args.out or LIBRARY_OUTPUT)


if __name__ == "__main__":
    main()
