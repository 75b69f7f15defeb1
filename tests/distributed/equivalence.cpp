// Distributed training equals single-rank training (docs/ARCHITECTURE.md §5): run under mpirun with a
// (fsdp, ep) layout, every rank trains the tiny MLA + MoE model on its share of the data for 3
// optimizer steps, and checks against a single-process run of the same model on all ranks'
// data together (computed locally on each rank, no communication):
//   - the first step's adapter gradients (after the cross-rank reduction), every tensor, and
//   - the loss of every step,
// to 1e-5 relative (reduction order differs). Routing cases:
//   natural     the router as initialised
//   one_expert  a large selection bias on expert 0: every token picks it first, so under expert
//               parallelism the other blocks get far fewer rows and some get none at all.
// With fsdp > 1 the frozen non-expert weights are sharded (core/model/fsdp_bucket.h): the run
// also checks that between steps each rank holds ~1/fsdp of their bytes.
//
//   mpirun -np W distributed_equivalence FSDP EP natural|one_expert [EXPERTS TOP_K]
//       [--recompute] [--recompute-layers N] [--keep-gathered] [--prefetch N] [--shared-a] [--k3] [--mxfp4]
//       [--cp N] [--cp-balanced] [--cp-key-chunk N] [--ffn-chunks N] [--mixer-segments N] [--fp8]
// --shared-a: the routed experts' A shared by all experts of a layer (lora.expert_a: shared, a
// replicated parameter beside the per-expert B's) and per-module ranks (lora.rank_pattern).
// --k3: Kimi K3's SiTU, latent MoE, attention gate and attention residuals (test_config);
// --mxfp4: the same with the routed experts packed in MXFP4.
// --fp8: model.weight_format fp8 (MLP and expert widths 128, so every projection and expert is
// FP8): the FSDP buckets then hold U8 codes and F32 block scales beside the norms.
// --cp N: context parallelism, every micro-batch (two windows of 16) cut into N shards of
// contiguous tokens, each cp group of ranks reading one; checked to 1e-10 (one reference, only
// the order of the sums differs). --cp-balanced: the balanced layout instead (parallel.cp_layout:
// each window of 16 cut into 2N chunks, rank r holding chunks r and 2N - 1 - r; at cp 8 chunks of
// one token, shorter than the short convolution's reach). --cp-key-chunk N: the MLA layers attend the visible keys in chunks
// of N rows (parallel.cp_key_chunk; by default a shard's length), merged by their log-sum-exp.
// --ffn-chunks N: the distributed model runs its feed-forward halves in token chunks of at most N
// tokens (parallel.ffn_chunk_tokens; the reference runs them whole), so each chunk's expert
// exchange must pair up across the EP ranks.
// (EXPERTS and TOP_K default to 8 and 2; docs/SCALE.md runs 896 experts top-16 on 64 ranks.)
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "core/base/log.h"
#include "core/model/model.h"
#include "core/train/optimizer.h"
#include "core/data/context_shards.h"
#include "core/data/synthetic_data.h"
#include "kernels/ops.h"
#include "mpi_parallel_groups.h"
#include "parallel/mesh.h"
#include "parallel/runtime.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;
constexpr double kContextParallelTolerance = 1e-10;

