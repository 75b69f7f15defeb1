#!/usr/bin/env bash
# One command from a fresh clone to a green test run: installs missing packages, configures
# (Release, Ninja if present, CUDA backend when nvcc is found), builds and runs every CTest test.
#   BUILD_DIR=...      build directory (default: <repo>/build)
#   MOETRAIN_CUDA=...  AUTO (default), ON or OFF
#   MOETRAIN_SKIP_SETUP=1  do not check system packages
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${BUILD_DIR:-$repo/build}"
jobs="$(nproc)"

if [[ "${MOETRAIN_SKIP_SETUP:-0}" != 1 ]]; then
  "$repo/scripts/setup.sh"
fi
if [[ "$(id -u)" == 0 ]]; then
  # Open MPI refuses to start as root (containers, CI) unless told.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

generator=()
# An existing build directory keeps the generator it was made with.
if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi

started=$SECONDS
cmake -S "$repo" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DMOETRAIN_CUDA="${MOETRAIN_CUDA:-AUTO}"
cmake --build "$build_dir" --parallel "$jobs"
built=$SECONDS
echo "test.sh: configured and built in $((built - started)) s with $jobs jobs"

status=0
(cd "$build_dir" && ctest --output-on-failure --parallel "$jobs") || status=$?
# Skipped tests (the CUDA ones without a GPU) say why; CTest only shows that they were skipped.
grep -h "^SKIPPED:" "$build_dir/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u | sed 's/^/test.sh: /' || true
echo "test.sh: tests ran in $((SECONDS - built)) s; exit $status"
exit "$status"
