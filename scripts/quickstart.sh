#!/usr/bin/env bash
# The main job from a fresh clone: installs missing packages, builds moetrain, and fine-tunes the
# quickstart model (configs/quickstart.yaml: a tiny MLA + MoE model with LoRA on synthetic data).
# train.device is auto: the GPU when the build has CUDA and one is visible, else the CPU reference
# backend, so it runs on any machine; expect about a minute on a CPU.
# Extra arguments go to `moetrain train`, e.g. scripts/quickstart.sh --set train.steps=20
#   BUILD_DIR=...          build directory (default: <repo>/build)
#   MOETRAIN_SKIP_SETUP=1  do not check system packages
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${BUILD_DIR:-$repo/build}"

if [[ "${MOETRAIN_SKIP_SETUP:-0}" != 1 ]]; then
  "$repo/scripts/setup.sh"
fi
generator=()
if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
cmake -S "$repo" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_CUDA=AUTO >/dev/null
cmake --build "$build_dir" --parallel "$(nproc)" --target moetrain

cd "$repo"
"$build_dir/apps/moetrain" train --config configs/quickstart.yaml "$@"
echo "quickstart: metrics in runs/quickstart/metrics.jsonl, resolved config in runs/quickstart/config.yaml"