// k3: Kimi K3's parts on the same model: SiTU, latent MoE (experts at width 6 of 16, latent norm),
// the per-channel attention gate and Block Attention Residuals in blocks of 2 (layer 2's attention
// input mixes the summaries of layers 0 and 2... across FSDP-sharded mix weights).
// mxfp4 (with k3): the routed experts held packed in MXFP4, at a latent width and expert width of
// 32 (whole scale groups), so expert parallelism slices packed codes and scales.
// cp > 1: no aux loss (its per-sequence loads are refused under context parallelism), windows of
// 16 so that documents span shards and shards hold document starts. no_aux: no aux loss either
// (feed-forward token chunks refuse it).
Config test_config(int64_t micro_batch, int64_t experts, int64_t top_k, bool k3, bool mxfp4, int cp, bool no_aux) {
  Config config = testing::tiny_model_config(/*q_lora=*/true);
  if (k3) {
    ModelConfig& m = config.model;
    testing::set_k3_ffn(m, /*latent_norm=*/true);
    m.attention_gate = "elementwise";
    m.attn_res_block_size = 2;
    if (mxfp4) {
      m.moe.expert_format = "mxfp4";
      m.moe.latent_size = 32;
      m.moe.expert_intermediate_size = 32;
    }
  }
  config.model.moe.num_experts = experts;  // 8 by default: divisible by every ep of the test matrix
  config.model.moe.top_k = top_k;
  config.model.moe.num_groups = 2;
  config.model.moe.aux_loss_coef = no_aux ? 0.0 : 0.01;
  config.data.seq_len = 8;
  config.data.micro_batch = micro_batch;
  if (cp > 1) {
    config.model.moe.aux_loss_coef = 0.0;
    config.data.seq_len = 16;
  }
  return config;
}

// Schedule flags (after the positional arguments): --recompute, --recompute-layers N (only the
// first N layers re-run), --keep-gathered (no FSDP re-gather for backward), --prefetch N. None
// of them may change a single bit of the results.
struct ScheduleFlags {
  bool recompute = false;
  int64_t recompute_layers = -1;
  bool keep_gathered = false;
  int64_t prefetch = 1;
  bool shared_a = false;
  bool k3 = false;
  bool mxfp4 = false;  // with k3
  int cp = 1;          // context parallelism: each micro-batch cut into cp shards
  ContextLayout cp_layout = ContextLayout::kContiguous;
  int64_t ffn_chunk_tokens = 0;  // the distributed model's ModelOptions::ffn_chunk_tokens
  int64_t cp_key_chunk = 0;      // the distributed model's ModelOptions::cp_key_chunk
  int64_t mixer_segment_tokens = 0;  // its ModelOptions::mixer_segment_tokens (KDA time segments)
  bool fp8 = false;
};

ScheduleFlags take_schedule_flags(int& argc, char** argv) {
  ScheduleFlags flags;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--recompute") {
      flags.recompute = true;
    } else if (arg == "--recompute-layers" && i + 1 < argc) {
      flags.recompute = true;
      flags.recompute_layers = std::stoll(argv[++i]);
    } else if (arg == "--keep-gathered") {
      flags.keep_gathered = true;
    } else if (arg == "--shared-a") {
      flags.shared_a = true;
    } else if (arg == "--k3") {
      flags.k3 = true;
    } else if (arg == "--mxfp4") {
      flags.k3 = flags.mxfp4 = true;
    } else if (arg == "--cp" && i + 1 < argc) {
      flags.cp = std::stoi(argv[++i]);
    } else if (arg == "--cp-balanced") {
      flags.cp_layout = ContextLayout::kBalanced;
    } else if (arg == "--cp-key-chunk" && i + 1 < argc) {
      flags.cp_key_chunk = std::stoll(argv[++i]);
    } else if (arg == "--ffn-chunks" && i + 1 < argc) {
      flags.ffn_chunk_tokens = std::stoll(argv[++i]);
    } else if (arg == "--mixer-segments" && i + 1 < argc) {
      flags.mixer_segment_tokens = std::stoll(argv[++i]);
    } else if (arg == "--fp8") {
      flags.fp8 = true;
    } else if (arg == "--prefetch" && i + 1 < argc) {
      flags.prefetch = std::stoll(argv[++i]);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return flags;
}

ModelOptions model_options(const ParallelGroups* parallel, int world, const ScheduleFlags& flags) {
  ModelOptions options;
  options.recompute = flags.recompute;
  options.recompute_layers = flags.recompute_layers;
  options.fsdp_reshard_after_forward = !flags.keep_gathered;
  options.fsdp_prefetch = flags.prefetch;
  options.aux_loss_weight = 1.0 / world;  // the aux loss is a mean over every rank's sequences
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = testing::all_lora_targets(true);
  if (flags.k3) {
    options.lora_targets.push_back("routed_expert_down_proj");
    options.lora_targets.push_back("routed_expert_up_proj");
  }
  options.shared_expert_a = flags.shared_a;
  if (flags.shared_a) options.lora_rank_pattern = {{"o_proj", 6}, {"experts\\.down_proj", 3}};
  options.parallel = parallel;
  return options;
}

