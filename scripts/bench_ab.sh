#!/usr/bin/env bash
# A same-run A/B of `moetrain-bench step`: two builds of the bench, the baseline and this tree,
# timed in alternation on the H200 configs, so that clock and power-cap drift fall on both alike.
# Prints one row per config: the median of the per-round step medians of each build, and B/A.
#   scripts/bench_ab.sh BASELINE_SRC [ROUNDS]
#     BASELINE_SRC  a source tree of the baseline (e.g. `git archive REV | tar -x -C DIR`)
#     ROUNDS        alternations per config (default 3)
#   BASE_BUILD / NEW_BUILD   build directories (default: BASELINE_SRC/build-ab, <repo>/build-gpu)
#   AB_CONFIGS               configs to time (default: the three H200 configs)
#   AB_STEPS                 timed steps per bench run (default 5)
# Logs go to ${OUT:-/tmp}/bench_ab/.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base_src="$(cd "${1:?usage: scripts/bench_ab.sh BASELINE_SRC [ROUNDS]}" && pwd)"
rounds="${2:-3}"
base_build="${BASE_BUILD:-$base_src/build-ab}"
new_build="${NEW_BUILD:-$repo/build-gpu}"
steps="${AB_STEPS:-5}"
configs=(${AB_CONFIGS:-configs/h200-kimi-dims-mla.yaml configs/h200-kimi-linear-slice.yaml configs/h200-kimi-k3-slice.yaml})
log_dir="${OUT:-/tmp}/bench_ab"
mkdir -p "$log_dir"

build_bench() {  # source dir, build dir
  if [[ ! -x "$2/apps/moetrain-bench" ]]; then
    local generator=()
    [[ -f "$2/CMakeCache.txt" ]] || ! command -v ninja >/dev/null || generator=(-G Ninja)
    cmake -S "$1" -B "$2" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_CUDA=ON \
      -DMOETRAIN_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a}" >"$log_dir/configure_$(basename "$2").log" 2>&1
  fi
  cmake --build "$2" --target moetrain-bench --parallel "$(nproc)" >"$log_dir/build_$(basename "$2").log" 2>&1 ||
    { tail -n 30 "$log_dir/build_$(basename "$2").log"; echo "bench_ab: build of $1 FAILED"; exit 1; }
}
build_bench "$base_src" "$base_build"
build_bench "$repo" "$new_build"

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit } print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
step_ms() {  # bench binary, config, log file: prints the run's median step time in ms
  "$1" step --config "$2" --steps "$steps" >"$3" 2>&1 || { echo "bench_ab: $1 step --config $2 FAILED (log $3)" >&2; tail -n 5 "$3" >&2; return 1; }
  sed -nE 's/^step: median ([0-9.]+) ms.*/\1/p' "$3"
}

printf '%-40s %12s %12s %8s\n' config "A ms" "B ms" "B/A"
status=0
for config in "${configs[@]}"; do
  name="$(basename "$config" .yaml)"
  : >"$log_dir/$name.A"
  : >"$log_dir/$name.B"
  for ((r = 1; r <= rounds; r++)); do
    # Alternate which build goes first, so that neither always runs on the warmer card.
    if ((r % 2)); then order=(A B); else order=(B A); fi
    for side in "${order[@]}"; do
      if [[ $side == A ]]; then bench="$base_build/apps/moetrain-bench"; cfg="$base_src/$config"; else bench="$new_build/apps/moetrain-bench"; cfg="$repo/$config"; fi
      ms="$(step_ms "$bench" "$cfg" "$log_dir/${name}_${side}_$r.log")" || { status=1; continue; }
      echo "$ms" >>"$log_dir/$name.$side"
    done
  done
  a="$(median <"$log_dir/$name.A")"
  b="$(median <"$log_dir/$name.B")"
  printf '%-40s %12s %12s %8s   (A: %s; B: %s)\n' "$name" "$a" "$b" "$(awk -v a="$a" -v b="$b" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "nan" }')" \
    "$(paste -sd, "$log_dir/$name.A")" "$(paste -sd, "$log_dir/$name.B")"
done
exit $status
