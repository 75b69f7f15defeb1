#include "core/model/model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "core/base/host_convert.h"
#include "core/config/lora_patterns.h"
#include "core/model/dense_ffn.h"
#include "core/model/dsa.h"
#include "core/model/kda.h"
#include "core/model/latent_moe.h"
#include "core/model/moe.h"
#include "core/model/rope_tables.h"

namespace moetrain {

namespace {

// "model.layers.<i> (<mixer>) <pass>": where a step is, for the context of an error.
std::string layer_pass(const ModelSpec& spec, size_t i, const char* pass) {
  return fmt::format("model.layers.{} ({}) {}", i, mixer_kind_name(spec.mixers[i]), pass);
}

}  // namespace

using kernels::GemmArgs;
using kernels::RmsNormArgs;
using kernels::RmsNormBackwardArgs;

namespace {

// The routed MoE of a feed-forward: a plain MoeFfn, or the one inside a latent MoE; null for dense.
MoeFfn* routed_moe(FeedForward* ffn) {
  if (auto* latent = dynamic_cast<LatentMoeFfn*>(ffn)) return &latent->moe;
  return dynamic_cast<MoeFfn*>(ffn);
}

uint64_t name_hash(const std::string& name) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return hash;
}

// Host tensor (any floating dtype) -> a new tensor of `dtype` on the backend's device.
Tensor to_device(kernels::Backend& backend, const TensorView& host, DType dtype) {
  Tensor staged(host.shape, dtype);
  convert_host(staged, host);
  Tensor device(host.shape, dtype, backend.allocator());
  backend.copy(device, staged);
  return device;
}

// A device tensor (any floating dtype) -> a new host F64 tensor.
Tensor to_host_f64(kernels::Backend& backend, const Tensor& device) {
  Tensor staged(device.shape(), device.dtype());
  backend.copy(staged, device);
  Tensor host(device.shape(), DType::kF64);
  convert_host(host, staged);
  return host;
}

// The SwiGLU networks of a feed-forward that carry adapters: a dense MLP's, or a MoE's routed and
// shared experts.
std::vector<SwigluExperts*> swiglu_networks(FeedForward* ffn) {
  if (auto* dense = dynamic_cast<DenseFfn*>(ffn)) return {&dense->mlp};
  std::vector<SwigluExperts*> out;
  if (MoeFfn* moe = routed_moe(ffn)) {
    out.push_back(&moe->experts);
    if (moe->shared) out.push_back(&moe->shared->mlp);
  }
  return out;
}

const BatchTensors& no_batch() {
  static const BatchTensors empty;
  return empty;
}

}  // namespace

