#!/usr/bin/env bash
# lead's verification: build, all tests (-j6 without cuda_large), then cuda_large serially
set -uo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MOETRAIN_SKIP_SETUP=1 GPU_CHECK_STAGES="build" scripts/gpu_check.sh > $OUT/build.txt 2>&1 || { tail -50 $OUT/build.txt; exit 1; }
cp $OUT/gpu_check.log $OUT/build.log 2>/dev/null
cd build-gpu
ctest -j6 -E cuda_large --output-on-failure -LE multi_gpu > $OUT/ctest.txt 2>&1
ctest -R cuda_large --output-on-failure > $OUT/ctest_large.txt 2>&1
grep -E "tests passed|Failed|\*\*\*|Not Run|Skipped" $OUT/ctest.txt | tail -30
grep -E "tests passed|Failed|\*\*\*|Test +#" $OUT/ctest_large.txt | tail -20
