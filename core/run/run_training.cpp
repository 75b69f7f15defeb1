#include "core/run/run_training.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <vector>

#include <mpi.h>
#include <unistd.h>

#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_group.h"
#include "core/checkpoint/checkpoint_session.h"
#include "core/checkpoint/run_directory.h"
#include "core/io/hf_index.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/plan/memory_plan.h"
#include "core/plan/model_flops.h"
#include "core/train/metrics.h"
#include "core/data/data_source.h"
#include "core/data/eval_data.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"
#include "parallel/watchdog.h"
#if MOETRAIN_HAVE_CUDA
#include "parallel/nccl_comm.h"
#endif

namespace moetrain {
namespace {

// auto: CUDA when this build has the CUDA backend and a GPU is visible, else the CPU reference.
std::unique_ptr<kernels::Backend> make_backend(const Config& config, const Runtime& runtime) {
  const std::string& device = config.train.device;
#if MOETRAIN_HAVE_CUDA
  bool gpu = runtime.info().device >= 0;
  MOETRAIN_CHECK(gpu || device != "cuda", ExitCode::kBadConfig,
                 "train.device is cuda, but rank " + std::to_string(runtime.rank()) +
                     " sees no GPU: check CUDA_VISIBLE_DEVICES and the driver, or use train.device=cpu");
  if (gpu && device != "cpu") {
    log::info(fmt::format("training on CUDA device {} (bf16 activations, fp32 adapters and optimizer)",
                          runtime.info().device));
    return kernels::make_cuda_backend();
  }
#else
  MOETRAIN_CHECK(device != "cuda", ExitCode::kBadConfig,
                 "train.device is cuda, but this build has no CUDA backend (nvcc was not found at configure "
                 "time): rebuild with -DMOETRAIN_CUDA=ON, or use train.device=cpu");
  (void)runtime;
#endif
  log::info("training on the CPU reference backend (fp32)");
  return kernels::make_cpu_backend();
}

void write_resolved_config(const Config& config) {
  std::filesystem::path dir(config.logging.run_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                 fmt::format("logging.run_dir: cannot create {} ({})", dir.string(), ec.message()));
  std::ofstream out(dir / "config.yaml");
  out << config_to_yaml(config);
  MOETRAIN_CHECK(out.good(), ExitCode::kBadConfig,
                 fmt::format("logging.run_dir: cannot write {}", (dir / "config.yaml").string()));
}

// "1.23 GB", "45.6 MB", "789 kB" (decimal units, as the plan's).
std::string readable_bytes(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.0f} kB", bytes / 1e3);
}

// Rank 0 logs line(rank, values) for every rank's `values` (the same count on every rank;
// collective over the job): what only the other ranks know, which they may not log at info.
void log_per_rank(const Runtime& runtime, const std::vector<double>& mine,
                  const std::function<std::string(int, const double*)>& line) {
  std::vector<double> all(mine.size() * static_cast<size_t>(runtime.world()));
  MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(), static_cast<int>(mine.size()),
             MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (!runtime.is_root()) return;
  for (int r = 0; r < runtime.world(); ++r) log::info(line(r, &all[mine.size() * static_cast<size_t>(r)]));
}

// The peak of tensor memory on each rank's GPU, the number `moetrain plan` predicts (docs/PLAN.md),
// and what is in use on the device (CUDA context, cuBLAS and NCCL included), logged by rank 0
// for every rank. Collective over the job.
// A model too large for this rank's memory is a config error before anything is allocated
// (not an out-of-memory deep inside the build): what it needs by `moetrain plan`'s count, what
// there is, and where to look for a split that fits. The plan counts BF16 weights and
// activations; the CPU backend holds F32, so on the CPU the check is a lower bound.
// Returns the plan for this memory, with its feed-forward token chunk, KDA time segment and expert
// window (parallel.ffn_chunk_tokens / mixer_segment_tokens 0: the whole pass when it fits, 0 then;
// train.expert_window 0: the widest that fits).
MemoryPlan check_model_fits(const Config& config, const ModelSpec& spec, kernels::Backend& backend,
                            const Runtime& runtime) {
  // The sizes' upper limits are config rules (core/config/config_rules.cpp), which
  // resolve_model_spec checked, so the plan's integer counts below cannot overflow.
  const bool on_cpu = backend.device() == Device::kCPU;
  double available = 0;
  if (on_cpu) {
    available = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  } else {
    available = static_cast<double>(backend.stats().device_total_bytes);
  }
  if (!(available > 0)) {
    MemoryPlan configured;
    configured.ffn_chunk_tokens = config.parallel.ffn_chunk_tokens;
    configured.mixer_segment_tokens = config.parallel.mixer_segment_tokens;
    configured.expert_window = std::max<int64_t>(1, config.train.expert_window);
    return configured;
  }
  PlanOptions plan_options;
  plan_options.world = runtime.world();
  plan_options.gpu_bytes = available;
  const MemoryPlan plan = make_memory_plan(config, plan_options);
  const double needed = plan.peak_bytes(plan.recompute);
  MOETRAIN_CHECK(needed <= plan.usable_bytes, ExitCode::kBadConfig,
                 fmt::format("the model does not fit: rank {} needs about {:.1f} GB ({:.1f} GB of weights, adapters "
                             "and optimizer state, {:.1f} GB of activations for {} tokens) and its {} has {:.1f} GB "
                             "({:.1f} GB usable). `moetrain plan --config {} --world N` shows the per-rank split and "
                             "the tokens that fit: use more ranks (parallel.fsdp / parallel.ep), parallel.recompute, "
                             "a smaller train.expert_window, or a shorter data.seq_len / data.micro_batch",
                             runtime.rank(), needed / 1e9, plan.fixed_bytes() / 1e9, (needed - plan.fixed_bytes()) / 1e9,
                             plan.tokens_per_pass(), on_cpu ? "host" : "GPU", available / 1e9,
                             plan.usable_bytes / 1e9, config.source_path.empty() ? "FILE" : config.source_path));
  if (plan.ffn_chunk_auto && runtime.is_root()) {
    log::info(fmt::format("the feed-forwards run in token chunks of {} (parallel.ffn_chunk_tokens: the whole "
                          "{} of {} tokens would not fit)",
                          plan.ffn_chunk_tokens, plan.expert_window > 1 ? "expert window" : "micro-batch",
                          plan.tokens_per_pass()));
  }
  if (plan.mixer_segment_auto && runtime.is_root()) {
    log::info(fmt::format("the KDA layers run in time segments of {} (parallel.mixer_segment_tokens: the whole "
                          "micro-batch of {} tokens would not fit)",
                          plan.mixer_segment_tokens, plan.tokens_per_micro_batch));
  }
  if (plan.expert_window_auto && runtime.is_root()) {
    log::info(fmt::format("expert windows of {} micro-batch(es) (train.expert_window 0: the widest of the step's {} "
                          "whose pass fits with whole feed-forwards)",
                          plan.expert_window, plan.micro_batches));
  }
  return plan;
}

// RunDirectory on rank 0 (core/checkpoint/run_directory.h); its verdict reaches every rank, so
// each exits with the same code and message.
std::unique_ptr<RunDirectory> claim_run_directory(const Config& config, CheckpointGroup& group) {
  std::unique_ptr<RunDirectory> claimed;
  std::string failure;  // "<exit code> <message>"
  if (group.is_root()) {
    try {
      claimed = std::make_unique<RunDirectory>(config);
    } catch (const Error& e) {
      failure = std::to_string(static_cast<int>(e.code())) + " " + e.what();
    }
  }
  failure = group.broadcast_from_root(failure);
  if (!failure.empty()) {
    const size_t space = failure.find(' ');
    throw Error(static_cast<ExitCode>(std::stoi(failure.substr(0, space))), failure.substr(space + 1));
  }
  return claimed;
}

// A run none of whose steps updated the adapters has trained nothing: that is an error, not
// "done" (the data had no targets, or every step was non-finite).
void check_trained_something(const Trainer& trainer, size_t steps_run) {
  if (steps_run == 0) return;
  const std::vector<StepRecord>& history = trainer.history();
  int64_t updated = 0, without_targets = 0;
  for (size_t i = history.size() - steps_run; i < history.size(); ++i) {
    updated += history[i].skipped ? 0 : 1;
    without_targets += history[i].targets == 0 ? 1 : 0;
  }
  if (updated > 0) return;
  if (without_targets == static_cast<int64_t>(steps_run)) {
    throw Error(ExitCode::kBadData,
                fmt::format("trained nothing: none of the {} steps had a target token (the loss mask selects no "
                            "token of the windows drawn); check the dataset's loss mask (moetrain data-stats)",
                            steps_run));
  }
  throw Error(ExitCode::kInternal,
              fmt::format("trained nothing: every one of the {} steps was skipped (non-finite loss or gradient "
                          "norm, or no target tokens); check the base weights and the data, or lower train.lr",
                          steps_run));
}

void log_device_memory(kernels::Backend& backend, const Runtime& runtime) {
  if (backend.device() == Device::kCPU) return;
  const kernels::BackendStats stats = backend.stats();
  const std::vector<double> mine = {static_cast<double>(stats.peak_bytes), static_cast<double>(stats.device_used_bytes),
                                    static_cast<double>(stats.device_allocations)};
  log_per_rank(runtime, mine, [](int rank, const double* v) {
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    return fmt::format("rank {}: peak tensor memory {:.2f} GB ({:.2f} GiB, {:.0f} allocations); device in use at "
                       "the end {:.2f} GB",
                       rank, v[0] / 1e9, v[0] / kGiB, v[2], v[1] / 1e9);
  });
}

// The run's last lines: what this process did (a resumed run counts only its own steps and
// time), and where its outputs are.
std::string run_summary(const Trainer& trainer, const CheckpointSession& checkpoints) {
  const double seconds = trainer.seconds_this_run();
  std::string text = fmt::format("summary: {} tokens in {} steps, {} wall, {:.1f} tok/s", trainer.tokens_this_run(),
                                 trainer.steps_this_run(), format_duration(seconds),
                                 seconds > 0 ? static_cast<double>(trainer.tokens_this_run()) / seconds : 0.0);
  if (trainer.steps_this_run() < trainer.next_step()) {
    text += fmt::format(" (this run: resumed at step {})", trainer.next_step() - trainer.steps_this_run());
  }
  if (const auto& eval = trainer.last_eval()) {
    text += fmt::format("; eval loss {:.4f} (ppl {:.4g})", eval->loss, std::exp(eval->loss));
  }
  const std::optional<CheckpointRef> last = newest_committed_checkpoint(checkpoints.root());
  text += last ? fmt::format("; last checkpoint {} (step {})", last->path, last->step) : "; no checkpoint";
  const std::string adapter = checkpoints.export_dir();
  text += adapter.empty() ? "; no adapter exported" : "; adapter " + adapter;
  return text;
}

// Several ranks: the device mesh and its communicators (MPI on the CPU backend, NCCL on CUDA);
// one rank: none of them (groups stays empty).
struct RankMesh {
  std::unique_ptr<DeviceMesh> mesh;
  std::vector<std::unique_ptr<Communicator>> communicators;  // what groups point into
  ParallelGroups groups;

