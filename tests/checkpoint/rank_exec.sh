#!/bin/sh
# One MPI rank of a multi-rank checkpoint test: `rank_exec.sh BASE COMMAND...` runs COMMAND with
# logging.run_dir BASE/rank<R> (so each rank's metrics.jsonl can be read on its own) after writing
# its pid to BASE/pid.<R> (exec keeps the pid, so a test can signal exactly this rank).
base=$1
shift
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
mkdir -p "$base"
echo $$ > "$base/pid.$rank.tmp" && mv "$base/pid.$rank.tmp" "$base/pid.$rank"
exec "$@" --set "logging.run_dir=$base/rank$rank"
