#include "core/model/model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "core/base/host_convert.h"
#include "core/config/lora_patterns.h"
#include "core/model/dense_ffn.h"
#include "core/model/dsa.h"
#include "core/model/fsdp_bucket.h"
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

// `bytes` (a U8 buffer) read as a tensor of `dtype` and `shape` from byte `offset` on.
TensorView bytes_as(const TensorView& bytes, size_t offset, DType dtype, Shape shape) {
  return TensorView{static_cast<char*>(bytes.data) + offset, dtype, bytes.device, shape};
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
    : spec_(spec), backend_(backend), options_(options) {
  const ModelConfig& m = spec_.config;
  LayerContext ctx = context(no_batch());
  const int64_t d = m.hidden_size;
  embed_ = ctx.alloc({m.vocab_size, d});
  final_norm_ = ctx.alloc({d});
  auto make_mix = [&] { return AttnResMix{ctx.alloc({d}), ctx.alloc({1, d})}; };
  if (attn_res()) output_mix_ = make_mix();
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
    if (attn_res()) {
      layer.attention_mix = make_mix();
      layer.mlp_mix = make_mix();
    }
    const RopeDeviceTables* rope = m.mla.use_rope ? &rope_ : nullptr;
    if (spec_.mixers[i] == MixerKind::kKda) layer.mixer = std::make_unique<KdaAttention>(spec_, i, ctx);
    else if (spec_.mixers[i] == MixerKind::kDsa) layer.mixer = std::make_unique<DsaAttention>(spec_, i, ctx, rope);
    else layer.mixer = std::make_unique<MlaAttention>(spec_, i, ctx, rope);
    if (spec_.ffns[i] == FfnKind::kDense) {
      auto dense = std::make_unique<DenseFfn>("model.layers." + std::to_string(i) + ".mlp", d, m.intermediate_size, ctx);
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
  attach_lora();
  group_parameters();
}

ModelOptions model_options_for(const Config& config) {
  ModelOptions options;
  options.recompute = config.parallel.recompute;
  options.recompute_layers = config.parallel.recompute_layers;
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
    if (auto* mla = dynamic_cast<MlaAttention*>(layer.mixer.get())) {
      for (LoraLinear* p : mla->projections()) out.emplace_back(p->name(), p);
    }
    if (auto* kda = dynamic_cast<KdaAttention*>(layer.mixer.get())) {
      for (LoraLinear* p : kda->projections()) out.emplace_back(p->name(), p);
    }
    if (auto* dsa = dynamic_cast<DsaAttention*>(layer.mixer.get())) {
      for (LoraLinear* p : dsa->projections()) out.emplace_back(p->name(), p);
    }
    if (auto* latent = dynamic_cast<LatentMoeFfn*>(layer.ffn.get())) {
      for (LoraLinear* p : latent->projections()) out.emplace_back(p->name(), p);
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
  if (attn_res()) {
    DecoderLayer& layer = layers_[index];
    slots.push_back({prefix + "self_attention_res_norm.weight", &layer.attention_mix.norm});
    slots.push_back({prefix + "self_attention_res_proj.weight", &layer.attention_mix.query});
    slots.push_back({prefix + "mlp_res_norm.weight", &layer.mlp_mix.norm});
    slots.push_back({prefix + "mlp_res_proj.weight", &layer.mlp_mix.query});
  }
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
  if (attn_res()) {
    slots.push_back({"model.output_attn_res_norm.weight", &output_mix_.norm});
    slots.push_back({"model.output_attn_res_proj.weight", &output_mix_.query});
  }
  if (!spec_.config.tie_word_embeddings) slots.push_back({"lm_head.weight", &lm_head_});
  return slots;
}

BatchTensors Model::upload(const Batch& batch) {
  const int64_t n = batch.num_tokens();
  const int64_t vocab = spec_.config.vocab_size;
  MOETRAIN_CHECK(static_cast<int64_t>(batch.input_ids.size()) == n && static_cast<int64_t>(batch.labels.size()) == n &&
                     static_cast<int64_t>(batch.positions.size()) == n && batch.cu_seqlens.size() >= 2 &&
                     batch.cu_seqlens.back() == n,
                 ExitCode::kInternal, "malformed batch: sizes do not match batch_size * seq_len");
  const int64_t max_position = spec_.config.mla.use_rope ? rope_.cos.size(0) : INT32_MAX;
  for (int64_t t = 0; t < n; ++t) {
    // Token ids are checked here, on the host, before they can index anything on a device.
    MOETRAIN_CHECK(batch.input_ids[t] >= 0 && batch.input_ids[t] < vocab, ExitCode::kBadData,
                   fmt::format("token id {} at batch position {} is outside the vocabulary [0, {}): the data "
                               "was tokenized for another model",
                               batch.input_ids[t], t, vocab));
    MOETRAIN_CHECK(batch.labels[t] < vocab, ExitCode::kBadData,
                   fmt::format("label {} at batch position {} is outside the vocabulary [0, {})", batch.labels[t], t,
                               vocab));
    MOETRAIN_CHECK(batch.positions[t] >= 0 && batch.positions[t] < max_position, ExitCode::kBadData,
                   fmt::format("position {} at batch position {} exceeds model.max_position_embeddings ({}): "
                               "shorten data.seq_len or raise max_position_embeddings",
                               batch.positions[t], t, max_position));
  }
  UploadBuffer& buffer = upload_buffers_[upload_turn_++ % upload_buffers_.size()];
  if (buffer.copied) buffer.copied->wait();  // its last batch has left it
  const int64_t needed = 3 * n + static_cast<int64_t>(batch.cu_seqlens.size());
  if (!buffer.host.defined() || buffer.host.numel() < needed) {
    // Room for the most segments a batch of n tokens can have (n + 1 offsets): batches of one size
    // never make it grow, and a pinned allocation or free costs a wait of its own.
    buffer.host.reset();
    buffer.host = Tensor({std::max<int64_t>(needed, 4 * n + 1)}, DType::kI32, backend_.pinned_allocator());
  }
  int64_t used = 0;
  auto upload_values = [&](const std::vector<int32_t>& values) {
    const int64_t count = static_cast<int64_t>(values.size());
    std::copy(values.begin(), values.end(), buffer.host.ptr<int32_t>() + used);
    Tensor device({count}, DType::kI32, backend_.allocator());
    backend_.copy_async(device, buffer.host.view().slice_rows(used, used + count));
    used += count;
    return device;
  };
  BatchTensors bt;
  bt.input_ids = upload_values(batch.input_ids);
  bt.labels = upload_values(batch.labels);
  bt.positions = upload_values(batch.positions);
  bt.cu_seqlens = upload_values(batch.cu_seqlens);
  buffer.copied = backend_.record_event();
  bt.num_tokens = n;
  bt.seq_len = batch.seq_len;
  return bt;
}

namespace {

// One depth mix (kernels/ops.h AttnResArgs): out and its probabilities [n, values] from values.
void mix_forward(const LayerContext& ctx, const AttnResMix& mix, Tensor& out, Tensor& probs,
                 const std::vector<TensorView>& values, double eps) {
  const int64_t n = values.front().size(0), d = values.front().size(1);
  out = ctx.alloc({n, d});
  probs = ctx.alloc_accum({n, static_cast<int64_t>(values.size())});
  ctx.backend.attn_res_forward(
      kernels::AttnResArgs{out, probs, values, mix.norm, mix.query.view().reshaped({d}), eps});
}

void mix_backward(const LayerContext& ctx, const AttnResMix& mix, const std::vector<TensorView>& dvalues,
                  const TensorView& dout, const std::vector<TensorView>& values, const Tensor& probs, double eps) {
  const int64_t d = dout.size(1);
  ctx.backend.attn_res_backward(
      kernels::AttnResBackwardArgs{dvalues, dout, values, mix.norm, mix.query.view().reshaped({d}), probs, eps});
}

template <typename T>
std::vector<T> with(std::vector<T> list, const T& last) {
  list.push_back(last);
  return list;
}

}  // namespace

// Block Attention Residuals (model.attn_res_block_size = B > 0, Kimi K3; NeMo AutoModel's
// kimi_k3 decoder layer). The stream carries the running sum h and the block summaries: the
// inputs of layers 0, B, 2B, ... Layer i, with S the summaries filed before it:
//   x   = mix_attention(S, h)             (h itself when S is empty: layer 0)
//   i % B == 0: h is filed as a summary and the running sum restarts: p = mixer(norm(x))
//   else:                                                              p = h + mixer(norm(x))
//   y   = mix_mlp(S and h if filed, p)
//   out = p + ffn(norm(y))
// Without it, x = h, y = p = h + mixer(norm(h)), the plain pre-norm residual.
void Model::layer_forward(const LayerContext& ctx, size_t index, const TensorView& out, const TensorView& x,
                          const std::vector<TensorView>& summaries) {
  kernels::Backend& be = backend_;
  DecoderLayer& layer = layers_[index];
  LayerSaved& s = saved_[index];
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  const double eps = spec_.config.rms_norm_eps;
  const bool block_start = starts_block(index);
  if (auto* moe = routed_moe(layer.ffn.get())) {
    moe->set_noise_seed(options_.seed ^ (forward_count_ * 1000003ull + index));
  }
  TensorView mixer_in = x;
  const std::vector<TensorView> before(summaries.begin(), summaries.end() - (block_start ? 1 : 0));
  if (!before.empty()) {
    mix_forward(ctx, layer.attention_mix, s.mixer_in, s.mixer_probs, with(before, x), eps);
    mixer_in = s.mixer_in;
  }
  s.normed_in = ctx.alloc({n, d});
  s.rstd_in = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{s.normed_in, s.rstd_in, mixer_in, layer.input_norm, eps});
  Tensor mixed = ctx.alloc({n, d});
  layer.mixer->forward(ctx, mixed, s.normed_in);
  s.hidden = ctx.alloc({n, d});
  if (block_start) {
    be.copy(s.hidden, mixed);
  } else {
    be.copy(s.hidden, x);
    be.axpby(s.hidden, mixed, 1.0, 1.0);
  }
  TensorView ffn_in = s.hidden;
  if (attn_res()) {
    mix_forward(ctx, layer.mlp_mix, s.ffn_in, s.ffn_probs, with(summaries, s.hidden.view()), eps);
    ffn_in = s.ffn_in;
  }
  s.normed_mid = ctx.alloc({n, d});
  s.rstd_mid = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{s.normed_mid, s.rstd_mid, ffn_in, layer.post_attention_norm, eps});
  Tensor ffn_out = ctx.alloc({n, d});
  layer.ffn->forward(ctx, ffn_out, s.normed_mid);
  be.copy(out, s.hidden);
  be.axpby(out, ffn_out, 1.0, 1.0);
}

void Model::layer_backward(const LayerContext& ctx, size_t index, const TensorView& dx, const TensorView& dout,
                           const TensorView& x, const std::vector<TensorView>& summaries,
                           const std::vector<TensorView>& dsummaries) {
  kernels::Backend& be = backend_;
  DecoderLayer& layer = layers_[index];
  LayerSaved& s = saved_[index];
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  const double eps = spec_.config.rms_norm_eps;
  const bool block_start = starts_block(index);
  Tensor dnormed_mid = ctx.alloc({n, d});
  layer.ffn->backward(ctx, dnormed_mid, dout, s.normed_mid);
  // dhidden: the gradient of the sum the feed-forward's output was added to.
  Tensor dhidden = ctx.alloc({n, d});
  be.copy(dhidden, dout);
  if (s.ffn_in.defined()) {
    Tensor dffn_in = ctx.alloc({n, d});
    be.rmsnorm_backward(
        RmsNormBackwardArgs{dffn_in, {}, dnormed_mid, s.ffn_in, layer.post_attention_norm, s.rstd_mid, false});
    mix_backward(ctx, layer.mlp_mix, with(dsummaries, dhidden.view()), dffn_in, with(summaries, s.hidden.view()),
                 s.ffn_probs, eps);
  } else {
    be.rmsnorm_backward(
        RmsNormBackwardArgs{dhidden, {}, dnormed_mid, s.hidden, layer.post_attention_norm, s.rstd_mid, true});
  }
  Tensor dnormed_in = ctx.alloc({n, d});
  layer.mixer->backward(ctx, dnormed_in, dhidden, s.normed_in);
  // x reaches the running sum unless the block restarts here.
  if (block_start) be.fill(dx, 0.0);
  else be.copy(dx, dhidden);
  if (s.mixer_in.defined()) {
    const std::vector<TensorView> before(summaries.begin(), summaries.end() - (block_start ? 1 : 0));
    const std::vector<TensorView> dbefore(dsummaries.begin(), dsummaries.end() - (block_start ? 1 : 0));
    Tensor dmixer_in = ctx.alloc({n, d});
    be.rmsnorm_backward(RmsNormBackwardArgs{dmixer_in, {}, dnormed_in, s.mixer_in, layer.input_norm, s.rstd_in, false});
    mix_backward(ctx, layer.attention_mix, with(dbefore, dx), dmixer_in, with(before, x), s.mixer_probs, eps);
  } else {
    be.rmsnorm_backward(RmsNormBackwardArgs{dx, {}, dnormed_in, x, layer.input_norm, s.rstd_in, true});
  }
}

std::vector<TensorView> Model::summaries_for(const std::vector<Tensor>& inputs, size_t index) const {
  std::vector<TensorView> out;
  if (!attn_res()) return out;
  const size_t block = static_cast<size_t>(spec_.config.attn_res_block_size);
  for (size_t j = 0; j <= index; j += block) out.push_back(inputs[j]);
  return out;
}

TensorView Model::final_norm_input(const LayerContext& ctx, const std::vector<Tensor>& inputs) {
  const size_t num_layers = layers_.size();
  if (!attn_res()) return inputs[num_layers];
  // Every summary (the last layer sees them all) and the last layer's output.
  mix_forward(ctx, output_mix_, final_mix_, final_mix_probs_, with(summaries_for(inputs, num_layers - 1),
                                                                   inputs[num_layers].view()),
              spec_.config.rms_norm_eps);
  return final_mix_;
}

void Model::release_layer(size_t index) {
  saved_[index] = LayerSaved{};
  layers_[index].mixer->release_saved();
  layers_[index].ffn->release_saved();
}

Tensor Model::loss_and_grad(const LayerContext& ctx, const TensorView& dfinal, const TensorView& final_hidden,
                           double grad_scale) {
  kernels::Backend& be = backend_;
  const Tensor& head = spec_.config.tie_word_embeddings ? embed_ : lm_head_;
  const int64_t n = final_hidden.size(0);
  const int64_t vocab = spec_.config.vocab_size;
  Tensor losses = ctx.alloc_accum({n});
  // Row chunks: at most loss_chunk_rows x vocab logits exist at once, whatever the sequence.
  for (int64_t begin = 0; begin < n; begin += options_.loss_chunk_rows) {
    int64_t end = std::min(n, begin + options_.loss_chunk_rows);
    Tensor logits = ctx.alloc_accum({end - begin, vocab});  // softmax statistics want F32
    // Their gradient in the compute dtype, which the head's GEMM takes as is (BF16 on CUDA: an F32
    // one it would first round in a pass of its own over the chunk).
    Tensor dlogits = ctx.alloc({end - begin, vocab});
    be.gemm(GemmArgs{logits, final_hidden.slice_rows(begin, end), head, false, true, 1.0, 0.0});
    be.cross_entropy(kernels::CrossEntropyArgs{losses.view().slice_rows(begin, end), dlogits, logits,
                                               ctx.batch.labels.view().slice_rows(begin, end), grad_scale});
    logits.reset();
    be.gemm(GemmArgs{dfinal.slice_rows(begin, end), dlogits, head, false, false, 1.0, 0.0});
  }
  return losses;
}

PendingStep Model::queue_results(const LayerContext& ctx, const Tensor& losses, int64_t targets) {
  kernels::Backend& be = backend_;
  // One buffer: the losses, then per MoE layer its offsets and (when it has one) its aux loss,
  // each part 8-byte aligned, so that the host's reads of it are aligned.
  struct Part {
    TensorView device;
    size_t offset;
  };
  std::vector<Part> parts;
  size_t bytes = 0;
  auto add = [&](const TensorView& device) {
    parts.push_back({device, bytes});
    bytes += (device.nbytes() + 7) / 8 * 8;
  };
  add(losses);
  struct Routed {
    size_t offsets, aux;  // parts' indices (aux: 0 when the layer has no aux loss)
    int64_t experts;
  };
  std::vector<Routed> routed;
  for (DecoderLayer& layer : layers_) {
    MoeFfn* moe = routed_moe(layer.ffn.get());
    if (moe == nullptr) continue;
    MOETRAIN_ASSERT(moe->stats_offsets().defined(), "an MoE layer without statistics after its forward");
    Routed r{parts.size(), 0, moe->stats_offsets().numel() - 1};
    add(moe->stats_offsets());
    if (moe->stats_aux_loss().defined()) {
      r.aux = parts.size();
      add(moe->stats_aux_loss());
    }
    routed.push_back(r);
  }
  Tensor gathered = ctx.alloc({static_cast<int64_t>(bytes)}, DType::kU8);
  for (const Part& part : parts) {
    be.copy(bytes_as(gathered, part.offset, part.device.dtype, part.device.shape), part.device);
  }

  std::shared_ptr<Tensor> host;  // a free pinned buffer, or a new one
  for (const std::shared_ptr<Tensor>& buffer : result_buffers_) {
    if (buffer.use_count() == 1 && buffer->nbytes() >= bytes) {
      host = buffer;
      break;
    }
  }
  if (!host) {
    host = std::make_shared<Tensor>(Shape{static_cast<int64_t>(bytes)}, DType::kU8, be.pinned_allocator());
    result_buffers_.push_back(host);
  }
  // A buffer a dropped PendingStep left may still be being written: this copy is queued after that.
  be.copy_async(host->view().slice_rows(0, static_cast<int64_t>(bytes)), gathered);
  std::shared_ptr<kernels::QueueEvent> arrived = be.record_event();
  return PendingStep([host, arrived, parts, routed, targets]() {
    arrived->wait();
    auto part = [&](size_t i) {
      return bytes_as(host->view(), parts[i].offset, parts[i].device.dtype, parts[i].device.shape);
    };
    // The sum of the per-token losses in token order, in double.
    Tensor values(parts[0].device.shape, DType::kF64);
    convert_host(values, part(0));
    StepResult result;
    result.targets = targets;
    for (int64_t i = 0; i < values.numel(); ++i) result.loss_sum += values.ptr<double>()[i];
    for (const Routed& r : routed) {
      FeedForwardStats stats = MoeFfn::expert_loads(part(r.offsets).ptr<int32_t>(), r.experts);
      if (r.aux != 0) {
        Tensor aux({1}, DType::kF64);
        convert_host(aux, part(r.aux));
        stats.aux_loss = aux.ptr<double>()[0];
      }
      result.max_expert_load = std::max(result.max_expert_load, stats.max_expert_load);
      result.aux_loss += stats.aux_loss;
      result.expert_load_max.push_back(stats.max_expert_load);
      result.expert_load_min.push_back(stats.min_expert_load);
    }
    return result;
  });
}

StepResult Model::forward_backward(const Batch& batch, double grad_scale) {
  return forward_backward_async(batch, grad_scale).get();
}

PendingStep Model::forward_backward_async(const Batch& batch, double grad_scale) {
  std::string where = "the batch upload";
  try {
    return run_step(batch, grad_scale, where);
  } catch (const Error& error) {
    throw Error(error.code(), where + ": " + error.what());
  }
}

void Model::hold_parameters(bool hold) {
  for (DecoderLayer& layer : layers_) {
    for (SwigluExperts* network : swiglu_networks(layer.ffn.get())) network->hold_packed_lora(hold);
  }
}

PendingStep Model::run_step(const Batch& batch, double grad_scale, std::string& where) {
  BatchTensors bt = upload(batch);
  LayerContext ctx = context(bt);
  kernels::Backend& be = backend_;
  const int64_t n = bt.num_tokens;
  const int64_t d = spec_.config.hidden_size;
  const size_t num_layers = layers_.size();

  // Forward, keeping every layer's input (the activation checkpoints).
  // FSDP: each layer's weights are gathered just before use (with fsdp_prefetch layers ahead)
  // and freed after; the last layer's stay gathered for the backward that starts with it.
  std::vector<Tensor> inputs(num_layers + 1);
  where = "the embedding forward";
  inputs[0] = ctx.alloc({n, d});
  gather_outer_weights();
  be.embedding_forward_checked_ids(inputs[0], embed_, bt.input_ids);  // checked in upload()
  release_outer_weights();
  for (size_t i = 0; i < num_layers; ++i) {
    where = layer_pass(spec_, i, "forward");
    gather_layers(i, +1);
    inputs[i + 1] = ctx.alloc({n, d});
    layer_forward(ctx, i, inputs[i + 1], inputs[i], summaries_for(inputs, i));
    if (recomputes(i)) release_layer(i);
    if (options_.fsdp_reshard_after_forward && i + 1 < num_layers) release_layer_weights(i);
  }
  where = "the final norm and the loss";
  gather_outer_weights();
  Tensor final_hidden = ctx.alloc({n, d});
  final_rstd_ = ctx.alloc_accum({n});
  const TensorView final_in = final_norm_input(ctx, inputs);
  be.rmsnorm_forward(RmsNormArgs{final_hidden, final_rstd_, final_in, final_norm_, spec_.config.rms_norm_eps});

  Tensor dfinal = ctx.alloc({n, d});
  Tensor losses = loss_and_grad(ctx, dfinal, final_hidden, grad_scale);

  // Backward. With Block Attention Residuals each summary's gradient gathers a term from every
  // later mix, in the accumulation dtype; it joins the stream's gradient at its own layer.
  where = "the final norm's backward";
  Tensor dx = ctx.alloc({n, d});
  std::vector<Tensor> dsummaries;
  if (!attn_res()) {
    be.rmsnorm_backward(RmsNormBackwardArgs{dx, {}, dfinal, final_in, final_norm_, final_rstd_, false});
  } else {
    Tensor dmix = ctx.alloc({n, d});
    be.rmsnorm_backward(RmsNormBackwardArgs{dmix, {}, dfinal, final_in, final_norm_, final_rstd_, false});
    const std::vector<TensorView> summaries = summaries_for(inputs, num_layers - 1);
    std::vector<TensorView> dviews;
    for (size_t j = 0; j < summaries.size(); ++j) {
      dsummaries.push_back(ctx.alloc_accum({n, d}));
      be.fill(dsummaries.back(), 0.0);
      dviews.push_back(dsummaries.back());
    }
    be.fill(dx, 0.0);
    mix_backward(ctx, output_mix_, with(dviews, dx.view()), dmix, with(summaries, inputs[num_layers].view()),
                 final_mix_probs_, spec_.config.rms_norm_eps);
    final_mix_.reset();
    final_mix_probs_.reset();
  }
  release_outer_weights();
  for (size_t i = num_layers; i-- > 0;) {
    where = layer_pass(spec_, i, recomputes(i) ? "backward (and its recomputed forward)" : "backward");
    gather_layers(i, -1);
    const std::vector<TensorView> summaries = summaries_for(inputs, i);
    if (recomputes(i)) {
      Tensor recomputed = ctx.alloc({n, d});
      layer_forward(ctx, i, recomputed, inputs[i], summaries);
    }
    Tensor dprev = ctx.alloc({n, d});
    layer_backward(ctx, i, dprev, dx, inputs[i], summaries, std::vector<TensorView>(dsummaries.begin(), dsummaries.end()));
    if (starts_block(i)) {  // inputs[i] is the last summary: its gradient is complete
      be.axpby(dprev, dsummaries.back(), 1.0, 1.0);
      dsummaries.pop_back();
    }
    release_layer(i);
    release_layer_weights(i);
    inputs[i + 1].reset();
    dx = std::move(dprev);
  }
  ++forward_count_;

  // The loss and the statistics go to the host in one copy, after the whole micro-batch is queued
  // (a recomputed forward routes exactly as the first did, so its statistics are the same).
  where = "the loss and statistics read-back";
  return queue_results(ctx, losses, batch.num_targets());
}

Tensor Model::forward_without_backward(const LayerContext& ctx, std::string& where) {
  kernels::Backend& be = backend_;
  const int64_t n = ctx.batch.num_tokens;
  const int64_t d = spec_.config.hidden_size;
  const size_t num_layers = layers_.size();
  std::vector<Tensor> inputs(num_layers + 1);
  where = "the embedding forward";
  inputs[0] = ctx.alloc({n, d});
  gather_outer_weights();
  be.embedding_forward_checked_ids(inputs[0], embed_, ctx.batch.input_ids);  // checked in upload()
  release_outer_weights();
  for (size_t i = 0; i < num_layers; ++i) {
    where = layer_pass(spec_, i, "forward");
    gather_layers(i, +1);
    inputs[i + 1] = ctx.alloc({n, d});
    layer_forward(ctx, i, inputs[i + 1], inputs[i], summaries_for(inputs, i));
    release_layer(i);
    release_layer_weights(i);
    // Only the block summaries (Block Attention Residuals) are read again.
    if (!starts_block(i)) inputs[i].reset();
  }
  where = "the final norm";
  gather_outer_weights();
  Tensor normed = ctx.alloc({n, d});
  Tensor rstd = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{normed, rstd, final_norm_input(ctx, inputs), final_norm_, spec_.config.rms_norm_eps});
  final_mix_.reset();
  final_mix_probs_.reset();
  return normed;
}