  RankMesh(const Runtime& runtime, const Config& config, const ModelSpec& spec, const kernels::Backend& backend) {
    if (runtime.world() == 1) return;
    mesh = std::make_unique<DeviceMesh>(
        MeshLayout(runtime.world(), MeshShape{config.parallel.fsdp, config.parallel.ep, config.parallel.cp},
                   spec.config.moe.num_experts, config.source_path));
    auto communicator = [&](MPI_Comm comm) -> Communicator* {
#if MOETRAIN_HAVE_CUDA
      if (backend.device() == Device::kCUDA) {
        communicators.push_back(std::make_unique<NcclCommunicator>(comm));
        return communicators.back().get();
      }
#endif
      communicators.push_back(std::make_unique<MpiCommunicator>(comm));
      return communicators.back().get();
    };
    groups.coordinates = mesh->coordinates();
    groups.data = communicator(mesh->world_comm());
    groups.ep = communicator(mesh->ep_comm());
    groups.expert_replica = communicator(mesh->expert_replica_comm());
    groups.fsdp = communicator(mesh->fsdp_comm());
    groups.cp = communicator(mesh->cp_comm());
    log::info(fmt::format("{} ranks: data parallel over {}, expert parallel ep={} ({} experts per rank), fsdp={}{}{}",
                          runtime.world(), config.parallel.cp > 1 ? fmt::format("{} groups", mesh->layout().data_groups())
                                                                  : std::string("all"),
                          config.parallel.ep, groups.local_experts(), config.parallel.fsdp,
                          config.parallel.fsdp > 1 ? " (frozen non-expert weights sharded per layer, all-gathered "
                                                     "before use and freed after; each rank loads only its shards)"
                                                   : "",
                          config.parallel.cp > 1
                              ? fmt::format(", context parallel cp={} (each micro-batch's {} tokens cut into {} "
                                            "shards of {}, {})",
                                            config.parallel.cp, config.data.seq_len * config.data.micro_batch,
                                            config.parallel.cp,
                                            config.data.seq_len * config.data.micro_batch / config.parallel.cp,
                                            config.parallel.cp_layout == "balanced"
                                                ? "balanced: chunks r and 2 cp - 1 - r of every window"
                                                : "contiguous")
                              : ""));
  }
};

ModelOptions run_model_options(const Config& config, const kernels::Backend& backend, const Runtime& runtime,
                               RankMesh& mesh) {
  ModelOptions options = model_options_for(config);
  options.dtype = backend.device() == Device::kCUDA ? DType::kBF16 : DType::kF32;
  options.aux_loss_weight = 1.0 / static_cast<double>(config.data.grad_accum * runtime.world());
  if (runtime.world() > 1) options.parallel = &mesh.groups;
  return options;
}

// The frozen base (model.hf_dir, or random from train.seed), then the adapters a fresh run
// starts from (checkpoint.init_adapter); a resumed checkpoint overrides the adapters later.
void load_weights(Model& model, const ModelSpec& spec, const Config& config, const Runtime& runtime) {
  if (spec.config.hf_dir) {
    HfCheckpoint checkpoint(*spec.config.hf_dir);
    model.load_weights(checkpoint);
    log_per_rank(runtime, {static_cast<double>(checkpoint.bytes_read())}, [&](int rank, const double* bytes) {
      return fmt::format("rank {}: read {} of base weights from {}{}", rank, readable_bytes(bytes[0]), *spec.config.hf_dir,
                         runtime.world() > 1 ? " (the rows of its FSDP shards, and its experts)" : "");
    });
  } else {
    model.init_random_weights();
    log::info("no model.hf_dir: base weights are random (seed train.seed)");
  }
  if (config.checkpoint.init_adapter) {
    load_peft_adapter(model, *config.checkpoint.init_adapter);
    log::info(fmt::format("LoRA weights initialised from the PEFT adapter {}", *config.checkpoint.init_adapter));
  }
  int64_t trainable = 0;
  for (Parameter* p : model.parameters()) trainable += p->value.numel();
  log::info(fmt::format("model: {} layers, hidden {}, {} experts top-{}; {} LoRA tensors, {} trainable parameters",
                        spec.config.num_layers, spec.config.hidden_size, spec.config.moe.num_experts,
                        spec.config.moe.top_k, model.parameters().size(), trainable));
}

// Where a rank reads its data: the ranks of one context-parallel group (parallel.cp) read the
// same micro-batches, each keeping its shard of their tokens; without cp, group = rank.
struct DataRank {
  int group = 0;   // which of the data groups this rank belongs to
  int groups = 1;  // world / cp
  int cp = 1;
  int shard = 0;   // this rank's shard within its group
  ContextLayout layout = ContextLayout::kBalanced;

