#!/usr/bin/env bash
# Installs the system packages moetrain builds with (Debian 12 or Ubuntu 24.04; the package
# names are the same on both). Idempotent and fast when everything is present: it asks dpkg
# first and only runs apt-get (update + install) for what is missing. Uses sudo unless root.
set -euo pipefail

packages=(
  build-essential cmake ninja-build        # compiler, CMake >= 3.25, Ninja
  libopenmpi-dev openmpi-bin               # MPI (mpirun for the multi-rank tests)
  libyaml-cpp-dev libspdlog-dev libfmt-dev libcxxopts-dev
  catch2 nlohmann-json3-dev zlib1g-dev
  python3-matplotlib                       # scripts/plot_metrics.py (and its ctest)
)

# Build tools that may come from elsewhere (pip, a venv): a command on PATH is enough.
declare -A provided_by_command=([cmake]=cmake [ninja-build]=ninja)

missing=()
for package in "${packages[@]}"; do
  command_name="${provided_by_command[$package]:-}"
  if [[ -n "$command_name" ]] && command -v "$command_name" >/dev/null; then
    continue
  fi
  # `dpkg -s` also succeeds for removed packages whose config files remain: check the status.
  status="$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)"
  [[ "$status" == "install ok installed" ]] || missing+=("$package")
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  if ! command -v apt-get >/dev/null; then
    echo "setup: apt-get not found; install these packages by hand: ${missing[*]}" >&2
    exit 1
  fi
  as_root=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: not root and no sudo; run as root" >&2; exit 1; }
    as_root=(sudo)
  fi
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#packages[@]} packages present"
fi

# CMakeLists.txt needs 3.25 (Debian 12 and Ubuntu 24.04 ship it; Ubuntu 22.04 does not).
cmake_version="$(cmake --version | head -n1 | awk '{print $3}')"
if [[ "$(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -n1)" != 3.25 ]]; then
  echo "setup: cmake $cmake_version is older than 3.25; install a newer one (e.g. pip install cmake)" >&2
  exit 1
fi
