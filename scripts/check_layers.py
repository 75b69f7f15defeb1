#!/usr/bin/env python3
"""Checks the one-way include rule of docs/ARCHITECTURE.md section 2: each folder includes only
the folders below it (and itself). Prints every include that runs back up, with its file and line,
and exits 1 when there is one (CTest: check_layers).

usage: python3 scripts/check_layers.py [REPO]"""
import os
import re
import sys

# Folder -> the include prefixes it may use (besides its own). Longest folder prefix wins.
FLOOR = ["core/base"]
ALLOWED = {
    "core/base": [],
    "core/config": FLOOR,
    "core/io": FLOOR,
    "parallel": FLOOR,
    "kernels": FLOOR,
    "core/data": FLOOR + ["core/config", "core/io"],
    # Above the kernels, code sees the backend interface and format headers, never a backend.
    "core/model": FLOOR + ["core/config", "core/io", "core/data", "parallel", "kernels/ops.h",
                           "kernels/mxfp4_format.h", "kernels/fp8_format.h"],
    "core/plan": FLOOR + ["core/config", "core/io", "core/data", "core/model", "parallel", "kernels/ops.h"],
    "core/train": FLOOR + ["core/config", "core/io", "core/data", "core/model", "core/plan", "parallel",
                           "kernels/ops.h"],
    "core/checkpoint": FLOOR + ["core/config", "core/io", "core/data", "core/model", "core/train", "parallel",
                                "kernels/ops.h", "kernels/mxfp4_format.h"],
    "core/run": FLOOR + ["core/config", "core/io", "core/data", "core/model", "core/plan", "core/train",
                         "core/checkpoint", "parallel", "kernels/ops.h"],
}
OURS = ("core/", "parallel/", "kernels/", "apps/")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCES = (".h", ".cpp", ".cu", ".cuh")


def folder_of(path):
    best = None
    for folder in ALLOWED:
        if path == folder or path.startswith(folder + "/"):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def main():
    repo = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = []
    files = 0
    for top in ("core", "parallel", "kernels"):
        for root, _, names in os.walk(os.path.join(repo, top)):
            for name in sorted(names):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.relpath(os.path.join(root, name), repo)
                folder = folder_of(path)
                if folder is None:
                    problems.append("{}: in no folder of the layer table (scripts/check_layers.py)".format(path))
                    continue
                files += 1
                allowed = ALLOWED[folder] + [folder]
                with open(os.path.join(repo, path), encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m or not m.group(1).startswith(OURS):
                            continue
                        target = m.group(1)
                        if not any(target == a or target.startswith(a + "/") for a in allowed):
                            problems.append("{}:{}: includes {} ({} may include {})".format(
                                path, number, target, folder, ", ".join(allowed)))
    for p in problems:
        print(p)
    print("check_layers: {} files, {} includes against the layer order".format(files, len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