  Batch shard_of(Batch batch) const { return cp > 1 ? context_shard(batch, cp, shard, layout) : batch; }
};

DataRank data_rank(const Config& config, const Runtime& runtime) {
  const int cp = static_cast<int>(config.parallel.cp);
  return DataRank{runtime.rank() / cp, runtime.world() / cp, cp, runtime.rank() % cp,
                  context_layout_of(config.parallel.cp_layout)};
}

// Context parallelism exchanges what crosses the cut in the mixers; what else reads a whole
// sequence is refused here, before any weight is loaded.
void check_context_parallel(const Config& config, const ModelSpec& spec) {
  if (config.parallel.cp <= 1) return;
  const ModelConfig& m = spec.config;
  auto refuse = [&](const std::string& what) {
    throw Error(ExitCode::kBadConfig, fmt::format("{}: parallel.cp = {}: {}", config.source_path, config.parallel.cp,
                                                  what));
  };
  if (m.moe.aux_loss_coef > 0) {
    refuse(fmt::format("model.moe.aux_loss_coef = {} needs each sequence's expert loads on one rank: set "
                       "model.moe.aux_loss_coef: 0 (the selection bias still balances the experts) or "
                       "parallel.cp: 1",
                       m.moe.aux_loss_coef));
  }
}

// What the trainer needs beyond the config: the data's loss floor, the FLOP count for MFU on a
// GPU, and the eval set (data.eval: each rank a slice of it, core/data/eval_data.h).
TrainerOptions make_trainer_options(const Config& config, const ModelSpec& spec, kernels::Backend& backend,
                                    const DataSource& data, EvalData* eval, const Runtime& runtime) {
  TrainerOptions options;
  options.train = config.train;
  options.data = config.data;
  options.logging = config.logging;
  options.loss_floor = data.loss_floor();
  if (backend.device() != Device::kCPU) {
    options.peak_flops = backend.stats().peak_bf16_flops;
    // A context-parallel shard's queries attend keys the other ranks hold: counted from their
    // documents' starts.
    options.batch_flops = [flops = ModelFlops(spec, config.lora)](const Batch& batch) {
      return batch.context ? flops.shard(*batch.context, batch.context_rank).total()
                           : flops.step(batch.num_tokens(), batch.cu_seqlens).total();
    };
  }
  if (eval) {
    log::info(fmt::format("eval: {}; every {}", eval->describe(),
                          config.train.eval_every > 0 ? fmt::format("{} steps and after the last", config.train.eval_every)
                                                      : std::string("run after the last step")));
    const DataRank place = data_rank(config, runtime);
    options.eval_micro_batches = eval->micro_batches(config.data.micro_batch, place.groups);
    options.eval_batch = [eval, &config, place](int64_t i) {
      return place.shard_of(eval->micro_batch(i, config.data.micro_batch, place.group, place.groups));
    };
  }
  return options;
}

// Which part of each tensor this rank's checkpoint holds: world 1, every tensor whole.
ParameterLayout checkpoint_layout(Model& model, const ModelSpec& spec, const RankMesh& mesh, const Runtime& runtime) {
  ParameterLayout layout;
  if (runtime.world() > 1) {
    layout = expert_parallel_layout(model.parameters(), spec.config.moe.num_experts, mesh.groups.first_expert(),
                                    runtime.rank(), mesh.groups.coordinates.expert_replica.index == 0);
  }
  return layout;
}

// A path as a POSIX shell reads it: as it is when it has no special characters, else
// single-quoted, so that the line can be pasted as it is.
std::string shell_quoted(const std::string& path) {
  if (path.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./-+=:,@") ==
      std::string::npos) {
    return path;
  }
  std::string quoted = "'";
  for (char c : path) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The end of a run that took steps: the loss curve, the summary (rank 0) and how to plot it.
// host_waits: the times the host waited for the device during the steps.
void log_run_end(const Config& config, const Runtime& runtime, const Trainer& trainer,
                 const CheckpointSession& checkpoints, const DataSource& data, const kernels::Backend& backend,
                 const std::vector<double>& losses, int64_t waits) {
  const double floor = data.loss_floor();
  const std::string host_waits =
      backend.device() == Device::kCPU
          ? ""
          : fmt::format("; {} host waits for the device ({:.2f} per step)", waits,
                        static_cast<double>(waits) / static_cast<double>(losses.size()));
  log::info(fmt::format("done: loss {:.4f} -> {:.4f} over {} steps{}{}; metrics in {}", losses.front(),
                        losses.back(), losses.size(),
                        std::isnan(floor) ? "" : fmt::format(" (data entropy floor {:.4f})", floor), host_waits,
                        config.logging.run_dir + "/metrics.jsonl"));
  if (runtime.is_root()) log::info(run_summary(trainer, checkpoints));
  log::info(fmt::format("plots (PNGs next to metrics.jsonl; run from the moetrain checkout): "
                        "python3 scripts/plot_metrics.py {}",
                        shell_quoted(config.logging.run_dir)));
}

}  // namespace

int run_training(Runtime& runtime, const Config& config) {
  ScopedWatchdog watchdog(config.parallel.timeout_s);  // a hung rank aborts the job (parallel/watchdog.h)
  std::unique_ptr<CheckpointGroup> group =
      runtime.world() == 1 ? make_single_process_group() : make_mpi_checkpoint_group();
  // Before anything costly: the output paths, the locks, no mixing with an older run.
  std::unique_ptr<RunDirectory> run_directory = claim_run_directory(config, *group);

  // The model on this rank: backend, mesh, the memory check, the weights.
  ModelSpec spec = resolve_model_spec(config);
  std::unique_ptr<kernels::Backend> backend = make_backend(config, runtime);
  check_context_parallel(config, spec);
  RankMesh mesh(runtime, config, spec, *backend);
  ModelOptions options = run_model_options(config, *backend, runtime, mesh);
  // Rank 0's chunk, segment and window for every rank: each pass's expert exchanges pair up only if
  // all run as many passes and chunks.
  const MemoryPlan plan = check_model_fits(config, spec, *backend, runtime);
  options.ffn_chunk_tokens = std::stoll(group->broadcast_from_root(std::to_string(plan.ffn_chunk_tokens)));
  options.mixer_segment_tokens = std::stoll(group->broadcast_from_root(std::to_string(plan.mixer_segment_tokens)));
  const int64_t expert_window = std::stoll(group->broadcast_from_root(std::to_string(plan.expert_window)));
  Model model(spec, *backend, options);
  load_weights(model, spec, config, runtime);

  // data.source: synthetic, a dataset prefix or a mixture (core/data/data_source.h, docs/DATA.md).
  const DataRank place = data_rank(config, runtime);
  std::unique_ptr<DataSource> data = make_data_source(config.data, spec.config.vocab_size, place.group, place.groups);
  log::info("data: " + data->describe());
  // One writer of the run directory's logs: rank 0 (every rank computes the same global metrics).
  std::unique_ptr<MetricsWriter> metrics;
  if (runtime.is_root()) {
    write_resolved_config(config);
    metrics = std::make_unique<MetricsWriter>(config.logging.run_dir);
  }
  std::unique_ptr<EvalData> eval = make_eval_data(config.data, spec.config.vocab_size);
  TrainerOptions trainer_options = make_trainer_options(config, spec, *backend, *data, eval.get(), runtime);
  trainer_options.train.expert_window = expert_window;
  Trainer trainer(trainer_options, model, [&data, place] { return place.shard_of(data->next()); }, metrics.get());

  // Resume, then train: checkpoints and signals are handled after every step.
  DataCursorAccess cursor{[&data] { return data->cursor(); }, [&data](uint64_t c) { data->seek(c); },
                          [&model] { return model.forward_count(); },
                          [&model](uint64_t count) { model.set_forward_count(count); }};
  CheckpointSession checkpoints(config, *group, trainer, *backend, cursor,
                                checkpoint_layout(model, spec, mesh, runtime));
  checkpoints.resume();
  trainer.set_after_step([&checkpoints](const StepRecord&) { checkpoints.after_step(); });
  const int64_t waits_before = backend->stats().host_waits;
  std::vector<double> losses = trainer.run();
  check_trained_something(trainer, losses.size());
  // Times the host waited for the device during the steps (checkpoints included): one per step
  // is the gradient norm's read (core/train/trainer.h); the CPU backend never waits.
  const int64_t waits = backend->stats().host_waits - waits_before;

  // The final checkpoint and the adapter export, then the summary.
  checkpoints.finish();
  log_device_memory(*backend, runtime);
  if (!losses.empty()) log_run_end(config, runtime, trainer, checkpoints, *data, *backend, losses, waits);
  return 0;
}

}  // namespace moetrain
