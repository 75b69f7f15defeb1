#!/usr/bin/env bash
set -uo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MOETRAIN_SKIP_SETUP=1 GPU_CHECK_STAGES="build" scripts/gpu_check.sh > $OUT/build.txt 2>&1 || { tail -50 $OUT/build.txt; exit 1; }
cd build-gpu
ctest -j4 -R "context_parallel|cuda_golden|cuda_expert_window" --output-on-failure > $OUT/ctest.txt 2>&1
grep -E "rank .*chose|DIFFERENT|EQUAL|differs" $OUT/ctest.txt | head -40
grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.txt | tail -30
