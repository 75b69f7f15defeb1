#!/usr/bin/env bash
# The GPU machine's check: builds with the CUDA backend for Hopper, lists the GPUs, runs every
# CTest test (the CUDA ones included), writes the whole log to ${OUT:-/tmp}/gpu_check.log and
# prints a pass/fail table last. On this machine a skipped test counts as a failure: the CUDA
# tests skip only when they see no GPU.
#   BUILD_DIR=...           build directory (default: <repo>/build-gpu)
#   CUDA_ARCH=...           CMAKE_CUDA_ARCHITECTURES (default 90a)
#   MOETRAIN_SKIP_SETUP=1   do not check system packages (a machine without apt access)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${BUILD_DIR:-$repo/build-gpu}"
log_dir="${OUT:-/tmp}"
log="$log_dir/gpu_check.log"
mkdir -p "$log_dir"
: >"$log"

if [[ "${MOETRAIN_SKIP_SETUP:-0}" != 1 ]]; then
  "$repo/scripts/setup.sh" 2>&1 | tee -a "$log"
fi
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

echo "== GPUs" | tee -a "$log"
nvidia-smi -L 2>&1 | tee -a "$log" || echo "gpu_check: nvidia-smi failed" | tee -a "$log"

generator=()
if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
echo "== build ($build_dir; output in $log)"
started=$SECONDS
if ! { cmake -S "$repo" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
         -DMOETRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a}" &&
       cmake --build "$build_dir" --parallel "$(nproc)"; } >>"$log" 2>&1; then
  tail -n 40 "$log"
  echo "gpu_check: build FAILED (full log: $log)"
  exit 1
fi
echo "gpu_check: built in $((SECONDS - started)) s"

echo "== tests"
# One test at a time: the CUDA tests share the GPU(s).
ctest_status=0
(cd "$build_dir" && ctest --output-on-failure) >>"$log" 2>&1 || ctest_status=$?

# Benchmarks and the single-GPU training run (issue 4). Their output goes to the log and, as
# short summaries, to the end of this script's output.
#   MOETRAIN_BENCH=0           skip moetrain-bench
#   MOETRAIN_TRAIN_STEPS=N     steps of the configs/h200-kimi-dims-mla.yaml run (0 skips it; default 200)
bench_summary=""
if [[ "${MOETRAIN_BENCH:-1}" != 0 && -x "$build_dir/apps/moetrain-bench" ]]; then
  echo "== moetrain-bench ops"
  "$build_dir/apps/moetrain-bench" ops >"$log_dir/bench_ops.log" 2>&1 || echo "gpu_check: moetrain-bench ops FAILED"
  cat "$log_dir/bench_ops.log" >>"$log"
  echo "== moetrain-bench step (op times after the timed steps)"
  "$build_dir/apps/moetrain-bench" step --config "$repo/configs/h200-kimi-dims-mla.yaml" --op-times \
    >"$log_dir/bench_step.log" 2>&1 || echo "gpu_check: moetrain-bench step FAILED"
  cat "$log_dir/bench_step.log" >>"$log"
  echo "== moetrain-bench step with MOETRAIN_CUDA_ALLOCATOR=caching"
  MOETRAIN_CUDA_ALLOCATOR=caching "$build_dir/apps/moetrain-bench" step \
    --config "$repo/configs/h200-kimi-dims-mla.yaml" >"$log_dir/bench_step_caching.log" 2>&1 ||
    echo "gpu_check: moetrain-bench step (caching allocator) FAILED"
  cat "$log_dir/bench_step_caching.log" >>"$log"
  bench_summary="$(sed -n '/^benchmark /,$p' "$log_dir/bench_ops.log"; grep -E '^(step|memory):' "$log_dir/bench_step.log"
                   grep -E '^(step: median|memory:)' "$log_dir/bench_step_caching.log" | sed 's/^\([a-z]*\):/\1 (caching allocator):/')"
fi
train_summary=""
steps="${MOETRAIN_TRAIN_STEPS:-200}"
if ((steps > 0)); then
  echo "== training run: configs/h200-kimi-dims-mla.yaml, $steps steps"
  run_dir="$log_dir/train_run"
  if "$build_dir/apps/moetrain" train --config "$repo/configs/h200-kimi-dims-mla.yaml" --set "train.steps=$steps" \
       --set "train.warmup_steps=$((steps / 10))" --set "logging.run_dir=$run_dir" --set checkpoint.every=0 \
       >"$log_dir/train_run.log" 2>&1; then
    train_summary="$(grep -E 'step +[0-9]+/|done:' "$log_dir/train_run.log" | sed -n '1p;$p;' )"
  else
    train_summary="training run FAILED (see $log_dir/train_run.log): $(tail -n 3 "$log_dir/train_run.log")"
  fi
  cat "$log_dir/train_run.log" >>"$log"
fi

# The table: one row per test from ctest's progress lines ("  3/14 Test  #3: name ....   Passed").
echo "== results (full log: $log)"
failures=0
while read -r name result; do
  case "$result" in
    Passed) verdict=pass ;;
    *Skipped*) verdict="FAIL (skipped: no GPU seen)"; failures=$((failures + 1)) ;;
    *) verdict="FAIL (${result#\*\*\*})"; failures=$((failures + 1)) ;;
  esac
  printf '%-40s %s\n' "$name" "$verdict"
done < <(sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*( |\*)+([A-Za-z*][^ ]*( [A-Za-z]+)?) .*/\1 \3/p' "$log")
[[ -n "$bench_summary" ]] && printf '%s\n' "$bench_summary"
[[ -n "$train_summary" ]] && printf 'train: %s\n' "$train_summary"
if ((ctest_status != 0 || failures != 0)); then
  echo "gpu_check: FAILED ($failures test(s) failed or skipped, ctest exit $ctest_status)"
  exit 1
fi
echo "gpu_check: all tests passed"