Model::Model(const ModelSpec& spec, kernels::Backend& backend, const ModelOptions& options)
    : spec_(spec),
      backend_(backend),
      options_(options),
      attn_res_(spec.config, LayerContext{backend, options.dtype, no_batch()}),
      fsdp_(options.parallel ? options.parallel->fsdp : nullptr, backend,
            FsdpScheduleOptions{options.fsdp_prefetch, options.fsdp_reshard_after_forward}),
      batches_(backend),
      results_(backend),
      checkpoints_(backend, options.offload) {
  const ModelConfig& m = spec_.config;
  LayerContext ctx = context(no_batch());
  const int64_t d = m.hidden_size;
  embed_ = ctx.alloc({m.vocab_size, d});
  final_norm_ = ctx.alloc({d});
  if (!m.tie_word_embeddings) lm_head_ = ctx.alloc({m.vocab_size, d});

  if (m.mla.use_rope) {
    RopeTables tables = make_rope_tables(m.mla, m.max_position_embeddings, m.max_position_embeddings);
    Tensor cos_host({tables.positions, tables.half_dim}, DType::kF64);
    Tensor sin_host({tables.positions, tables.half_dim}, DType::kF64);
    std::copy(tables.cos.begin(), tables.cos.end(), cos_host.ptr<double>());
    std::copy(tables.sin.begin(), tables.sin.end(), sin_host.ptr<double>());
    rope_.cos = to_device(backend_, cos_host, ctx.accum());
    rope_.sin = to_device(backend_, sin_host, ctx.accum());
  }

  // Reserved: FSDP buckets hold pointers to the layers' norm tensors, which must not move.
  layers_.reserve(static_cast<size_t>(m.num_layers));
  for (int64_t i = 0; i < m.num_layers; ++i) {
    DecoderLayer layer;
    layer.input_norm = ctx.alloc({d});
    layer.post_attention_norm = ctx.alloc({d});
    layer.attention_mix = attn_res_.make_mix(ctx);
    layer.mlp_mix = attn_res_.make_mix(ctx);
    const RopeDeviceTables* rope = m.mla.use_rope ? &rope_ : nullptr;
    if (spec_.mixers[i] == MixerKind::kKda)
      layer.mixer = std::make_unique<KdaAttention>(spec_, i, ctx, options_.mixer_segment_tokens);
    else if (spec_.mixers[i] == MixerKind::kDsa) layer.mixer = std::make_unique<DsaAttention>(spec_, i, ctx, rope);
    else layer.mixer = std::make_unique<MlaAttention>(spec_, i, ctx, rope);
    if (spec_.ffns[i] == FfnKind::kDense) {
      auto dense =
          std::make_unique<DenseFfn>("model.layers." + std::to_string(i) + ".mlp", d, m.intermediate_size, ctx, m);
      dense->mlp.activation = gated_activation_of(m);
      layer.ffn = std::move(dense);
    } else if (m.moe.latent_size > 0) {
      auto latent = std::make_unique<LatentMoeFfn>(spec_, i, ctx, options_.parallel);
      latent->moe.set_aux_loss_weight(options_.aux_loss_weight);
      layer.ffn = std::move(latent);
    } else {
      auto moe = std::make_unique<MoeFfn>(spec_, i, ctx, options_.parallel);
      moe->set_aux_loss_weight(options_.aux_loss_weight);
      layer.ffn = std::move(moe);
    }
    layers_.push_back(std::move(layer));
    shard_layer_weights(layers_.size() - 1);  // frees the layer's full weights before the next
  }
  shard_outer_weights();
  saved_.resize(layers_.size());
  if (m.vision.enabled) {
    MOETRAIN_CHECK(backend_.device() == Device::kCPU, ExitCode::kBadConfig,
                   "model.vision: the vision tower's ops (gelu, vision_pos_embed, patch_merge, the adjacent-pair "
                   "RoPE, non-causal attention) have no CUDA kernels yet; run it with train.device: cpu, or set "
                   "model.vision.enabled: false to train the language model on text");
    vision_ = std::make_unique<VisionTower>(m.vision, d, ctx);
    vision_->make_trainable(options_.lora, parameter_dtype(),
                            [&](const std::string& name) { return std::mt19937_64(options_.seed ^ name_hash(name)); },
                            backend_);
  }
  attach_lora();
  group_parameters();
}

ModelOptions model_options_for(const Config& config) {
  ModelOptions options;
  options.recompute = config.parallel.recompute;
  options.recompute_layers = config.parallel.recompute_layers;
  options.ffn_chunk_tokens = config.parallel.ffn_chunk_tokens;
  options.cp_key_chunk = config.parallel.cp_key_chunk;
  options.attention_query_block = config.parallel.attention_query_block;
  options.mixer_segment_tokens = config.parallel.mixer_segment_tokens;
  options.offload = config.parallel.offload;
  options.fsdp_prefetch = config.parallel.prefetch;
  options.fsdp_reshard_after_forward = config.parallel.reshard_after_forward;
  options.seed = static_cast<uint64_t>(config.train.seed);
  options.lora = LoraSettings{config.lora.rank, config.lora.alpha, config.lora.rslora};
  options.lora_targets = config.lora.targets;
  options.fused_expert_gate_up = config.lora.expert_gate_up == "fused";
  options.lora_rank_pattern = config.lora.rank_pattern;
  options.lora_alpha_pattern = config.lora.alpha_pattern;
  options.shared_expert_a = config.lora.expert_a == "shared";
  return options;
}

// Data parallelism: every rank's gradient is its tokens' share of the global mean (the trainer
// scaled by the global target count), so a step's gradient sums over ranks. Non-expert adapters
// sum over every data-parallel rank. Under expert parallelism each rank holds one block of the
// routed-expert adapters: they sum over the ranks holding the same experts, and global sums
// (the grad norm) add the other blocks'. The optimizer shards each group over its ranks.
void Model::group_parameters() {
  const ParallelGroups* p = options_.parallel;
  const bool expert_parallel = p && p->expert_parallel();
  std::vector<Parameter*> replicated, partitioned;
  for (DecoderLayer& layer : layers_) {
    std::vector<Parameter*> params;
    layer.mixer->collect_parameters(params);
    layer.ffn->collect_parameters(params);
    for (Parameter* param : params) {
      // The stacked [experts, ...] adapters of the routed experts (SwigluExperts). A shared expert
      // A (lora.expert_a: shared, 2-D) is replicated: every rank's local experts add to its gradient.
      const bool expert_block = expert_parallel && param->value.shape().ndim() == 3;
      (expert_block ? partitioned : replicated).push_back(param);
    }
  }
  if (vision_) vision_->collect_parameters(replicated);
  Communicator* data = p ? p->data : nullptr;
  if (!replicated.empty()) {
    parameter_groups_.push_back(
        std::make_unique<ParameterGroup>("replicated adapters", replicated, data, nullptr, backend_));
  }
  if (!partitioned.empty()) {
    parameter_groups_.push_back(
        std::make_unique<ParameterGroup>("routed-expert adapters", partitioned, p->expert_replica, p->ep, backend_));
  }
  for (const auto& group : parameter_groups_) {
    parameters_.insert(parameters_.end(), group->params().begin(), group->params().end());
  }
}

