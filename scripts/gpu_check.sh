#!/usr/bin/env bash
# The GPU machine's check: builds with the CUDA backend for Hopper, lists the GPUs, runs every
# CTest test (the CUDA ones included), the benchmarks and a training run, writes the whole log to
# ${OUT:-/tmp}/gpu_check.log and prints a short table last. On this machine a skipped test counts
# as a failure: the CUDA tests skip only when they see no GPU.
#   BUILD_DIR=...            build directory (default: <repo>/build-gpu)
#   CUDA_ARCH=...            CMAKE_CUDA_ARCHITECTURES (default 90a)
#   MOETRAIN_SKIP_SETUP=1    do not check system packages (a machine without apt access)
#   GPU_CHECK_STAGES="..."   which stages to run, in this order (default: all of them):
#     build   configure and build
#     tests   every CTest test, one at a time (the CUDA tests share the GPU)
#     ops     moetrain-bench ops (kernels against the ceilings and peers) and, where torch is
#             installed, scripts/bench_torch_grouped_mm.py (the grouped-GEMM peer, same run)
#     golden  scripts/make_fixtures_kimi_linear.py (transformers golden files) into $OUT/golden
#     merge   test_merged_export writes merged models (moetrain merge) and their logits with the
#             adapter; scripts/check_merged_export.py loads each in transformers and compares
#     step    moetrain-bench step on configs/h200-kimi-dims-mla.yaml: recompute on (op times),
#             recompute off, and the direct (uncached) allocator; and the KDA slice
#     long    long sequences: moetrain-bench step on the KDA slice at 131,072 tokens whole and in
#             feed-forward chunks, and at 262,144 (the plan's chunk), each beside the plan's peak
#     train   the training run (MOETRAIN_TRAIN_STEPS, default 100) on configs/h200-kimi-dims-mla.yaml
# A command of the GPU machine may run 10 minutes: `build tests ops golden` fit one, and
# `build step train` another (the build is kept while the machine stays warm).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${BUILD_DIR:-$repo/build-gpu}"
log_dir="${OUT:-/tmp}"
log="$log_dir/gpu_check.log"
stages=" ${GPU_CHECK_STAGES:-build tests ops golden merge step train} "
mkdir -p "$log_dir"
: >"$log"
want() { [[ "$stages" == *" $1 "* ]]; }
summary=()

if [[ "${MOETRAIN_SKIP_SETUP:-0}" != 1 ]]; then
  "$repo/scripts/setup.sh" 2>&1 | tee -a "$log"
fi
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

echo "== GPUs" | tee -a "$log"
nvidia-smi -L 2>&1 | tee -a "$log" || echo "gpu_check: nvidia-smi failed" | tee -a "$log"
echo "== commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')" | tee -a "$log"

if want build; then
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
fi
bench="$build_dir/apps/moetrain-bench"

ctest_status=0
if want tests; then
  echo "== tests"
  # Tests labelled multi_gpu need two GPUs; on a one-GPU machine they are left out (and said so)
  # rather than counted as skipped: scripts/gpu_check_multi.sh runs on a two-GPU machine.
  ctest_select=()
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  if ((gpus < 2)); then
    ctest_select=(-LE multi_gpu)
    summary+=("tests labelled multi_gpu not run: $gpus GPU(s) here, they need 2 (scripts/gpu_check_multi.sh on a two-GPU machine): $(cd "$build_dir" && ctest -N -L multi_gpu | sed -nE 's/^ *Test +#[0-9]+: //p' | tr '\n' ' ')")
  fi
  (cd "$build_dir" && ctest --output-on-failure "${ctest_select[@]}" ${CTEST_ARGS:-}) >>"$log" 2>&1 || ctest_status=$?
fi

if want ops; then
  echo "== moetrain-bench ops"
  "$bench" ops >"$log_dir/bench_ops.log" 2>&1 || echo "gpu_check: moetrain-bench ops FAILED" | tee -a "$log_dir/bench_ops.log"
  cat "$log_dir/bench_ops.log" >>"$log"
  summary+=("$(sed -n '/^benchmark /,$p' "$log_dir/bench_ops.log" || true)")
  if python3 -c 'import torch' 2>/dev/null && [[ -f "$repo/scripts/bench_torch_grouped_mm.py" ]]; then
    echo "== torch._grouped_mm on the same shapes"
    python3 "$repo/scripts/bench_torch_grouped_mm.py" >"$log_dir/bench_torch.log" 2>&1 ||
      echo "gpu_check: bench_torch_grouped_mm.py FAILED" | tee -a "$log_dir/bench_torch.log"
    cat "$log_dir/bench_torch.log" >>"$log"
    summary+=("$(tail -n 12 "$log_dir/bench_torch.log" || true)")
  fi
fi

if want golden; then
  echo "== golden files (transformers + PEFT) into $log_dir/golden"
  if python3 "$repo/scripts/make_fixtures_kimi_linear.py" --out "$log_dir/golden" >"$log_dir/golden.log" 2>&1; then
    summary+=("golden: written to $log_dir/golden ($(du -sh "$log_dir/golden" | cut -f1))")
  else
    summary+=("golden: make_fixtures_kimi_linear.py FAILED: $(tail -n 3 "$log_dir/golden.log" || true)")
  fi
  cat "$log_dir/golden.log" >>"$log"