// Non-zero adapters everywhere (B = 0 would hide most gradient paths), identical on every rank
// for the same global expert.
void prepare(Model& model, const std::string& routing) {
  model.init_random_weights();
  kernels::Backend& be = model.backend();
  for (Parameter* p : model.parameters()) {
    Tensor host(p->value.shape(), DType::kF64);
    const int64_t per_group = p->value.shape().ndim() == 3 ? host.numel() / p->value.size(0) : host.numel();
    const int64_t first = p->value.shape().ndim() == 3 && model.options().parallel
                              ? model.options().parallel->first_expert() * per_group
                              : 0;
    for (int64_t i = 0; i < host.numel(); ++i) {
      uint64_t x = std::hash<std::string>{}(p->name) ^ static_cast<uint64_t>(first + i) * 0x9e3779b97f4a7c15ull;
      x ^= x >> 31;
      x *= 0xbf58476d1ce4e5b9ull;
      x ^= x >> 29;
      host.ptr<double>()[i] = 0.05 + 0.25 * static_cast<double>(x % 1000) / 1000.0 * (x & 1 ? 1 : -1);
    }
    be.copy(p->value, host);
  }
  if (routing == "one_expert") {
    for (const WeightSlot& slot : model.weight_slots()) {
      if (slot.name.find("e_score_correction_bias") == std::string::npos) continue;
      Tensor bias(slot.tensor->shape(), DType::kF64);
      for (int64_t e = 0; e < bias.numel(); ++e) bias.ptr<double>()[e] = e == 0 ? 10.0 : 0.0;
      be.copy(*slot.tensor, bias);
    }
  }
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, Tensor> first_grads;  // host F64, after the step's reduction, by name
  int64_t moment_numel = 0;                   // Adam moment elements this rank holds (each of two)
};

// The trainer's step, written out so the gradients can be read before the update.
Run train(Model& model, SyntheticData& data, int cp = 1, int shard = 0,
          ContextLayout layout = ContextLayout::kContiguous) {
  Run run;
  AdamWOptions adamw;
  adamw.weight_decay = 0.1;  // decoupled decay too, applied shard by shard
  AdamW optimizer(model.parameter_groups(), adamw, model.backend());
  for (int step = 0; step < kSteps; ++step) {
    Batch batch = cp > 1 ? context_shard(data.next(), cp, shard, layout) : data.next();
    double targets = model.sum_over_data_ranks(static_cast<double>(batch.num_targets()));
    StepResult result = model.forward_backward(batch, 1.0 / targets);
    optimizer.reduce_gradients();
    run.losses.push_back(model.sum_over_data_ranks(result.loss_sum) / targets);
    if (step == 0) {
      optimizer.gather_gradients();  // the reduce-scattered shards, whole again
      for (Parameter* p : model.parameters()) {
        Tensor g(p->grad.shape(), DType::kF64);
        model.backend().copy(g, p->grad);
        run.first_grads.emplace(p->name, std::move(g));
      }
    }
    optimizer.clip_gradients(1.0);
    optimizer.step(1e-2);
  }
  run.moment_numel = optimizer.moment_numel();
  return run;
}

// The most Adam moment elements a rank may hold when each group's moments are split over its
// ranks: its share of the group, plus the alignment padding of every parameter and the shard.
int64_t sharded_moment_bound(Model& model) {
  int64_t bound = 0;
  for (ParameterGroup* group : model.parameter_groups()) {
    int64_t numel = 0;
    for (Parameter* p : group->params()) numel += p->value.numel() + ParameterGroup::kAlignment;
    bound += numel / group->ranks() + 2 * ParameterGroup::kAlignment;
  }
  return bound;
}