std::vector<ParameterGroup*> Model::parameter_groups() {
  std::vector<ParameterGroup*> groups;
  for (const auto& group : parameter_groups_) groups.push_back(group.get());
  return groups;
}

double Model::sum_over_data_ranks(double local) {
  return sum_over(options_.parallel ? options_.parallel->data : nullptr, backend_, local);
}

Model::~Model() = default;

std::vector<std::pair<std::string, LoraLinear*>> Model::linear_modules() {
  std::vector<std::pair<std::string, LoraLinear*>> out;
  for (DecoderLayer& layer : layers_) {
    for (LayerBlock* block : {static_cast<LayerBlock*>(layer.mixer.get()), static_cast<LayerBlock*>(layer.ffn.get())}) {
      for (LoraLinear* p : block->projections()) out.emplace_back(p->name(), p);
    }
  }
  return out;
}

// LoRA targets by module name:
//   q_proj q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj g_proj o_proj   MLA's and DSA's
//   q_proj k_proj v_proj qkv_proj f_a_proj f_b_proj b_proj g_a_proj g_b_proj g_proj o_proj   KDA's
//   routed_expert_down_proj routed_expert_up_proj   the latent MoE's bottleneck projections
//   gate_proj up_proj down_proj   those projections of the dense MLPs and the shared experts
//   shared_experts                all three projections of the shared experts
//   experts                       all three projections of every routed expert
void Model::attach_lora() {
  std::set<std::string> targets(options_.lora_targets.begin(), options_.lora_targets.end());
  std::set<std::string> matched;
  std::set<std::string> available;  // every target this model has, for the error message
  // Per-module generators: a module's initial adapter does not depend on which others exist.
  auto rng_for = [&](const std::string& name) { return std::mt19937_64(options_.seed ^ name_hash(name)); };
  // Per-module rank and alpha (lora.rank_pattern / alpha_pattern, PEFT's rule).
  LoraRanks ranks(options_.lora.rank, options_.lora.alpha, options_.lora_rank_pattern, options_.lora_alpha_pattern);
  // The adapted modules' names with <L> for the layer, for the message on a key that selects none.
  std::vector<std::string> adapted;
  auto settings = [&](const std::string& module, const ModuleLora& m) {
    const size_t layer = std::string("model.layers.").size();
    const std::string named = module.substr(0, layer) + "<L>" + module.substr(module.find('.', layer));
    if (std::find(adapted.begin(), adapted.end(), named) == adapted.end()) adapted.push_back(named);
    return LoraSettings{m.rank, m.alpha, options_.lora.rslora};
  };

  for (auto& [name, linear] : linear_modules()) {
    std::string short_name = name.substr(name.rfind('.') + 1);
    available.insert(short_name);
    if (!targets.count(short_name)) continue;
    matched.insert(short_name);
    auto rng = rng_for(name);
    linear->lora = make_lora_adapter(name, linear->in_features(), linear->out_features(),
                                     settings(name, ranks.module(name)), parameter_dtype(), backend_.allocator(),
                                     backend_, rng);
  }
  auto attach_swiglu = [&](SwigluExperts& mlp, bool all_projections, const char* group_target) {
    mlp.shared_lora_a = mlp.routed() && options_.shared_expert_a;
    for (auto p : {SwigluExperts::kGate, SwigluExperts::kUp, SwigluExperts::kDown}) {
      const char* projection = SwigluExperts::projection_name(p);
      available.insert(all_projections ? group_target : projection);
      if (group_target) available.insert(group_target);
      bool by_projection = !all_projections && targets.count(projection);
      bool by_group = group_target && targets.count(group_target);
      if (!by_projection && !by_group) continue;
      if (by_projection) matched.insert(projection);
      if (by_group) matched.insert(group_target);
      if (mlp.routed() && options_.fused_expert_gate_up && p != SwigluExperts::kDown) {
        if (p == SwigluExperts::kGate) {
          const std::string module = mlp.prefix() + ".gate_up_proj";
          mlp.add_gate_up_lora(settings(module, ranks.fused_gate_up(mlp.prefix())), parameter_dtype(), backend_,
                               options_.seed ^ name_hash(module));
        }
        continue;
      }
      const std::string module = mlp.prefix() + "." + projection;
      mlp.add_lora(p, settings(module, ranks.module(module)), parameter_dtype(), backend_,
                   options_.seed ^ name_hash(module));
    }
  };
  for (DecoderLayer& layer : layers_) {
    if (auto* dense = dynamic_cast<DenseFfn*>(layer.ffn.get())) attach_swiglu(dense->mlp, false, nullptr);
    if (auto* moe = routed_moe(layer.ffn.get())) {
      attach_swiglu(moe->experts, true, "experts");
      if (moe->shared) attach_swiglu(moe->shared->mlp, false, "shared_experts");
    }
  }
  for (const std::string& target : options_.lora_targets) {
    MOETRAIN_CHECK(matched.count(target), ExitCode::kBadConfig,
                   fmt::format("lora.targets: \"{}\" matches no module of this model; its targets are: {}",
                               target, fmt::join(available, ", ")));
  }
  const std::vector<std::string> unused = ranks.unused_keys();
  MOETRAIN_CHECK(unused.empty(), ExitCode::kBadConfig,
                 fmt::format("{} selects no LoRA adapter of this model (PEFT's rule: a key matches a whole "
                             "dot-separated tail of a module name, as `q_proj` or `experts\\..*` do); its adapted "
                             "modules are {}",
                             fmt::join(unused, ", "), fmt::join(adapted, ", ")));
}