fi

if want merge; then
  echo "== merged exports against transformers"
  merge_dir="$log_dir/merge"
  if MOETRAIN_MERGE_EXPORT_DIR="$merge_dir" "$build_dir/tests/test_merged_export" >"$log_dir/merge.log" 2>&1 &&
     python3 "$repo/scripts/check_merged_export.py" "$merge_dir" --device cuda >>"$log_dir/merge.log" 2>&1; then
    summary+=("merge: $(tail -n 4 "$log_dir/merge.log")")
  else
    summary+=("merge: FAILED: $(tail -n 6 "$log_dir/merge.log")")
  fi
  cat "$log_dir/merge.log" >>"$log"
fi

step_run() {  # name, then moetrain-bench step arguments
  local name="$1"
  shift
  echo "== moetrain-bench step: $name"
  if "$bench" step "$@" >"$log_dir/step_$name.log" 2>&1; then
    summary+=("$(grep -E '^(step|memory):' "$log_dir/step_$name.log" | sed "s/^/[$name] /" || true)")
  else
    summary+=("[$name] moetrain-bench step FAILED: $(tail -n 2 "$log_dir/step_$name.log")")
  fi
  cat "$log_dir/step_$name.log" >>"$log"
}

if want step; then
  mla="$repo/configs/h200-kimi-dims-mla.yaml"
  step_run recompute_on --config "$mla" --op-times
  step_run recompute_off --config "$mla" --set parallel.recompute=false --op-times
  MOETRAIN_CUDA_ALLOCATOR=direct step_run direct_allocator --config "$mla"
  if [[ -f "$repo/configs/h200-kimi-linear-slice.yaml" ]]; then
    step_run kda_slice --config "$repo/configs/h200-kimi-linear-slice.yaml" --op-times
  fi
fi

if want long; then
  slice="$repo/configs/h200-kimi-linear-slice.yaml"
  long_run() {  # name, then --set overrides for both the plan and the step
    local name="$1"
    shift
    local peak
    # The plan's exit code says whether it fits (5: not); its JSON is printed either way.
    peak="$({ "$build_dir/apps/moetrain" plan --config "$slice" --world 1 --json "$@" 2>/dev/null || true; } |
      python3 -c 'import json,sys; p=json.load(sys.stdin); print("plan peak %.2f GB, chunk %d" % (p["memory"]["peak_bytes_recompute"]/1e9, p["ffn_chunk_tokens"]))' ||
      echo "plan FAILED")"
    summary+=("[$name] $peak")
    step_run "$name" --config "$slice" --steps 3 "$@"
  }
  long_run slice_T131072 --set data.seq_len=131072
  long_run slice_T131072_chunks16384 --set data.seq_len=131072 --set parallel.ffn_chunk_tokens=16384
  long_run slice_T262144 --set data.seq_len=262144
fi

if want train; then
  steps="${MOETRAIN_TRAIN_STEPS:-100}"
  echo "== training run: configs/h200-kimi-dims-mla.yaml, $steps steps"
  run_dir="$log_dir/train_run"
  if "$build_dir/apps/moetrain" train --config "$repo/configs/h200-kimi-dims-mla.yaml" --set "train.steps=$steps" \
       --set "train.warmup_steps=$((steps / 10))" --set "logging.run_dir=$run_dir" --set checkpoint.every=0 \
       --set data.eval.source=synthetic --set data.eval.windows=8 --set "train.eval_every=$((steps / 2))" \
       >"$log_dir/train_run.log" 2>&1; then
    summary+=("train: $(grep -E 'step +[0-9]+/|done:|summary:|peak tensor memory' "$log_dir/train_run.log" | sed -n '1p;$p;' || true)")
    summary+=("train eval: $(grep -E 'eval loss' "$log_dir/train_run.log" | tail -n 1 || true)")
  else
    summary+=("train: FAILED (see $log_dir/train_run.log): $(tail -n 3 "$log_dir/train_run.log")")
  fi
  cat "$log_dir/train_run.log" >>"$log"
fi

# The table: one row per test from ctest's progress lines ("  3/14 Test  #3: name ....   Passed").
echo "== results (full log: $log)"
failures=0
if want tests; then
  while read -r name result; do
    case "$result" in
      Passed) verdict=pass ;;
      *Skipped*) verdict="FAIL (skipped: no GPU seen)"; failures=$((failures + 1)) ;;
      *) verdict="FAIL (${result#\*\*\*})"; failures=$((failures + 1)) ;;
    esac
    [[ "$verdict" == pass && -n "${GPU_CHECK_QUIET_PASSES:-}" ]] || printf '%-40s %s\n' "$name" "$verdict"
  done < <(sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*( |\*)+([A-Za-z*][^ ]*( [A-Za-z]+)?) .*/\1 \3/p' "$log")
  grep -E '^[0-9]+% tests passed' "$log" || true
fi
for line in "${summary[@]}"; do printf '%s\n' "$line"; done
if ((ctest_status != 0 || failures != 0)); then
  echo "gpu_check: FAILED ($failures test(s) failed or skipped, ctest exit $ctest_status)"
  exit 1
fi
echo "gpu_check: done (stages:$stages)"
