// Checkpointing for one training run, as `moetrain train` uses it (core/run/run_training.cpp):
//
//   CheckpointSession session(config, group, trainer, backend, data);
//   session.resume();                                   // --resume auto | none | PATH
//   trainer.set_after_step([&](const StepRecord&) { session.after_step(); });
//   trainer.run();
//   session.finish();                                   // final save, adapter export
//
// after_step saves every checkpoint.every steps and handles preemption: when any rank has
// received SIGTERM/SIGUSR1 (the ranks agree at the step boundary), it saves and throws
// Error(kPreempted) so every rank exits with 75.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint_group.h"
#include "core/checkpoint/training_state.h"
#include "core/config/config.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"

namespace moetrain {

// The data source, seen through its cursor (whatever the source counts in: a uint64 that seek()
// turns back into the same stream position).
// The optional rng pair is the model's random stream position (router noise draws), saved per
// rank; leave it empty while the model has none to restore.
struct DataCursorAccess {
  std::function<uint64_t()> cursor;
  std::function<void(uint64_t)> seek;
  std::function<uint64_t()> rng_state;
  std::function<void(uint64_t)> set_rng_state;
};

class CheckpointSession {
 public:
  CheckpointSession(const Config& config, CheckpointGroup& group, Trainer& trainer, kernels::Backend& backend,
                    DataCursorAccess data, ParameterLayout layout = {});

  // <checkpoint.dir>, or <logging.run_dir>/checkpoints.
  const std::string& root() const { return root_; }

  // Applies checkpoint.resume: "none" starts fresh; "auto" the newest committed checkpoint
  // under root() that is intact and finite (fresh when there is none; an unusable one is
  // renamed step_<N>.unusable with a warning and the one before it tried); anything else is a
  // checkpoint or root path, which must be intact and finite. Leftover step_*.tmp directories
  // are removed first. A checkpoint at or past train.steps is Error(kBadConfig): nothing to do.
  // A config that differs from the saved one is a warning naming the keys, or, when the
  // trained tensors no longer match, Error(kBadConfig) naming them. Returns true when state was
  // restored.
  bool resume();

  // Call after every optimizer step (Trainer::set_after_step). Saves every checkpoint.every
  // steps, except while the run is unhealthy (its last update skipped as non-finite): then the
  // older checkpoints stay as they are.
  void after_step();

  // After the last step: saves the final state (whatever checkpoint.every is, unless just saved),
  // then exports the adapter when checkpoint.export_adapter asks for it. A run that ends
  // unhealthy saves nothing and throws Error(kInternal).
  void finish();

  // Saves the current state now (all ranks); returns the committed directory.
  std::string save_now();

  // checkpoint.export_adapter resolved: empty when off.
  std::string export_dir() const;

 private:
  // The resolved config's differences from the one `manifest` was saved with, beyond what a
  // resumed run may change ("key: saved -> now").
  std::vector<std::string> differences_from(const Manifest& manifest, const std::string& source) const;
  std::string newest_usable_checkpoint();
  std::string unhealthy_state() const;  // for messages: what went wrong, the last good checkpoint

  Config config_;
  CheckpointGroup& group_;
  Trainer& trainer_;
  kernels::Backend& backend_;
  DataCursorAccess data_;
  ParameterLayout layout_;
  std::string root_;
  int64_t last_saved_step_ = -1;
  std::string last_saved_path_;
};

}  // namespace moetrain