std::vector<WeightSlot> Model::layer_weight_slots(size_t index) {
  std::vector<WeightSlot> slots;
  std::string prefix = "model.layers." + std::to_string(index) + ".";
  slots.push_back({prefix + "input_layernorm.weight", &layers_[index].input_norm});
  slots.push_back({prefix + "post_attention_layernorm.weight", &layers_[index].post_attention_norm});
  attn_res_.collect_layer_weights(prefix, layers_[index].attention_mix, layers_[index].mlp_mix, slots);
  layers_[index].mixer->collect_weights(slots);
  layers_[index].ffn->collect_weights(slots);
  return slots;
}

std::vector<WeightSlot> Model::weight_slots() {
  std::vector<WeightSlot> slots;
  slots.push_back({"model.embed_tokens.weight", &embed_});
  for (size_t i = 0; i < layers_.size(); ++i) {
    std::vector<WeightSlot> layer = layer_weight_slots(i);
    slots.insert(slots.end(), layer.begin(), layer.end());
  }
  slots.push_back({"model.norm.weight", &final_norm_});
  attn_res_.collect_output_weights(slots);
  if (!spec_.config.tie_word_embeddings) slots.push_back({"lm_head.weight", &lm_head_});
  if (vision_) {
    std::vector<WeightSlot> vision = vision_->weight_slots();
    slots.insert(slots.end(), vision.begin(), vision.end());
  }
  return slots;
}

LayerContext Model::context(const BatchTensors& batch) {
  LayerContext ctx{backend_, options_.dtype, batch};
  if (batch.context) ctx.context_group = options_.parallel->cp;  // checked in upload()
  ctx.context_key_chunk = options_.cp_key_chunk;
  ctx.attention_query_block = options_.attention_query_block;
  return ctx;
}

BatchTensors Model::upload(const Batch& batch) {
  if (batch.context) {
    const ParallelGroups* parallel = options_.parallel;
    MOETRAIN_CHECK(parallel && parallel->cp && parallel->cp->size() == batch.context->ranks() &&
                       parallel->cp->rank() == batch.context_rank,
                   ExitCode::kInternal,
                   fmt::format("shard {} of a micro-batch cut into {} context shards needs to run on that rank of a "
                               "context-parallel group of as many ranks (ParallelGroups::cp)",
                               batch.context_rank, batch.context->ranks()));
  }
  check_batch(batch, spec_.config.vocab_size, spec_.config.mla.use_rope ? rope_.cos.size(0) : INT32_MAX);
  BatchTensors bt = batches_.upload(batch);
  upload_images(batch, bt);
  return bt;
}

Tensor Model::embed(const LayerContext& ctx, bool keep, std::string& where) {
  where = "the embedding forward";
  Tensor out = ctx.alloc({ctx.batch.num_tokens, spec_.config.hidden_size});
  fsdp_.gather_outer();
  backend_.embedding_forward_checked_ids(out, embed_, ctx.batch.input_ids);  // checked in upload()
  fsdp_.release_outer();
  merge_images(ctx, out, keep, where);
  return out;
}

