// The checkpoint root directory: which checkpoints are committed, which are leftovers of a
// crash, and keep-last-N pruning.
//
// Committed means: a directory named exactly step_<N> that holds manifest.json. A save writes
// step_<N>.tmp/ and renames it to step_<N>/ only once every shard and the manifest are on
// disk, so the rename is the commit. Deletion is the reverse: step_<N> is first renamed to
// step_<N>.deleting (one atomic step: from then on it is not a checkpoint), then removed, so a
// crash half way through a deletion never leaves a half-deleted directory that looks committed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moetrain {

struct CheckpointRef {
  int64_t step = 0;
  std::string path;  // <root>/step_<N>
};

// Committed checkpoints under `root`, oldest first (none when root does not exist).
std::vector<CheckpointRef> list_committed_checkpoints(const std::string& root);
std::optional<CheckpointRef> newest_committed_checkpoint(const std::string& root);

// Removes step_*.tmp and step_*.deleting leftovers (rank 0 only, before a run starts saving).
// Returns how many it removed.
int remove_incomplete_checkpoints(const std::string& root);

// Deletes committed checkpoints beyond the newest `keep_last` (>= 1). `rank` is for the
// during_cleanup fault point.
void prune_checkpoints(const std::string& root, int64_t keep_last, int rank);

// A --resume argument: a committed checkpoint directory (holds manifest.json) as is, or a root
// directory of checkpoints, meaning its newest committed one. Error(kBadCheckpoint) otherwise.
std::string resolve_checkpoint_path(const std::string& path);

}  // namespace moetrain
