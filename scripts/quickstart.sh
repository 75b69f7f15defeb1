#!/usr/bin/env bash
# The main job from a fresh clone: installs missing packages, builds moetrain, and fine-tunes the
# quickstart model (configs/quickstart.yaml: a tiny MLA + MoE model with LoRA on synthetic data).
# train.device is auto: the GPU when the build has CUDA and one is visible, else the CPU reference
# backend, so it runs on any machine; expect about a minute on a CPU. Then it draws the run's
# plots next to its metrics.jsonl (scripts/plot_metrics.py) when matplotlib is installed.
# Extra arguments go to `moetrain train`, e.g. scripts/quickstart.sh --set train.steps=20
# Run again, it starts afresh (the earlier run's checkpoints and metrics moved aside).
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
# Each quickstart is a fresh run: an earlier one's checkpoints and metrics in the run directory are
# moved aside (renamed *.old-<time>, never deleted), unless the arguments choose a --resume.
fresh=(--resume none --set checkpoint.overwrite=true)
for argument in "$@"; do
  if [[ "$argument" == --resume* ]]; then fresh=(); fi
done
"$build_dir/apps/moetrain" train --config configs/quickstart.yaml "${fresh[@]}" "$@"
run_dir=runs/quickstart
for argument in "$@"; do
  if [[ "$argument" == logging.run_dir=* ]]; then run_dir="${argument#logging.run_dir=}"; fi
done
echo "quickstart: metrics in $run_dir/metrics.jsonl, resolved config in $run_dir/config.yaml"

# Plots of the run (loss, lr, gradient norm, throughput, expert load) when matplotlib is there.
if command -v python3 >/dev/null && python3 scripts/plot_metrics.py --check >/dev/null 2>&1; then
  python3 scripts/plot_metrics.py "$run_dir"
else
  echo "quickstart: no plots: matplotlib is missing (scripts/setup.sh installs python3-matplotlib);" \
    "then: python3 scripts/plot_metrics.py $run_dir"
fi