std::vector<MoeFfn*> Model::moe_layers() {
  std::vector<MoeFfn*> out;
  for (DecoderLayer& layer : layers_) {
    if (MoeFfn* moe = routed_moe(layer.ffn.get())) out.push_back(moe);
  }
  return out;
}

// The residual stream of one layer; with Block Attention Residuals (attn_res.h) the mixer's and
// the feed-forward's inputs are depth mixes, and a block start restarts the running sum.
void Model::layer_forward(const LayerContext& ctx, size_t index, const TensorView* out, const TensorView& x,
                          const std::vector<TensorView>& summaries, int64_t ffn_chunks) {
  kernels::Backend& be = backend_;
  DecoderLayer& layer = layers_[index];
  LayerSaved& s = saved_[index];
  const int64_t n = x.size(0), d = x.size(1);
  const double eps = spec_.config.rms_norm_eps;
  TensorView mixer_in = x;
  const std::vector<TensorView> before = attn_res_.filed_before(summaries, index);
  if (!before.empty()) mixer_in = attn_res_.mix_forward(ctx, layer.attention_mix, with(before, x), s.mixer_mix);
  s.normed_in = ctx.alloc({n, d});
  s.rstd_in = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{s.normed_in, s.rstd_in, mixer_in, layer.input_norm, eps});
  Tensor mixed = ctx.alloc({n, d});
  layer.mixer->forward(ctx, mixed, s.normed_in);
  s.hidden = ctx.alloc({n, d});
  if (attn_res_.starts_block(index)) {
    be.copy(s.hidden, mixed);
  } else {
    be.copy(s.hidden, x);
    be.axpby(s.hidden, mixed, 1.0, 1.0);
  }
  TensorView ffn_in = s.hidden;
  if (attn_res_.enabled()) ffn_in = attn_res_.mix_forward(ctx, layer.mlp_mix, with(summaries, s.hidden.view()), s.ffn_mix);
  s.normed_mid = ctx.alloc({n, d});
  s.rstd_mid = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{s.normed_mid, s.rstd_mid, ffn_in, layer.post_attention_norm, eps});
  if (out != nullptr) ffn_forward(ctx, index, *out, ffn_chunks);
}

int64_t Model::ffn_chunks(const LayerContext& ctx) const {
  const int64_t most = options_.ffn_chunk_tokens;
  const int64_t tokens = ctx.batch.context ? ctx.batch.context->longest_shard() : ctx.batch.num_tokens;
  return most > 0 && tokens > most ? (tokens + most - 1) / most : 1;
}

void Model::start_ffn_rows(const LayerContext& ctx, size_t index, int64_t first_row) {
  auto* moe = routed_moe(layers_[index].ffn.get());
  if (moe == nullptr) return;
  // Micro-batch j of the pass draws the stream forward j of the step would alone.
  const std::vector<int64_t>& bounds = ctx.batch.micro_batch_rows;
  std::vector<NoiseStream> noise;
  for (size_t j = 0; j + 1 < bounds.size(); ++j) {
    noise.push_back({options_.seed ^ ((forward_count_ + j) * 1000003ull + index), bounds[j + 1] - bounds[j]});
  }
  moe->start_rows(std::move(noise), first_row);
}

void Model::ffn_forward(const LayerContext& ctx, size_t index, const TensorView& out, int64_t chunks) {
  FeedForward& ffn = *layers_[index].ffn;
  const LayerSaved& s = saved_[index];
  const int64_t n = out.size(0);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * n / chunks, end = (c + 1) * n / chunks;
    start_ffn_rows(ctx, index, begin);
    const TensorView rows = out.slice_rows(begin, end);
    ffn.forward(ctx, rows, s.normed_mid.view().slice_rows(begin, end));
    backend_.axpby(rows, s.hidden.view().slice_rows(begin, end), 1.0, 1.0);
    if (chunks > 1) ffn.release_saved();
  }
}

void Model::ffn_backward(const LayerContext& ctx, size_t index, const TensorView& dnormed_mid, const TensorView& dout,
                         int64_t chunks) {
  FeedForward& ffn = *layers_[index].ffn;
  const LayerSaved& s = saved_[index];
  if (chunks == 1) {
    ffn.backward(ctx, dnormed_mid, dout, s.normed_mid);
    return;
  }
  const int64_t n = dout.size(0), d = dout.size(1);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * n / chunks, end = (c + 1) * n / chunks;
    const TensorView x = s.normed_mid.view().slice_rows(begin, end);
    start_ffn_rows(ctx, index, begin);
    {
      Tensor unused = ctx.alloc({end - begin, d});
      ffn.forward(ctx, unused, x);
    }
    ffn.backward(ctx, dnormed_mid.slice_rows(begin, end), dout.slice_rows(begin, end), x);
    ffn.release_saved();
  }
}

