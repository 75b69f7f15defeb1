#include "core/checkpoint/checkpoint_session.h"

#include <fmt/format.h>

#include <filesystem>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/checkpoint/checkpoint_writer.h"
#include "core/checkpoint/preemption.h"
#include "core/checkpoint/run_directory.h"
#include "core/checkpoint/training_state.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

// Settings a resumed run may change without breaking its continuation: where things go, how
// long it runs, how it is launched (resharding handles the layout). A reshard keeps the global
// batch, data.micro_batch x world / parallel.cp (the ranks of a context-parallel group share
// their micro-batches), so that is what is compared.
Config without_resumable_differences(Config c, int world) {
  const int64_t data_groups = world / c.parallel.cp;
  Config defaults;
  c.checkpoint = defaults.checkpoint;
  c.logging = defaults.logging;
  c.parallel = defaults.parallel;
  c.train.steps = defaults.train.steps;
  c.train.device = defaults.train.device;
  // What is evaluated and how often never changes training (only data.eval.holdout does: it
  // takes documents out of the training data).
  c.train.eval_every = defaults.train.eval_every;
  c.data.eval.source = defaults.data.eval.source;
  c.data.eval.mixture = defaults.data.eval.mixture;
  c.data.eval.windows = defaults.data.eval.windows;
  c.data.micro_batch *= data_groups;
  return c;
}

std::string joined(const std::vector<std::string>& items, const char* separator) {
  std::string text;
  for (const std::string& item : items) text += (text.empty() ? "" : separator) + item;
  return text;
}

// A committed checkpoint that cannot be used is renamed step_<N>.unusable (kept for a look,
// and no longer "committed"), so that the run's next save of step N does not collide with it.
std::string set_aside_unusable(const std::string& path) {
  std::string target = path + ".unusable";
  std::error_code ec;
  for (int i = 2; fs::exists(target, ec); ++i) target = path + ".unusable." + std::to_string(i);
  fs::rename(path, target, ec);
  MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint,
                 fmt::format("cannot rename the unusable checkpoint {} to {} ({}): move it away by hand", path,
                             target, ec.message()));
  return target;
}

}  // namespace

CheckpointSession::CheckpointSession(const Config& config, CheckpointGroup& group, Trainer& trainer,
                                     kernels::Backend& backend, DataCursorAccess data, ParameterLayout layout)
    : config_(config),
      group_(group),
      trainer_(trainer),
      backend_(backend),
      data_(std::move(data)),
      layout_(std::move(layout)) {
  MOETRAIN_ASSERT(data_.cursor && data_.seek, "CheckpointSession needs the data cursor");
  root_ = run_paths(config).checkpoint_root;
  if (config.checkpoint.save_on_signal) install_preemption_handlers();
}

std::string CheckpointSession::export_dir() const { return run_paths(config_).export_dir; }

std::vector<std::string> CheckpointSession::differences_from(const Manifest& manifest, const std::string& source) const {
  Config saved = parse_config(manifest.config_yaml, source);
  return config_differences(without_resumable_differences(saved, manifest.world),
                            without_resumable_differences(config_, group_.world()));
}

std::string CheckpointSession::newest_usable_checkpoint() {
  const std::vector<CheckpointRef> committed = list_committed_checkpoints(root_);
  if (committed.empty()) {
    log::info("no checkpoint under " + root_ + ": starting from step 0");
    return "";
  }
  std::vector<std::string> skipped;
  for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
    try {
      CheckpointReader reader(it->path);
      check_checkpoint_finite(reader);
    } catch (const Error& e) {
      if (e.code() != ExitCode::kBadCheckpoint) throw;
      const std::string aside = set_aside_unusable(it->path);
      log::warn(fmt::format("--resume auto: {} cannot be resumed ({}); renamed it {} and trying the one before",
                            it->path, e.what(), aside));
      skipped.push_back(fmt::format("step {}", it->step));
      continue;
    }
    if (!skipped.empty()) {
      log::warn(fmt::format("--resume auto: resuming from {}, the newest intact checkpoint ({} unusable)", it->path,
                            joined(skipped, ", ")));
    }
    return it->path;
  }
  throw Error(ExitCode::kBadCheckpoint,
              fmt::format("no checkpoint under {} can be resumed ({} checked, each renamed *.unusable; the reasons are "
                          "above): resume another one by path (--resume PATH), or start a new run in another "
                          "logging.run_dir",
                          root_, committed.size()));
}