double relative_error(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-12); }

int run_test(Runtime& runtime, int argc, char** argv) {
  const ScheduleFlags flags = take_schedule_flags(argc, argv);
  MOETRAIN_CHECK(argc == 4 || argc == 6, ExitCode::kBadConfig,
                 "usage: distributed_equivalence FSDP EP natural|one_expert [EXPERTS TOP_K] [--recompute] "
                 "[--recompute-layers N] "
                 "[--keep-gathered] [--prefetch N] [--shared-a] [--k3] [--mxfp4] [--cp N] [--cp-balanced] [--cp-key-chunk N] [--ffn-chunks N] "
                 "[--mixer-segments N] [--fp8]");
  const int64_t experts = argc == 6 ? std::stoll(argv[4]) : 8;
  const int64_t top_k = argc == 6 ? std::stoll(argv[5]) : 2;
  MeshShape parallel;
  parallel.fsdp = std::stoi(argv[1]);
  parallel.ep = std::stoi(argv[2]);
  parallel.cp = flags.cp;
  const std::string routing = argv[3];
  const int world = runtime.world();

  // The distributed run: one window per rank per step.
  const int cp = flags.cp, micro_batch = cp > 1 ? 2 : 1;
  const bool no_aux = flags.ffn_chunk_tokens > 0;
  Config config = test_config(micro_batch, experts, top_k, flags.k3, flags.mxfp4, cp, no_aux);
  if (flags.fp8) {
    config.model.weight_format = "fp8";
    config.model.intermediate_size = 128;
    config.model.moe.expert_intermediate_size = 128;
  }
  ModelSpec spec = resolve_model_spec(config);
  testing::MpiParallelGroups mpi{MeshLayout(world, parallel, spec.config.moe.num_experts)};
  ParallelGroups& groups = mpi.groups;
  auto backend = kernels::make_cpu_backend();
  ModelOptions options = model_options(&groups, world, flags);
  options.ffn_chunk_tokens = flags.ffn_chunk_tokens;
  options.cp_key_chunk = flags.cp_key_chunk;
  options.mixer_segment_tokens = flags.mixer_segment_tokens;
  Model model(spec, *backend, options);
  prepare(model, routing);
  SyntheticData data(config.data, spec.config.vocab_size, runtime.rank() / cp, world / cp);
  Run distributed = train(model, data, cp, runtime.rank() % cp, flags.cp_layout);
  // Between steps no layer is active: the frozen non-expert weights are this rank's shards only.
  const FrozenWeightBytes frozen = model.frozen_non_expert_bytes();

  // The reference: one process, every rank's windows in one batch.
  Config reference_config = test_config(micro_batch * world / cp, experts, top_k, flags.k3, flags.mxfp4, cp, no_aux);
  Model reference(spec, *backend, model_options(nullptr, 1, flags));
  prepare(reference, routing);
  SyntheticData reference_data(reference_config.data, spec.config.vocab_size, 0, 1);
  Run single = train(reference, reference_data);

  const double tolerance = cp > 1 ? kContextParallelTolerance : kTolerance;
  int failures = 0;
  for (int s = 0; s < kSteps; ++s) {
    double err = relative_error(distributed.losses[s], single.losses[s]);
    if (err > tolerance) {
      ++failures;
      log::error(fmt::format("step {} loss {:.12g} vs single-rank {:.12g} (relative error {:.2e})", s + 1,
                             distributed.losses[s], single.losses[s], err));
    }
  }
  for (const auto& [name, ours] : distributed.first_grads) {
    const Tensor& full = single.first_grads.at(name);
    // A routed-expert adapter holds this rank's experts only: compare with that slice.
    int64_t offset = 0;
    if (ours.shape().ndim() == 3) offset = groups.first_expert() * (ours.numel() / ours.size(0));
    double scale = 0.0, worst = 0.0;
    for (int64_t j = 0; j < full.numel(); ++j) scale = std::max(scale, std::fabs(full.ptr<double>()[j]));
    for (int64_t j = 0; j < ours.numel(); ++j)
      worst = std::max(worst, std::fabs(ours.ptr<double>()[j] - full.ptr<double>()[offset + j]));
    if (!(worst <= tolerance * scale) || scale == 0.0) {
      ++failures;
      log::error(fmt::format("gradient of {} differs: max |diff| {:.3e} vs scale {:.3e}", name, worst, scale));
    }
  }
  // The optimizer state is sharded over the data-parallel ranks (the expert adapters' over the
  // ranks holding the same experts), not replicated.
  if (distributed.moment_numel > sharded_moment_bound(model)) {
    ++failures;
    log::error(fmt::format("rank {} holds {} Adam moment elements; sharded, at most {}", runtime.rank(),
                           distributed.moment_numel, sharded_moment_bound(model)));
  }
  if (single.first_grads.size() != distributed.first_grads.size()) {
    ++failures;
    log::error(fmt::format("{} trainable parameters, the single-rank model has {}", distributed.first_grads.size(),
                           single.first_grads.size()));
  }
  // Sharding: the sharded part is split fsdp ways, each bucket (a layer's weights, and one for
  // embed/norm/head) padded up to a multiple of fsdp elements; the router score bias stays whole.
  const double resident_fraction = static_cast<double>(frozen.resident) / static_cast<double>(frozen.full);
  const size_t sharded_share = (frozen.full - frozen.kept_whole) / static_cast<size_t>(parallel.fsdp);
  const size_t buckets = static_cast<size_t>(spec.config.num_layers) + 1;
  const size_t lowest = frozen.kept_whole + sharded_share, highest = lowest + buckets * sizeof(double);
  if (parallel.fsdp > 1 && !(model.fsdp_sharded() && frozen.resident >= lowest && frozen.resident <= highest)) {
    ++failures;
    log::error(fmt::format("rank {} holds {} of {} frozen non-expert bytes, not its 1/{} share of the sharded "
                           "{} plus the {} kept whole (expected {}..{})",
                           runtime.rank(), frozen.resident, frozen.full, parallel.fsdp,
                           frozen.full - frozen.kept_whole, frozen.kept_whole, lowest, highest));
  }
  // Freed after use: at most the active layer, the prefetched ones, and at the turn from forward
  // to backward the last layer with the embed/norm/head bucket were ever gathered together.
  const int64_t peak_allowed = std::max<int64_t>(flags.prefetch + 1, 2);
  if (parallel.fsdp > 1 && !flags.keep_gathered && model.fsdp_peak_gathered_buckets() > peak_allowed) {
    ++failures;
    log::error(fmt::format("{} FSDP buckets were gathered at once (prefetch {} allows {})",
                           model.fsdp_peak_gathered_buckets(), flags.prefetch, peak_allowed));
  }
  if (parallel.fsdp == 1 && (model.fsdp_sharded() || frozen.resident != frozen.full)) {
    ++failures;
    log::error("fsdp 1 must keep the frozen weights whole");
  }
  const int total_failures = static_cast<int>(model.sum_over_data_ranks(failures));
  if (runtime.is_root()) {
    std::printf("distributed_equivalence world %d fsdp %lld ep %lld cp %d %s: %d parameters, %d steps: %s (losses %.10f %.10f %.10f); "
                "frozen non-expert bytes per rank %zu of %zu (%.3f), at most %lld buckets gathered at once; "
                "Adam moments per rank %lld of %lld elements\n",
                world, static_cast<long long>(parallel.fsdp), static_cast<long long>(parallel.ep), cp, routing.c_str(),
                static_cast<int>(distributed.first_grads.size()), kSteps, total_failures == 0 ? "EQUAL" : "DIFFERENT",
                distributed.losses[0], distributed.losses[1], distributed.losses[2], frozen.resident, frozen.full,
                resident_fraction, static_cast<long long>(model.fsdp_peak_gathered_buckets()),
                static_cast<long long>(distributed.moment_numel), static_cast<long long>(single.moment_numel));
  }
  return total_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
