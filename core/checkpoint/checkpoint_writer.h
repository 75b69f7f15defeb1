// Saving one checkpoint: the commit protocol of docs/CHECKPOINTS.md, run by every rank.
//
//   1. rank 0 refuses an existing step_<N>, clears a stale step_<N>.tmp, creates it   [agree]
//   2. every rank writes rank_<R>.safetensors into it, fsyncs, digests (size + crc32)  [agree]
//   3. the digests and data cursors are gathered to rank 0
//   4. rank 0 writes manifest.json (fsync), renames step_<N>.tmp -> step_<N> and fsyncs the
//      root (the commit), replaces `latest` by temp + rename, then prunes old checkpoints
//   5. every rank leaves together                                                      [agree]
// [agree]: the ranks exchange success, so one rank's failure (disk full) is an error on every
// rank instead of a hang. Nothing in step_<N> is ever written after the commit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_group.h"

namespace moetrain {

// One tensor (or this rank's slice of one) to save; `host` must be CPU memory.
struct ShardTensor {
  std::string key;  // "<kind>/<global name>", see checkpoint_format.h
  TensorView host;
  TensorSlice slice;  // global shape and row offset; rows = host.shape[0]
};

// What this rank saves.
struct RankShard {
  std::vector<ShardTensor> tensors;
  uint64_t data_cursor = 0;
  uint64_t rng_state = 0;
};

struct SaveRequest {
  std::string root;        // the checkpoint directory (created when missing)
  int64_t step = 0;        // optimizer steps completed
  int64_t tokens = 0;
  int64_t optimizer_steps = 0;
  int64_t fsdp = 1;
  int64_t ep = 1;
  std::string config_yaml;
  int64_t keep_last = 2;   // committed checkpoints kept after this one is committed
};

// Runs the protocol; returns the committed directory <root>/step_<N> on every rank.
// Error(kBadCheckpoint) on every rank when any rank fails (the partial step_<N>.tmp stays for
// the next run's cleanup; committed checkpoints are untouched).
std::string save_checkpoint(CheckpointGroup& group, const SaveRequest& request, const RankShard& shard);

}  // namespace moetrain
