#include "core/checkpoint/checkpoint_session.h"

#include <fmt/format.h>

#include <filesystem>

#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/base/log.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/checkpoint/checkpoint_writer.h"
#include "core/checkpoint/preemption.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

// Settings a resumed run may change without breaking its continuation: where things go, how
// long it runs, how it is launched (resharding handles the layout).
Config without_resumable_differences(Config c) {
  Config defaults;
  c.checkpoint = defaults.checkpoint;
  c.logging = defaults.logging;
  c.parallel = defaults.parallel;
  c.train.steps = defaults.train.steps;
  c.train.device = defaults.train.device;
  return c;
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
  root_ = config.checkpoint.dir ? *config.checkpoint.dir
                                : (fs::path(config.logging.run_dir) / "checkpoints").string();
  if (config.checkpoint.save_on_signal) install_preemption_handlers();
}

std::string CheckpointSession::export_dir() const {
  const std::string& setting = config_.checkpoint.export_adapter;
  if (setting == "false" || setting == "False" || setting == "none") return "";
  if (setting == "true" || setting == "True") return (fs::path(config_.logging.run_dir) / "adapter").string();
  return setting;
}

void CheckpointSession::check_resumed_config(const std::string& saved_yaml, const std::string& source) const {
  Config saved = parse_config(saved_yaml, source);
  if (same_settings(without_resumable_differences(saved), without_resumable_differences(config_))) return;
  if (group_.is_root()) {
    log::warn(fmt::format("the config differs from the one {} was saved with (beyond checkpoint, logging, parallel, "
                          "train.steps and train.device): the resumed run will not reproduce an uninterrupted one",
                          source));
  }
}

bool CheckpointSession::resume() {
  const std::string& mode = config_.checkpoint.resume;
  // Rank 0 cleans up and chooses; every rank then opens the same checkpoint.
  std::string chosen;
  std::string error;
  if (group_.is_root()) {
    try {
      remove_incomplete_checkpoints(root_);
      if (mode == "auto") {
        std::optional<CheckpointRef> newest = newest_committed_checkpoint(root_);
        if (newest) chosen = newest->path;
        else log::info("no checkpoint under " + root_ + ": starting from step 0");
      } else if (mode != "none") {
        chosen = resolve_checkpoint_path(mode);
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (group_.any(!error.empty())) {
    throw Error(ExitCode::kBadCheckpoint, error.empty() ? "rank 0 could not choose a checkpoint to resume" : error);
  }
  chosen = group_.broadcast_from_root(chosen);
  if (chosen.empty()) return false;

  CheckpointReader reader(chosen);
  const Manifest& manifest = reader.manifest();
  check_resumed_config(manifest.config_yaml, reader.path() + "/manifest.json");
  restore_training_state(trainer_.optimizer(), backend_, layout_, reader);
  trainer_.set_progress(manifest.step, manifest.tokens);
  data_.seek(resumed_data_cursor(manifest, group_.rank(), group_.world()));
  if (data_.set_rng_state && manifest.world == group_.world()) {
    data_.set_rng_state(manifest.ranks[static_cast<size_t>(group_.rank())].rng_state);
  }
  last_saved_step_ = manifest.step;
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
  std::string path = save_checkpoint(group_, request, shard);
  last_saved_step_ = request.step;
  return path;
}

void CheckpointSession::after_step() {
  const int64_t step = trainer_.next_step();
  const int64_t every = config_.checkpoint.every;
  if (every > 0 && step % every == 0 && step != last_saved_step_) save_now();
  if (!config_.checkpoint.save_on_signal || !group_.any(preemption_requested())) return;
  std::string path = step == last_saved_step_ ? (fs::path(root_) / checkpoint_dir_name(step)).string() : save_now();
  throw Error(ExitCode::kPreempted,
              fmt::format("stopped by {} after step {}: checkpoint {} is committed; requeue the job (the same command "
                          "with --resume auto continues from it)",
                          preemption_requested() ? preemption_signal_name() : "a signal on another rank", step, path));
}

void CheckpointSession::finish() {
  const int64_t step = trainer_.next_step();
  const bool checkpointing = config_.checkpoint.every > 0;
  std::string out = export_dir();
  if ((checkpointing || (!out.empty() && group_.world() > 1)) && step != last_saved_step_) save_now();
  if (out.empty()) return;
  if (group_.world() == 1) {
    std::vector<Tensor> host;
    std::vector<std::pair<std::string, TensorView>> params;
    host.reserve(trainer_.optimizer().parameters().size());
    for (Parameter* p : trainer_.optimizer().parameters()) {
      if (p->name.find(".lora_") == std::string::npos) continue;
      Tensor staged(p->value.shape(), p->value.dtype());
      backend_.copy(staged, p->value);
      host.emplace_back(p->value.shape(), DType::kF32);  // PEFT adapters are F32
      convert_host(host.back(), staged);
      params.emplace_back(p->name, host.back().view());
    }
    write_peft_adapter(out, params, adapter_export_settings(config_));
    return;
  }
  // Sharded parameters: the committed checkpoint has them all, by global name.
  std::string error;
  if (group_.is_root()) {
    try {
      export_checkpoint_adapter((fs::path(root_) / checkpoint_dir_name(step)).string(), out);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (group_.any(!error.empty())) throw Error(ExitCode::kBadCheckpoint, error.empty() ? "adapter export failed on rank 0" : error);
}

}  // namespace moetrain