Tensor Model::logits(const Batch& batch) {
  BatchTensors bt = upload(batch);
  LayerContext ctx = context(bt);
  kernels::Backend& be = backend_;
  std::string where;
  Tensor normed = forward_without_backward(ctx, where);
  const Tensor& head = spec_.config.tie_word_embeddings ? embed_ : lm_head_;
  Tensor logits = ctx.alloc_accum({bt.num_tokens, spec_.config.vocab_size});
  be.gemm(GemmArgs{logits, normed, head, false, true, 1.0, 0.0});
  release_outer_weights();
  Tensor staged(logits.shape(), logits.dtype());
  be.copy(staged, logits);
  Tensor host(logits.shape(), DType::kF64);
  convert_host(host, staged);
  ++forward_count_;
  return host;
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
  for (DecoderLayer& layer : layers_) {
    if (MoeFfn* moe = routed_moe(layer.ffn.get())) {
      moe->set_noise_enabled(false);
      noise_off.layers.push_back(moe);
    }
  }
  std::string where = "the batch upload";
  try {
    BatchTensors bt = upload(batch);
    LayerContext ctx = context(bt);
    kernels::Backend& be = backend_;
    Tensor normed = forward_without_backward(ctx, where);
    where = "the eval loss";
    const Tensor& head = spec_.config.tie_word_embeddings ? embed_ : lm_head_;
    const int64_t n = bt.num_tokens;
    const int64_t vocab = spec_.config.vocab_size;
    Tensor losses = ctx.alloc_accum({n});
    for (int64_t begin = 0; begin < n; begin += options_.loss_chunk_rows) {
      const int64_t end = std::min(n, begin + options_.loss_chunk_rows);
      Tensor logits = ctx.alloc_accum({end - begin, vocab});
      Tensor unused_dlogits = ctx.alloc({end - begin, vocab});  // the kernel writes one; scale 0
      be.gemm(GemmArgs{logits, normed.view().slice_rows(begin, end), head, false, true, 1.0, 0.0});
      be.cross_entropy(kernels::CrossEntropyArgs{losses.view().slice_rows(begin, end), unused_dlogits, logits,
                                                 bt.labels.view().slice_rows(begin, end), 0.0});
    }
    release_outer_weights();
    Tensor staged(losses.shape(), losses.dtype());
    be.copy(staged, losses);
    Tensor host(losses.shape(), DType::kF64);
    convert_host(host, staged);
    StepResult result;
    result.targets = batch.num_targets();
    // In token order, in double, as the training loss (queue_results).
    for (int64_t i = 0; i < host.numel(); ++i) result.loss_sum += host.ptr<double>()[i];
    return result;
  } catch (const Error& error) {
    throw Error(error.code(), "evaluation, " + where + ": " + error.what());
  }
}

}  // namespace moetrain