void Model::layer_backward(const LayerContext& ctx, size_t index, const TensorView& dx, const TensorView& dout,
                           const TensorView& x, const std::vector<TensorView>& summaries,
                           const std::vector<TensorView>& dsummaries, int64_t ffn_chunks) {
  kernels::Backend& be = backend_;
  DecoderLayer& layer = layers_[index];
  LayerSaved& s = saved_[index];
  const int64_t n = x.size(0), d = x.size(1);
  Tensor dnormed_mid = ctx.alloc({n, d});
  ffn_backward(ctx, index, dnormed_mid, dout, ffn_chunks);
  // dhidden: the gradient of the sum the feed-forward's output was added to.
  Tensor dhidden = ctx.alloc({n, d});
  be.copy(dhidden, dout);
  if (s.ffn_mix.out.defined()) {
    Tensor dffn_in = ctx.alloc({n, d});
    be.rmsnorm_backward(
        RmsNormBackwardArgs{dffn_in, {}, dnormed_mid, s.ffn_mix.out, layer.post_attention_norm, s.rstd_mid, false});
    attn_res_.mix_backward(ctx, layer.mlp_mix, with(dsummaries, dhidden.view()), dffn_in,
                           with(summaries, s.hidden.view()), s.ffn_mix);
  } else {
    be.rmsnorm_backward(
        RmsNormBackwardArgs{dhidden, {}, dnormed_mid, s.hidden, layer.post_attention_norm, s.rstd_mid, true});
  }
  Tensor dnormed_in = ctx.alloc({n, d});
  layer.mixer->backward(ctx, dnormed_in, dhidden, s.normed_in);
  // x reaches the running sum unless the block restarts here.
  if (attn_res_.starts_block(index)) be.fill(dx, 0.0);
  else be.copy(dx, dhidden);
  if (s.mixer_mix.out.defined()) {
    const std::vector<TensorView> before = attn_res_.filed_before(summaries, index);
    const std::vector<TensorView> dbefore = attn_res_.filed_before(dsummaries, index);
    Tensor dmixer_in = ctx.alloc({n, d});
    be.rmsnorm_backward(
        RmsNormBackwardArgs{dmixer_in, {}, dnormed_in, s.mixer_mix.out, layer.input_norm, s.rstd_in, false});
    attn_res_.mix_backward(ctx, layer.attention_mix, with(dbefore, dx), dmixer_in, with(before, x), s.mixer_mix);
  } else {
    be.rmsnorm_backward(RmsNormBackwardArgs{dx, {}, dnormed_in, x, layer.input_norm, s.rstd_in, true});
  }
}

void Model::release_layer(size_t index) {
  saved_[index] = LayerSaved{};
  layers_[index].mixer->release_saved();
  layers_[index].ffn->release_saved();
}

Tensor Model::head_loss(const LayerContext& ctx, const TensorView& final_hidden, const TensorView* dfinal,
                        double grad_scale) {
  kernels::Backend& be = backend_;
  const int64_t n = final_hidden.size(0);
  const int64_t vocab = spec_.config.vocab_size;
  Tensor losses = ctx.alloc_accum({n});
  // Row chunks: at most loss_chunk_rows x vocab logits exist at once, whatever the sequence.
  for (int64_t begin = 0; begin < n; begin += options_.loss_chunk_rows) {
    const int64_t end = std::min(n, begin + options_.loss_chunk_rows);
    Tensor logits = ctx.alloc_accum({end - begin, vocab});  // softmax statistics want F32
    // Their gradient in the compute dtype, which the head's GEMM takes as is (BF16 on CUDA: an F32
    // one it would first round in a pass of its own over the chunk). Without dfinal the kernel
    // still writes one, at scale 0.
    Tensor dlogits = ctx.alloc({end - begin, vocab});
    be.gemm(GemmArgs{logits, final_hidden.slice_rows(begin, end), head(), false, true, 1.0, 0.0});
    be.cross_entropy(kernels::CrossEntropyArgs{losses.view().slice_rows(begin, end), dlogits, logits,
                                               ctx.batch.labels.view().slice_rows(begin, end),
                                               dfinal ? grad_scale : 0.0});
    if (dfinal == nullptr) continue;
    logits.reset();
    be.gemm(GemmArgs{dfinal->slice_rows(begin, end), dlogits, head(), false, false, 1.0, 0.0});
  }
  return losses;
}

StepResult Model::forward_backward(const Batch& batch, double grad_scale) {
  return forward_backward_async(batch, grad_scale).get();
}

