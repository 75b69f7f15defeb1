#!/bin/bash
# mpirun MPIRUN_ARGS... with the scheduler's stop signals passed to the ranks so that they save:
# SIGTERM, SIGINT, SIGHUP and SIGUSR1 to this script become SIGUSR1 to mpirun and to the ranks
# mpirun started on this node. Open MPI's mpirun forwards SIGUSR1 to every rank and then exits
# with the ranks' status (75: saved, requeue me), whereas a SIGTERM to mpirun itself kills the
# ranks' saves short and makes mpirun exit 1. Some builds of mpirun do not forward SIGUSR1 at all
# (Ubuntu 24.04's Open MPI 4.1.6, docs/CHECKPOINTS.md), so the local ranks are signalled directly
# too; a rank that gets the signal twice saves once.
# Exits with mpirun's status. Used by train_multi_node.sbatch (LAUNCHER=mpirun); usable alone:
#   scripts/slurm/mpirun_preemptible.sh -np 16 build/apps/moetrain train --config C --resume auto
#   MPIRUN=...  the launcher (default: mpirun on PATH); it must be the Open MPI moetrain was built with
set -u
"${MPIRUN:-mpirun}" "$@" &
child=$!
stop_ranks() {
  kill -USR1 $child 2>/dev/null
  pkill -USR1 -P $child 2>/dev/null
}
for signal in TERM INT HUP USR1; do
  trap stop_ranks "$signal"
done
wait $child
rc=$?
# wait returns early when a trapped signal arrives: wait again for the real exit status.
while kill -0 $child 2>/dev/null; do
  wait $child
  rc=$?
done
exit "$rc"
