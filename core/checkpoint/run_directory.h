// What a training run owns on disk, claimed and checked before any step (docs/CHECKPOINTS.md,
// "The run directory"):
//
//   - Locks. <logging.run_dir>/moetrain.lock, and <checkpoint root>/moetrain.lock when the root
//     lies outside the run directory, hold the owner's pid and host while an flock(2) on them is
//     held. A second run exits 2 naming the owner. A lock whose owner died (the kernel dropped its
//     flock) is taken over, and said so.
//   - Output paths. logging.run_dir, the checkpoint root and the adapter export directory are
//     each a directory this process can write in (created when missing), so that a path that is
//     a regular file or read-only fails now, not after the last step.
//   - No mixing with an older run. A fresh start (--resume none, or auto with nothing to resume)
//     in a checkpoint root that holds committed checkpoints, or a resume from step S of a root
//     holding checkpoints past S, is refused (exit 2): keep_last would delete the new saves as
//     "older". With checkpoint.overwrite: true those checkpoints are moved aside instead (renamed
//     into <root>.old-<UTC time>/, never deleted). A fresh start moves an earlier metrics.jsonl
//     aside (metrics.old-<UTC time>.jsonl), so that one file never holds two runs.
//
// Rank 0 does all of it (core/run/run_training.cpp agrees the outcome with the other ranks).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace moetrain {

// An flock(2)-held lock file naming its owner. Released (and emptied) on destruction.
class DirectoryLock {
 public:
  // Creates `dir` when missing and locks <dir>/moetrain.lock. `setting` names the config key the
  // directory comes from, for the messages. Error(kBadConfig) when another live process holds it.
  DirectoryLock(const std::string& dir, const std::string& setting);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// The directories a run writes: the run directory, the checkpoint root, and the adapter export
// directory (empty when checkpoint.export_adapter is off).
struct RunPaths {
  std::string run_dir;
  std::string checkpoint_root;
  std::string export_dir;
};
RunPaths run_paths(const Config& config);

// Claims the run's directories for this process (rank 0): checks every output path, takes the
// locks and settles a fresh start or a resume against what the checkpoint root holds (see the
// top of this file). The locks are held for as long as the returned object lives.
class RunDirectory {
 public:
  explicit RunDirectory(const Config& config);

  // True when the run starts from step 0 (nothing will be resumed).
  bool fresh_start() const { return fresh_start_; }

 private:
  std::vector<std::unique_ptr<DirectoryLock>> locks_;
  bool fresh_start_ = true;
};

}  // namespace moetrain