PendingStep Model::forward_backward_async(const Batch& batch, double grad_scale) {
  return forward_backward_window_async({&batch}, grad_scale);
}

PendingStep Model::forward_backward_window_async(const std::vector<const Batch*>& window, double grad_scale) {
  std::string where = "the batch upload";
  try {
    return run_step(window, grad_scale, where);
  } catch (const Error& error) {
    throw Error(error.code(), where + ": " + error.what());
  }
}

void Model::hold_parameters(bool hold) {
  for (DecoderLayer& layer : layers_) {
    for (SwigluExperts* network : swiglu_networks(layer.ffn.get())) network->hold_packed_lora(hold);
  }
}

PendingStep Model::run_step(const std::vector<const Batch*>& window, double grad_scale, std::string& where) {
  MOETRAIN_ASSERT(!window.empty(), "an empty expert window");
  // One micro-batch runs as it is; a window as the packed concatenation of its micro-batches,
  // whose windows stay separate segments, so every mixer, position and label is as it was.
  const Batch joined = window.size() > 1 ? Batch::concatenated(window) : Batch();
  const Batch& batch = window.size() > 1 ? joined : *window.front();
  BatchTensors bt = upload(batch);
  bt.micro_batch_rows = {0};
  for (const Batch* part : window) bt.micro_batch_rows.push_back(bt.micro_batch_rows.back() + part->num_tokens());
  LayerContext ctx = context(bt);
  Forward fwd = forward(ctx, ForwardMode::kForBackward, where);
  Tensor dfinal = ctx.alloc({bt.num_tokens, spec_.config.hidden_size});
  const TensorView dfinal_view = dfinal;
  Tensor losses = head_loss(ctx, fwd.final_hidden, &dfinal_view, grad_scale);
  backward(ctx, fwd, dfinal, where);
  forward_count_ += window.size();
  // The loss and the statistics go to the host in one copy, after the whole micro-batch is queued
  // (a recomputed forward routes exactly as the first did, so its statistics are the same).
  where = "the loss and statistics read-back";
  return results_.queue(ctx, losses, moe_layers(), batch.num_targets());
}

// Forward, keeping every layer's input (the activation checkpoints) for a backward. FSDP: each
// layer's weights are gathered just before use (with fsdp_prefetch layers ahead) and freed after
// (fsdp_schedule.h).
Model::Forward Model::forward(const LayerContext& ctx, ForwardMode mode, std::string& where) {
  kernels::Backend& be = backend_;
  const bool backward_follows = mode == ForwardMode::kForBackward;
  const int64_t n = ctx.batch.num_tokens, d = spec_.config.hidden_size;
  const size_t num_layers = layers_.size();
  Forward fwd;
  std::vector<Tensor>& inputs = fwd.inputs;
  inputs.resize(num_layers + 1);
  if (backward_follows) checkpoints_.begin(num_layers);
  inputs[0] = embed(ctx, backward_follows && vision_trains(), where);
  const int64_t chunks = ffn_chunks(ctx);
  for (size_t i = 0; i < num_layers; ++i) {
    where = layer_pass(spec_, i, "forward");
    fsdp_.gather_for_forward(i);
    inputs[i + 1] = ctx.alloc({n, d});
    const TensorView out = inputs[i + 1];
    layer_forward(ctx, i, &out, inputs[i], attn_res_.summaries_for(inputs, i), chunks);
    if (!backward_follows || recomputes(i)) release_layer(i);
    fsdp_.forward_done(i, num_layers, backward_follows);
    // Only the block summaries (Block Attention Residuals) are read again before the backward.
    if (!attn_res_.starts_block(i)) {
      if (backward_follows) checkpoints_.keep(i, std::move(inputs[i]));
      else inputs[i].reset();
    }
  }
  where = backward_follows ? "the final norm and the loss" : "the final norm";
  fsdp_.gather_outer();
  fwd.final_hidden = ctx.alloc({n, d});
  fwd.final_rstd = ctx.alloc_accum({n});
  fwd.final_in = attn_res_.final_input(ctx, inputs);
  be.rmsnorm_forward(
      RmsNormArgs{fwd.final_hidden, fwd.final_rstd, fwd.final_in, final_norm_, spec_.config.rms_norm_eps});
  if (!backward_follows) {
    attn_res_.release_final();
    fwd.final_in = TensorView{};
  }
  return fwd;
}