bool CheckpointSession::resume() {
  const std::string& mode = config_.checkpoint.resume;
  // Rank 0 cleans up, chooses and checks; every rank then opens the same checkpoint.
  std::string chosen;
  decide_on_root(group_, [&] {
    remove_incomplete_checkpoints(root_);
    if (mode == "auto") {
      chosen = newest_usable_checkpoint();
    } else if (mode != "none") {
      chosen = resolve_checkpoint_path(mode);
      check_checkpoint_finite(CheckpointReader(chosen));
    }
    if (!chosen.empty()) {
      const int64_t step = read_manifest(chosen).step;
      MOETRAIN_CHECK(step < config_.train.steps, ExitCode::kBadConfig,
                     fmt::format("nothing to do: {} is at step {} and train.steps is {}. To train on, raise "
                                 "train.steps (e.g. --set train.steps={}); for a new run, use another "
                                 "logging.run_dir",
                                 chosen, step, config_.train.steps, step + config_.train.steps));
    }
  });
  chosen = group_.broadcast_from_root(chosen);
  if (chosen.empty()) return false;

  CheckpointReader reader(chosen);
  const Manifest& manifest = reader.manifest();
  const std::vector<std::string> differences = differences_from(manifest, reader.path() + "/manifest.json");
  const std::string listed = joined(differences, "; ");
  if (!differences.empty() && group_.is_root()) {
    log::warn(fmt::format("the config differs from the one {} was saved with, in {}: the resumed run will not "
                          "reproduce an uninterrupted one",
                          reader.path(), listed));
  }
  try {
    restore_training_state(trainer_.optimizer(), backend_, layout_, reader);
  } catch (const Error& e) {
    if (differences.empty()) throw;
    // A tensor of another shape or name: the config, not the checkpoint, is what changed.
    throw Error(ExitCode::kBadConfig,
                fmt::format("{}\nThis config cannot continue {}: it differs in {}. For a new run with these settings "
                            "use another logging.run_dir; to continue this one, undo those changes",
                            e.what(), reader.path(), listed));
  }
  const std::vector<std::string> unused = restore_trained_buffers(trainer_.model(), backend_, reader);
  if (!unused.empty() && group_.is_root()) {
    log::warn(fmt::format("{} holds {} trained selection bias(es) (\"{}\", ...) that this run does not update "
                          "(model.moe.bias_update_rate 0): the run routes with the base model's bias instead",
                          reader.path(), unused.size(), unused.front()));
  }
  trainer_.set_progress(manifest.step, manifest.tokens);
  data_.seek(resumed_data_cursor(manifest, group_.rank(), group_.world()));
  if (data_.set_rng_state && manifest.world == group_.world()) {
    data_.set_rng_state(manifest.ranks[static_cast<size_t>(group_.rank())].rng_state);
  }
  last_saved_step_ = manifest.step;
  last_saved_path_ = reader.path();
  if (group_.is_root()) {
    log::info(fmt::format("resumed from {} (step {}, {} tokens, saved by {} rank(s){})", reader.path(), manifest.step,
                          manifest.tokens, manifest.world,
                          manifest.world == group_.world() ? "" : ", resharded by global tensor names"));
  }
  return true;
}

std::string CheckpointSession::save_now() {
  std::vector<Tensor> storage;
  RankShard shard = collect_training_state(trainer_.optimizer(), backend_, layout_, &storage);
  std::vector<Tensor> buffer_storage;  // apart: growing `storage` must not move what shard views
  collect_trained_buffers(trainer_.model(), backend_, group_.is_root(), shard, &buffer_storage);
  shard.data_cursor = data_.cursor();
  shard.rng_state = data_.rng_state ? data_.rng_state() : 0;
  SaveRequest request;
  request.root = root_;
  request.step = trainer_.next_step();
  request.tokens = trainer_.tokens_seen();
  request.optimizer_steps = trainer_.optimizer().step_count();
  request.fsdp = config_.parallel.fsdp;
  request.ep = config_.parallel.ep;
  request.config_yaml = config_to_yaml(config_);
  request.keep_last = config_.checkpoint.keep_last;
  last_saved_path_ = save_checkpoint(group_, request, shard);
  last_saved_step_ = request.step;
  return last_saved_path_;
}

std::string CheckpointSession::unhealthy_state() const {
  return fmt::format("the last {} step(s) had a non-finite loss or gradient norm and their updates were skipped; "
                     "{}",
                     trainer_.nonfinite_in_a_row(),
                     last_saved_path_.empty() ? std::string("no checkpoint of this run exists yet")
                                              : "the last good checkpoint is " + last_saved_path_);
}

void CheckpointSession::after_step() {
  const int64_t step = trainer_.next_step();
  const int64_t every = config_.checkpoint.every;
  // The loss and the gradient norm are global: every rank sees the same health.
  const bool healthy = trainer_.nonfinite_in_a_row() == 0;
  if (every > 0 && step % every == 0 && step != last_saved_step_) {
    if (healthy) {
      save_now();
    } else if (group_.is_root()) {
      log::warn(fmt::format("step {}: checkpoint not written ({}); the older checkpoints are kept", step,
                            unhealthy_state()));
    }
  }
  if (!config_.checkpoint.save_on_signal || !group_.any(preemption_requested())) return;
  const char* signal = preemption_requested() ? preemption_signal_name() : "a signal on another rank";
  if (step != last_saved_step_ && !healthy) {
    throw Error(ExitCode::kPreempted, fmt::format("stopped by {} after step {}, without a save: {}; requeue the "
                                                  "job (--resume auto continues from that checkpoint)",
                                                  signal, step, unhealthy_state()));
  }
  const std::string path = step == last_saved_step_ ? last_saved_path_ : save_now();
  throw Error(ExitCode::kPreempted,
              fmt::format("stopped by {} after step {}: checkpoint {} is committed; requeue the job (the same command "
                          "with --resume auto continues from it)",
                          signal, step, path));
}

void CheckpointSession::finish() {
  if (trainer_.nonfinite_in_a_row() > 0) {
    throw Error(ExitCode::kInternal,
                fmt::format("training ended unhealthy: {}. Nothing was saved or exported at the end. Lower train.lr "
                            "or set train.grad_clip, or check the data, then resume from that checkpoint",
                            unhealthy_state()));
  }
  // Always a final checkpoint (checkpoint.every only adds periodic ones), and before the export:
  // an export that fails loses nothing.
  const std::string checkpoint = trainer_.next_step() == last_saved_step_ ? last_saved_path_ : save_now();
  const std::string out = export_dir();
  if (out.empty()) return;
  try {
    decide_on_root(group_, [&] { export_checkpoint_adapter(checkpoint, out); });
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("{}\nThe adapter was not exported, but the training is saved in {}: export it "
                                      "with `moetrain export --checkpoint {} --out DIR`",
                                      e.what(), checkpoint, checkpoint));
  }
}

}  // namespace moetrain
