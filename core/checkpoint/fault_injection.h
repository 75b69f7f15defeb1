// Fault injection for the crash-safety and hang tests (docs/CHECKPOINTS.md):
//   MOETRAIN_FAULT=ACTION:rank=R:phase=P[:hit=N]   (R a rank number or `all`; N: the N-th time
//                                                    this phase is reached, default 1)
// makes rank R, when it reaches phase P of a checkpoint save,
//   kill  kill itself with SIGKILL (no cleanup, no flush: a power cut as far as the checkpoint
//         directory can tell), or
//   hang  stop making progress forever (a wedged node: the others wait in a collective until
//         the watchdog, parallel.timeout_s, aborts the job).
// Phases:
//   after_shard_write   every rank, its shard written and fsynced, before the barrier
//   before_manifest     rank 0, all shards on disk, manifest not written
//   before_rename       rank 0, manifest written, step_<N>.tmp not yet renamed
//   before_latest       rank 0, step_<N> committed, `latest` not yet updated
//   during_cleanup      rank 0, an old checkpoint half deleted
// Unset: every fault_point is a no-op.
#pragma once

namespace moetrain {

// Kills this process when MOETRAIN_FAULT names this rank and `phase`. A malformed variable is
// Error(kBadConfig) naming it (checked the first time a fault point is reached).
void fault_point(const char* phase, int rank);

}  // namespace moetrain