// With Block Attention Residuals each summary's gradient gathers a term from every later mix, in
// the accumulation dtype; it joins the stream's gradient at its own layer.
void Model::backward(const LayerContext& ctx, Forward& fwd, const TensorView& dfinal, std::string& where) {
  kernels::Backend& be = backend_;
  const int64_t n = ctx.batch.num_tokens;
  const int64_t d = spec_.config.hidden_size;
  std::vector<Tensor>& inputs = fwd.inputs;
  where = "the final norm's backward";
  Tensor dx = ctx.alloc({n, d});
  std::vector<Tensor> dsummaries;
  if (!attn_res_.enabled()) {
    be.rmsnorm_backward(RmsNormBackwardArgs{dx, {}, dfinal, fwd.final_in, final_norm_, fwd.final_rstd, false});
  } else {
    Tensor dmix = ctx.alloc({n, d});
    be.rmsnorm_backward(RmsNormBackwardArgs{dmix, {}, dfinal, fwd.final_in, final_norm_, fwd.final_rstd, false});
    dsummaries = attn_res_.final_backward(ctx, dx, dmix, inputs);
  }
  fsdp_.release_outer();
  const int64_t chunks = ffn_chunks(ctx);
  for (size_t i = layers_.size(); i-- > 0;) {
    where = layer_pass(spec_, i, recomputes(i) ? "backward (and its recomputed forward)" : "backward");
    fsdp_.gather_for_backward(i);
    const std::vector<TensorView> summaries = attn_res_.summaries_for(inputs, i);
    const Tensor input = attn_res_.starts_block(i) ? Tensor() : checkpoints_.take(ctx, i);
    const TensorView& x = attn_res_.starts_block(i) ? inputs[i].view() : input.view();
    if (i > 0) checkpoints_.prefetch(ctx, i - 1);  // its copy overlaps this layer
    if (recomputes(i)) {
      // A chunked feed-forward re-runs chunk by chunk in layer_backward: only the mixer half here.
      Tensor recomputed = chunks == 1 ? ctx.alloc({n, d}) : Tensor();
      const TensorView out = recomputed;
      layer_forward(ctx, i, chunks == 1 ? &out : nullptr, x, summaries, chunks);
    }
    Tensor dprev = ctx.alloc({n, d});
    layer_backward(ctx, i, dprev, dx, x, summaries, std::vector<TensorView>(dsummaries.begin(), dsummaries.end()),
                   chunks);
    if (attn_res_.starts_block(i)) {  // inputs[i] is the last summary: its gradient is complete
      be.axpby(dprev, dsummaries.back(), 1.0, 1.0);
      dsummaries.pop_back();
    }
    release_layer(i);
    fsdp_.release_layer(i);
    inputs[i + 1].reset();
    dx = std::move(dprev);
  }
  merge_images_backward(ctx, dx, where);
}

Tensor Model::logits(const Batch& batch) {
  BatchTensors bt = upload(batch);
  LayerContext ctx = context(bt);
  kernels::Backend& be = backend_;
  std::string where;
  Forward fwd = forward(ctx, ForwardMode::kForwardOnly, where);
  Tensor logits = ctx.alloc_accum({bt.num_tokens, spec_.config.vocab_size});
  be.gemm(GemmArgs{logits, fwd.final_hidden, head(), false, true, 1.0, 0.0});
  fsdp_.release_outer();
  ++forward_count_;
  return to_host_f64(be, logits);
}

Tensor Model::embedded(const Batch& batch) {
  BatchTensors bt = upload(batch);
  LayerContext ctx = context(bt);
  std::string where;
  return to_host_f64(backend_, embed(ctx, false, where));
}

StepResult Model::evaluate(const Batch& batch) {
  // No router noise, and forward_count() untouched: a run that evaluates trains exactly as one
  // that does not (the noise stream is saved in checkpoints and seeds every later forward).
  struct NoiseOff {
    std::vector<MoeFfn*> layers;
    ~NoiseOff() {
      for (MoeFfn* moe : layers) moe->set_noise_enabled(true);
    }
  } noise_off;
  for (MoeFfn* moe : moe_layers()) {
    moe->set_noise_enabled(false);
    noise_off.layers.push_back(moe);
  }
  std::string where = "the batch upload";
  try {
    BatchTensors bt = upload(batch);
    LayerContext ctx = context(bt);
    Forward fwd = forward(ctx, ForwardMode::kForwardOnly, where);
    where = "the eval loss";
    Tensor losses = head_loss(ctx, fwd.final_hidden, nullptr, 0.0);
    fsdp_.release_outer();
    // The loss sum as the training step reads it (in token order, in double), without statistics.
    return results_.queue(ctx, losses, {}, batch.num_targets()).get();
  } catch (const Error& error) {
    throw Error(error.code(), "evaluation, " + where + ": " + error.what());
  }
}

}  // namespace moetrain
