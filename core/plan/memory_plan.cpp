// The numbers of `moetrain plan` (formulas explained in docs/PLAN.md).
#include "core/plan/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/data/context_shards.h"
#include "core/plan/model_flops.h"
#include "parallel/mesh.h"

namespace moetrain {
namespace {

constexpr double kBf16 = 2.0;
constexpr double kF32 = 4.0;
constexpr double kI32 = 4.0;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes per token a layer's forward saves for its backward, from what the model code keeps
// (Model::LayerSaved, MlaProjections::Saved, MlaAttention::Saved, DsaAttention::Saved,
// KdaAttention::Saved, MoeFfn::Saved, SwigluExperts); `a` is the activation dtype size,
// statistics (rstd, lse) are F32, indices I32. Split into the mixer half with the layer's own
// tensors, and the feed-forward's internals, which token chunks bound (Model::ffn_forward).
struct LayerSaved {
  double mixer = 0, ffn = 0;
};
// KDA's state [H, d, d] F32: what a layer in time segments keeps per segment.
double kda_state_bytes(const KdaConfig& kda) {
  return static_cast<double>(kda.num_heads * kda.head_dim * kda.head_dim) * kF32;
}

// A KDA layer's bytes per token: what its forward saves, and the backward's temporaries alive
// with them (KdaAttention::span_backward, at the convolutions' backward).
struct KdaBytes {
  double saved = 0, temporaries = 0;
};
KdaBytes kda_bytes_per_token(const KdaConfig& kda, double a) {
  const double kd = static_cast<double>(kda.head_dim);
  const double kh = static_cast<double>(kda.num_heads);
  const double c = kh * kd;
  KdaBytes bytes;
  // KdaAttention::Saved, c = H d: q/k/v before the conv (3c), after it (3c), q and k
  // normalised (2c), the forget gate's f (c) and f_a output (d), the KDA output (c), the output
  // gate (c, plus its g_a output d when low rank), o_proj's input (c); F32: the decay g (c),
  // beta (H), the q/k inverse norms and the output norm's rstd (3H).
  bytes.saved = (12 * c + kd + (kda.full_rank_output_gate ? 0 : kd)) * a + (c + 4 * kh) * kF32;
  // The gradients of o_proj's input, the KDA output and the gate, of q, k, v, f and the convs'
  // outputs of q and k (9c), f_a's output (d) and beta's logits (H); F32: dg (c) and dbeta (H);
  // then per convolution its padded output gradient and input gradient (2c, or 3 x 3c fused:
  // with the gathered dconv).
  bytes.temporaries = (9 * c + (kda.fused_qkv ? 9 * c : 2 * c) + kd + kh) * a + (c + kh) * kF32;
  return bytes;
}

// The MLA layers run on one rank in query blocks x key chunks (MlaAttention, MlaBlocks).
bool mla_blocked(const Config& config) {
  return config.parallel.cp == 1 && (config.parallel.attention_query_block > 0 || config.parallel.cp_key_chunk > 0);
}

// `segment_tokens`: the KDA layers' time segment (0: whole).
LayerSaved layer_saved_per_token(const ModelSpec& spec, size_t i, double a, double capacity, const Config& config,
                                 int64_t segment_tokens) {
  const ModelConfig& m = spec.config;
  const MlaConfig& mla = m.mla;
  const double d = static_cast<double>(m.hidden_size);
  const double h = static_cast<double>(mla.num_heads);
  const double qk = static_cast<double>(mla.qk_nope_head_dim + mla.qk_rope_head_dim);
  const double v = static_cast<double>(mla.v_head_dim);
  // Layer: normed_in, hidden, normed_mid [D] and two rstd; with Block Attention Residuals the
  // two mixed inputs [D] and their probabilities (one per summary and the running sum, F32).
  double bytes = 3 * d * a + 2 * kF32;
  if (m.attn_res_block_size > 0) {
    const double values = static_cast<double>(i / static_cast<size_t>(m.attn_res_block_size) + 2);
    bytes += 2 * d * a + 2 * values * kF32;
  }
  if (spec.mixers[i] == MixerKind::kKda) {
    // Whole, the layer keeps its internals; in time segments of S tokens, the state entering each.
    const KdaConfig& kda = m.kda;
    bytes += segment_tokens > 0 ? kda_state_bytes(kda) / static_cast<double>(segment_tokens)
                                : kda_bytes_per_token(kda, a).saved;
  } else {
    // The stages MLA and DSA share: the q LoRA path (q_a, the q latent, rstd), the kv latent
    // and its rstd, the attention output before the gate, the gate's pre-activation.
    const double q_rank = static_cast<double>(mla.q_lora_rank.value_or(0));
    const double kv_rank = static_cast<double>(mla.kv_lora_rank);
    const double rope = static_cast<double>(mla.qk_rope_head_dim);
    if (q_rank > 0) bytes += 2 * q_rank * a + kF32;
    bytes += kv_rank * a + kF32 + h * v * a;
    if (m.attention_gate != "none") bytes += (m.attention_gate == "headwise" ? h : h * v) * a;
    if (spec.mixers[i] == MixerKind::kMla) {
      bytes += kv_rank * a + h * qk * a + h * kF32;  // kv_normed, q, lse
      // k and v; under context parallelism the latent rows the queries see instead, up to cp
      // shards of [r + rope] (MlaAcrossRanks::Latent); in query blocks on one rank the rotated
      // k_pe [rope] (MlaBlocks: the keys are expanded again per chunk).
      const double cp = static_cast<double>(config.parallel.cp);
      bytes += config.parallel.cp > 1 ? cp * (kv_rank + rope) * a
               : mla_blocked(config) ? rope * a
                                     : h * (qk + v) * a;
    } else {
      // DSA: the selected keys (at most a window's tokens), the absorbed queries and the shared
      // latent rows [r + rope], the latent output [H r], lse; q itself only for kv_b_proj's adapter.
      const std::vector<std::string>& targets = config.lora.targets;
      const bool kv_b_lora = std::find(targets.begin(), targets.end(), "kv_b_proj") != targets.end();
      const double top_k = static_cast<double>(std::min(m.dsa.index_topk, config.data.seq_len));
      bytes += top_k * kI32 + (h + 1) * (kv_rank + rope) * a + h * kv_rank * a + h * kF32;
      if (kv_b_lora) bytes += h * qk * a;
    }
  }
  LayerSaved saved{bytes, 0.0};
  double& ffn = saved.ffn;
  if (spec.ffns[i] == FfnKind::kDense) {
    ffn += 3 * static_cast<double>(m.intermediate_size) * a;  // gate_up pre-activations, SwiGLU output
  } else {
    const MoeConfig& moe = m.moe;
    const double e = static_cast<double>(moe.num_experts);
    const double k = static_cast<double>(moe.top_k);
    const double f = static_cast<double>(moe.expert_intermediate_size);
    ffn += e * a + k * a + k * kI32 * 3;  // scores, topk weight, topk index, sorted_pair, pair_row
    if (moe.aux_loss_coef > 0) ffn += e * a;
    // Routed rows (received from the EP group): routed_x, routed_out, gate_up, SwiGLU output, at
    // the latent width L for a latent MoE, which also keeps its projection z, the weighted sum y
    // and its norm [L] (LatentMoeFfn::Saved).
    const double rows = moe.latent_size > 0 ? static_cast<double>(moe.latent_size) : d;
    ffn += capacity * k * (2 * rows + 3 * f) * a;
    if (moe.latent_size > 0) ffn += 3 * rows * a + kF32;
    ffn += 3 * f * static_cast<double>(moe.num_shared_experts) * a;
  }
  return saved;
}

void add(std::vector<PlanItem>& items, std::string name, double bytes, std::string formula) {
  items.push_back(PlanItem{std::move(name), bytes, std::move(formula)});
}

double sum(const std::vector<PlanItem>& items) {
  double total = 0;
  for (const PlanItem& item : items) total += item.bytes;
  return total;
}

// Bytes per token of the layers' saved sets alive at the peak when the first `layers` re-run their
// forward: the kept layers' sets together (alive when the backward starts, with the last layer)
// or the largest re-run one (the kept sets are freed before the first layers re-run), whichever
// is more. 0 layers: every set; all of them: the largest.
double saved_at_peak(const std::vector<double>& layer_saved, int64_t layers) {
  double kept = 0, rerun = 0;
  for (size_t i = 0; i < layer_saved.size(); ++i) {
    if (static_cast<int64_t>(i) < layers) {
      rerun = std::max(rerun, layer_saved[i]);
    } else {
      kept += layer_saved[i];
    }
  }
  return std::max(kept, rerun);
}

}  // namespace

double MemoryPlan::fixed_bytes() const { return sum(fixed); }
double MemoryPlan::per_token_bytes(bool with_recompute) const {
  return sum(with_recompute ? per_token_recompute : per_token_full);
}
double MemoryPlan::peak_bytes(bool with_recompute) const {
  return fixed_bytes() + per_token_bytes(with_recompute) * static_cast<double>(tokens_per_pass());
}
int64_t MemoryPlan::max_tokens(bool with_recompute) const {
  const double room = usable_bytes - fixed_bytes();
  if (room <= 0) return 0;
  return static_cast<int64_t>(std::floor(room / per_token_bytes(with_recompute)));
}
int64_t MemoryPlan::widest_expert_window(bool with_recompute) const {
  if (tokens_per_micro_batch <= 0) return 0;
  return std::min(micro_batches, max_tokens(with_recompute) / tokens_per_micro_batch);
}
double MemoryPlan::communication_bytes() const { return sum(communication); }

double MemoryPlan::peak_bytes_rerunning(int64_t layers) const {
  // per_token_full with every layer's saved set replaced by those alive at the peak.
  const double per_token = per_token_bytes(false) - saved_at_peak(layer_saved, 0) + saved_at_peak(layer_saved, layers);
  return fixed_bytes() + per_token * static_cast<double>(tokens_per_pass());
}

int64_t MemoryPlan::fewest_recompute_layers() const {
  for (int64_t layers = 0; layers <= num_layers; ++layers) {
    if (peak_bytes_rerunning(layers) <= usable_bytes) return layers;
  }
  return -1;
}

namespace {

// What every part of the plan reads: the config, the model it resolves to and the mesh.
struct PlanInputs {
  const Config& config;
  const PlanOptions& options;
  const ModelSpec& spec;
  const MeshLayout& mesh;
  double a;  // activation dtype size (options.activation_bytes)
};

// The DSA sizes the backward's scratch depends on: the keys a query selects (at most a window's
// tokens) and the latent row [r + rope].
struct DsaSizes {
  bool present = false;
  double top_k = 0, row = 0;
};

DsaSizes dsa_sizes(const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  DsaSizes dsa;
  dsa.present = std::count(in.spec.mixers.begin(), in.spec.mixers.end(), MixerKind::kDsa) > 0;
  dsa.top_k = static_cast<double>(std::min(m.dsa.index_topk, in.config.data.seq_len));
  dsa.row = static_cast<double>(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim);
  return dsa;
}

// This rank's share of a count over all routed experts: its local experts'.
double local_share(const MemoryPlan& plan, const ModelConfig& m, int64_t all_experts) {
  return static_cast<double>(all_experts) / static_cast<double>(std::max<int64_t>(1, m.moe.num_experts)) *
         static_cast<double>(plan.local_experts);
}

// Adam state per parameter of a group sharded over `ranks` (AdamW::init_groups): the two
// moments, 8 B, and where the group spans several ranks the reduced gradient and the
// all-gather's input, 8 B more.
double adam_bytes_per_param(double ranks) { return (ranks > 1 ? 4 : 2) * kF32; }

// The mesh, the batch and the parameter counts: what the parts below size from.
MemoryPlan plan_layout(const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const Config& config = in.config;
  MemoryPlan plan;
  plan.world = in.mesh.world();
  plan.fsdp = in.mesh.fsdp();
  plan.ep = in.mesh.ep();
  plan.replicate = in.mesh.replicate();
  plan.prefetch = static_cast<int>(config.parallel.prefetch);
  plan.recompute = config.parallel.recompute;
  plan.num_layers = m.num_layers;
  plan.recompute_layers = config.parallel.recompute && config.parallel.recompute_layers >= 0
                              ? std::min(config.parallel.recompute_layers, m.num_layers)
                              : m.num_layers;
  plan.cp = in.mesh.cp();
  plan.cp_balanced = plan.cp > 1 && context_layout_of(config.parallel.cp_layout) == ContextLayout::kBalanced;
  plan.tokens_per_micro_batch = config.data.micro_batch * config.data.seq_len / plan.cp;
  plan.micro_batches = config.data.grad_accum;
  plan.expert_window = std::max<int64_t>(1, std::min(config.train.expert_window, config.data.grad_accum));
  plan.local_experts = in.mesh.experts_per_rank();
  plan.params = count_model_parameters(in.spec);
  plan.lora = count_lora_parameters(in.spec, config.lora);
  plan.gpu_bytes = in.options.gpu_bytes;
  plan.usable_bytes = in.options.gpu_bytes * (1.0 - in.options.reserve_fraction);
  return plan;
}

// Bytes of a layer's non-expert weights: BF16, or with model.weight_format fp8 its FP8 part at one
// byte a weight and 4 B a 128 x 128 block (core/model/fsdp_bucket.h: the buckets hold both).
double layer_weight_bytes(const LayerParameterCount& l, bool fp8) {
  if (!fp8) return static_cast<double>(l.non_expert()) * kBf16;
  return static_cast<double>(l.non_expert() - l.fp8_non_expert) * kBf16 + static_cast<double>(l.fp8_non_expert) +
         static_cast<double>(l.fp8_non_expert_blocks) * kF32;
}

// Bytes of every non-expert frozen weight (the FSDP buckets' contents, unpadded).
double non_expert_weight_bytes(const MemoryPlan& plan, bool fp8) {
  const ModelParameterCount& p = plan.params;
  double bytes = static_cast<double>(p.embedding + p.lm_head + p.final_norm) * kBf16;
  for (const LayerParameterCount& l : p.layers) bytes += layer_weight_bytes(l, fp8);
  return bytes;
}

// The local routed experts: BF16, MXFP4 (half a byte a weight and one E8M0 byte per 32) or FP8
// (one byte a weight and 4 B a 128 x 128 block), all kept on the device as stored.
void add_routed_expert_weights(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const ModelParameterCount& p = plan.params;
  const int64_t experts = std::max<int64_t>(1, m.moe.num_experts);
  const double elements = static_cast<double>(plan.local_experts * plan.lora.num_moe_layers) *
                          static_cast<double>(p.routed_expert_per_layer() / experts);
  double blocks = 0;
  for (const LayerParameterCount& l : p.layers) {
    if (l.routed_experts > 0) {
      blocks = static_cast<double>(plan.local_experts * plan.lora.num_moe_layers) *
               static_cast<double>(l.fp8_routed_expert_blocks / experts);
      break;
    }
  }
  const double bf16 = elements * kBf16;
  if (m.moe.expert_format == "mxfp4") {
    add(plan.fixed, "routed experts (mxfp4)", elements * (0.5 + 1.0 / 32),
        fmt::format("{} local experts x {} MoE layers: {:.3g} weights x (0.5 + 1/32) B (BF16 would be {:.1f} GB)",
                    plan.local_experts, plan.lora.num_moe_layers, elements, bf16 / 1e9));
  } else if (m.weight_format == "fp8") {
    add(plan.fixed, "routed experts (fp8)", elements + blocks * kF32,
        fmt::format("{} local experts x {} MoE layers: {:.3g} weights x 1 B + {:.3g} blocks x 4 B (BF16 would be "
                    "{:.1f} GB)",
                    plan.local_experts, plan.lora.num_moe_layers, elements, blocks, bf16 / 1e9));
  } else {
    add(plan.fixed, "routed experts (bf16)", bf16,
        fmt::format("{} local experts x {} MoE layers: {:.3g} weights x 2 B (FP8 would be {:.1f} GB)",
                    plan.local_experts, plan.lora.num_moe_layers, elements, (elements + blocks * kF32) / 1e9));
  }
}

// The frozen base weights: this rank's FSDP shards, the layers gathered ahead of use, its experts.
void add_frozen_weights(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const ModelParameterCount& p = plan.params;
  const int64_t fsdp = plan.fsdp;
  const bool fp8 = m.weight_format == "fp8";
  const char* format = fp8 ? "fp8 + bf16" : "bf16";
  // FSDP buckets: one per layer (its non-expert weights), plus the embedding, the head and the
  // final norm; each padded to a multiple of fsdp.
  std::vector<double> buckets = {static_cast<double>(p.embedding) * kBf16,
                                 static_cast<double>(p.lm_head + p.final_norm) * kBf16};
  double largest_layer = 0, fp8_weights = 0, fp8_blocks = 0;
  for (const LayerParameterCount& l : p.layers) {
    buckets.push_back(layer_weight_bytes(l, fp8));
    largest_layer = std::max(largest_layer, buckets.back());
    fp8_weights += static_cast<double>(l.fp8_non_expert);
    fp8_blocks += static_cast<double>(l.fp8_non_expert_blocks);
  }
  double shard_bytes = 0, full_bytes = 0;
  for (double b : buckets) {
    shard_bytes += std::ceil(b / kBf16 / static_cast<double>(fsdp)) * kBf16;  // whole 2-byte units
    full_bytes += b;
  }
  const double non_expert = static_cast<double>(p.non_expert());
  add(plan.fixed, fmt::format("frozen weight shards ({})", format), shard_bytes,
      fp8 ? fmt::format("sum over {} buckets of ceil(bucket / fsdp {}): {:.3g} FP8 weights x 1 B + {:.3g} blocks x "
                        "4 B, the other {:.3g} x 2 B ({:.1f} GB in all; BF16 would be {:.1f} GB)",
                        buckets.size(), fsdp, fp8_weights, fp8_blocks, non_expert - fp8_weights, full_bytes / 1e9,
                        non_expert * kBf16 / 1e9)
          : fmt::format("sum over {} buckets of ceil(bucket / fsdp {}) x 2 B; non-expert weights {:.3g}", buckets.size(),
                        fsdp, non_expert));
  const double largest_edge = static_cast<double>(std::max(p.embedding, p.lm_head)) * kBf16;
  const double gathered = std::max((plan.prefetch + 1) * largest_layer, largest_edge);
  add(plan.fixed, fmt::format("gathered weights ({})", format), fsdp > 1 ? gathered : 0.0,
      fmt::format("max((prefetch {} + 1) x largest layer {:.3g} GB, embedding/head {:.3g} GB); 0 when fsdp = 1",
                  plan.prefetch, largest_layer / 1e9, largest_edge / 1e9));
  // The vision tower and projector (model.vision) are whole on every rank; a full-trained
  // projector's weights are counted with the adapters instead.
  const int64_t vision_frozen = p.vision_tower + (m.vision.projector_train == "full" ? 0 : p.projector);
  if (m.vision.enabled) {
    add(plan.fixed, "vision tower + projector (bf16, whole)", static_cast<double>(vision_frozen) * kBf16,
        fmt::format("{:.3g} frozen weights x 2 B", static_cast<double>(vision_frozen)));
  }
  add_routed_expert_weights(plan, in);
  // The CUDA GEMMs on FP8 weights decode each weight to BF16 in the backend's grow-only scratch
  // first (kernels/cuda/gemm/fp8_decode.h): the largest one stays allocated for the run.
  const MlaConfig& a = m.mla;
  const double d = static_cast<double>(m.hidden_size);
  const double f = static_cast<double>(m.moe.expert_intermediate_size);
  const double largest_decoded = std::max(
      {2.0 * static_cast<double>(m.intermediate_size) * d, static_cast<double>(plan.local_experts) * 2 * f * d,
       2.0 * f * static_cast<double>(m.moe.num_shared_experts) * d, d * static_cast<double>(a.num_heads * a.v_head_dim),
       static_cast<double>(a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) * a.q_lora_rank.value_or(0))});
  if (fp8) {
    add(plan.fixed, "FP8 decode scratch (bf16)", largest_decoded * kBf16,
        fmt::format("the largest FP8 weight (or a rank's experts' gate_up) decoded: {:.3g} x 2 B", largest_decoded));
  }
}

// Adapters (core/train/optimizer.h): FP32 value and gradient whole on every rank that uses them;
// the Adam state only for this rank's shard of its parameter group (non-expert adapters: all
// data-parallel ranks; the local experts' adapters: the ranks holding the same experts).
void add_adapters_and_optimizer(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const LoraParameterCount& lora = plan.lora;
  const double world = static_cast<double>(plan.world);
  const double replicas = static_cast<double>(in.mesh.expert_replicas());
  const double non_expert_lora = static_cast<double>(lora.non_expert());
  add(plan.fixed, "adapters + grads (fp32)", non_expert_lora * 2 * kF32,
      fmt::format("non-expert LoRA {:.3g} params x 8 B", non_expert_lora));
  add(plan.fixed, "adapter Adam state, sharded (fp32)", non_expert_lora / world * adam_bytes_per_param(world),
      fmt::format("non-expert LoRA / world {} x {:.0f} B", plan.world, adam_bytes_per_param(world)));
  const double expert_lora = local_share(plan, m, lora.routed_experts());
  add(plan.fixed, "expert adapters + grads (fp32)", expert_lora * 2 * kF32,
      fmt::format("{:.3g} params of the local experts x 8 B", expert_lora));
  add(plan.fixed, "expert-adapter Adam state, sharded (fp32)", expert_lora / replicas * adam_bytes_per_param(replicas),
      fmt::format("local experts' LoRA / {} expert replicas x {:.0f} B", in.mesh.expert_replicas(),
                  adam_bytes_per_param(replicas)));
  // The SwiGLU networks' adapters packed for their GEMMs and held over the optimizer step
  // (Model::hold_parameters), in the compute dtype.
  const double packed = static_cast<double>(lora.packed_replicated) + local_share(plan, m, lora.packed_routed_experts);
  add(plan.fixed, "packed MLP and expert adapters", packed * in.a,
      fmt::format("{:.3g} elements (gate and up B's twice: block-diagonal) x {} B, held over the step", packed,
                  in.options.activation_bytes));
}

// Scratch that stays for the run whatever the batch: the DSA backward's chunk, the loss chunk.
void add_workspace(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  // The CUDA DSA backward's scratch (kernels/cuda/dsa/sparse_attention.cu, the backend's grow-only
  // DeviceScratch, so it stays for the run): the dkv contributions of one chunk of queries, F32
  // [top_k, r + rope] per query, at most 2 GiB per chunk (kTensorCoreContribBudgetBytes). The
  // forward indexer's score chunk (dsa_indexer.cu: queries x keys x 4 B, at most 1 GiB) reuses it
  // and is no larger while keys < top_k x (r + rope), i.e. at any sequence length up to ~1M.
  const DsaSizes dsa = dsa_sizes(in);
  const double dsa_query_bytes = dsa.top_k * dsa.row * kF32;
  const double dsa_chunk = std::min(static_cast<double>(plan.tokens_per_pass()),
                                    std::floor(static_cast<double>(int64_t{2048} << 20) / std::max(1.0, dsa_query_bytes)));
  add(plan.fixed, "DSA backward contribution chunk (fp32)", dsa.present ? dsa_chunk * dsa_query_bytes : 0.0,
      fmt::format("min(tokens, 2 GiB / query) queries x top_k {:.0f} x (r + rope) {:.0f} x 4 B; 0 without DSA",
                  dsa.top_k, dsa.row));
  add(plan.fixed, "loss chunk (fp32 logits)",
      static_cast<double>(std::min(in.options.loss_chunk_rows, plan.tokens_per_pass()) * m.vocab_size) * kF32,
      fmt::format("min({}, tokens) x vocab {} x 4 B", in.options.loss_chunk_rows, m.vocab_size));
}

// Per token: activations and EP buffers, with and without recompute.
void add_activations(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const ModelSpec& spec = in.spec;
  const double a = in.a;
  // parallel.offload (LayerCheckpoints): at most four layer-input-sized tensors on the device at
  // the backward's peak (the layer's input, the prefetched one below, its output and gradient;
  // measured on the H200), plus the block summaries of Block Attention Residuals, which stay.
  const double layers_kept = static_cast<double>(m.num_layers) + 1;
  const double summaries_kept =
      m.attn_res_block_size > 0 ? static_cast<double>(ceil_div(m.num_layers, m.attn_res_block_size)) : 0.0;
  const bool offload = in.config.parallel.offload;
  const double checkpoint = (offload ? std::min(layers_kept, 4 + summaries_kept) : layers_kept) *
                            static_cast<double>(m.hidden_size) * a;
  // With feed-forward token chunks a layer keeps its mixer's half per token, and one chunk's
  // feed-forward internals and their backward's temporaries exist at a time (fixed bytes).
  const bool chunked = plan.ffn_chunk_tokens > 0;
  double ffn_max = 0;
  for (size_t i = 0; i < spec.mixers.size(); ++i) {
    const LayerSaved saved =
        layer_saved_per_token(spec, i, a, in.options.capacity_factor, in.config, plan.mixer_segment_tokens);
    plan.layer_saved.push_back(saved.mixer + (chunked ? 0.0 : saved.ffn));
    ffn_max = std::max(ffn_max, saved.ffn);
  }
  plan.ffn_saved_max_per_token = ffn_max;
  add(plan.fixed, "feed-forward chunk (saved + backward temporaries)",
      chunked ? 2 * static_cast<double>(plan.ffn_chunk_tokens) * ffn_max : 0.0,
      chunked ? fmt::format("2 x {} tokens (parallel.ffn_chunk_tokens{}) x {:.1f} KB (the largest feed-forward's "
                            "per token)", plan.ffn_chunk_tokens, plan.ffn_chunk_auto ? ", the plan's choice" : "",
                            ffn_max / 1e3)
              : std::string("0: the feed-forwards run the whole micro-batch at once"));
  const double saved_max = saved_at_peak(plan.layer_saved, plan.num_layers);
  // KDA's chunked kernels hold the state entering every 64-token chunk (F32 d x d per head) while
  // one layer's forward or backward runs; the layer does not keep them (the backward recomputes).
  // In time segments of S tokens they, the segment's internals and its backward's temporaries
  // exist for one segment of one layer at a time.
  const bool has_kda = std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kKda) > 0;
  const bool segmented = has_kda && plan.mixer_segment_tokens > 0;
  const double kda_chunk_state = has_kda ? kda_state_bytes(m.kda) / 64.0 : 0.0;
  const KdaBytes kda = kda_bytes_per_token(m.kda, a);
  const double kda_chunk_states = segmented ? 0.0 : kda_chunk_state;
  add(plan.fixed, "KDA time segment (internals, backward temporaries, chunk states)",
      segmented ? static_cast<double>(plan.mixer_segment_tokens) * (kda.saved + kda.temporaries + kda_chunk_state) : 0.0,
      segmented ? fmt::format("{} tokens (parallel.mixer_segment_tokens{}) x ({:.1f} + {:.1f} + {:.1f}) KB per token",
                              plan.mixer_segment_tokens, plan.mixer_segment_auto ? ", the plan's choice" : "",
                              kda.saved / 1e3, kda.temporaries / 1e3, kda_chunk_state / 1e3)
                : std::string("0: the KDA layers run the whole micro-batch at once"));
  // MLA in query blocks of B rows x key chunks of c rows on one rank (MlaBlocks), for the layer
  // being run: one chunk's keys and values, their gradients and kv_b_proj's output gradient
  // (3 c H (qk + v)), its latent gradient c (r + rope), and the block's share of out and lse
  // (forward) or dq (backward).
  const int64_t mla_layers = std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kMla);
  const double tokens = static_cast<double>(plan.tokens_per_micro_batch);
  const double query_block = in.config.parallel.attention_query_block > 0
                                 ? std::min(static_cast<double>(in.config.parallel.attention_query_block), tokens)
                                 : tokens;
  const double query_chunk = in.config.parallel.cp_key_chunk > 0
                                 ? std::min(static_cast<double>(in.config.parallel.cp_key_chunk), tokens)
                                 : query_block;
  const double mla_h = static_cast<double>(m.mla.num_heads);
  const double mla_qk = static_cast<double>(m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim);
  const double mla_v = static_cast<double>(m.mla.v_head_dim);
  const double mla_latent = static_cast<double>(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim);
  const bool blocked = mla_layers > 0 && mla_blocked(in.config);
  add(plan.fixed, "MLA query block and key chunk (one rank)",
      blocked ? 3 * query_chunk * mla_h * (mla_qk + mla_v) * a + query_chunk * mla_latent * a +
                    query_block * mla_h * std::max(mla_qk * a, mla_v * a + kF32)
              : 0.0,
      blocked ? fmt::format("3 x {:.0f} key rows x H (qk + v) x a + {:.0f} x (r + rope) x a + {:.0f} query rows x "
                            "H max(qk a, v a + 4 B)",
                            query_chunk, query_chunk, query_block)
              : std::string("0: the MLA layers attend the whole sequence at once (or cp > 1)"));
  // The DSA backward inverts the selection (which queries chose each key) by a radix sort of
  // the (key, query) pairs and sums dkv in F32 [r + rope]: scratch for the one layer being run.
  const DsaSizes dsa = dsa_sizes(in);
  const double dsa_scratch_per_token = dsa.present ? 6 * dsa.top_k * kI32 + kI32 + dsa.row * kF32 : 0.0;
  const double final_part = 2 * static_cast<double>(m.hidden_size) * a + kF32;  // final_hidden, dfinal, rstd
  // Block Attention Residuals: the final norm's mixed input [D], and through the backward the
  // summaries' gradients, F32 [D] each (the summaries themselves are layer inputs, counted above).
  const int64_t block = m.attn_res_block_size;
  const double summaries = block > 0 ? static_cast<double>((m.num_layers + block - 1) / block) : 0.0;
  const double attn_res_part = block > 0 ? static_cast<double>(m.hidden_size) * (a + summaries * kF32) : 0.0;
  const double k = static_cast<double>(m.moe.top_k);
  const double d = static_cast<double>(m.hidden_size);
  const double ep_buffers =
      plan.lora.num_moe_layers > 0 && plan.ep > 1 ? k * d * a * (1 + in.options.capacity_factor) : 0.0;
  plan.ep_receive_worst_case_per_token =
      plan.ep > 1 ? static_cast<double>(plan.ep) * std::min<double>(k, static_cast<double>(plan.local_experts)) * d * a
                  : 0.0;
  // Context parallelism (MlaAcrossRanks), for the MLA layer being run: the all-gather's buffer of
  // every shard's latent rows [r + rope] (padded to the longest shard) and, in the backward, the
  // visible rows' gradient, up to cp x this rank's tokens each; and one key chunk expanded at a
  // time: its keys, values, their gradients and kv_b_proj's output gradient (3 x chunk rows x
  // H (qk + v)), with the chunk's share of out (forward) or dq (backward) for this rank's tokens.
  // The chunk is parallel.cp_key_chunk rows, or the shard's tokens.
  const bool has_mla = std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kMla) > 0;
  const double mla_head_row = static_cast<double>(m.mla.num_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim +
                                                                      m.mla.v_head_dim));
  const double mla_latent_row = static_cast<double>(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim);
  const double cp = static_cast<double>(plan.cp), shard = static_cast<double>(plan.tokens_per_micro_batch);
  const int64_t chunk_setting = in.config.parallel.cp_key_chunk;
  const double key_chunk = chunk_setting > 0 ? std::min(static_cast<double>(chunk_setting), cp * shard) : shard;
  const double cp_keys = plan.cp > 1 && has_mla && shard > 0
                             ? 2 * cp * mla_latent_row * a + (3 * key_chunk / shard + 1) * mla_head_row * a
                             : 0.0;
  for (bool recompute : {true, false}) {
    std::vector<PlanItem>& items = recompute ? plan.per_token_recompute : plan.per_token_full;
    add(items, "layer inputs (checkpoints)", checkpoint,
        offload ? "min(layers + 1, 4 + block summaries) x D x a (parallel.offload: the rest in pinned host memory)"
                : "(layers + 1) x D x a");
    if (recompute && plan.recompute_layers == plan.num_layers) {
      add(items, "one layer's saved tensors (re-run)", saved_max, "max over layers of the saved set");
    } else if (recompute) {
      add(items, fmt::format("saved tensors (first {} of {} layers re-run)", plan.recompute_layers, plan.num_layers),
          saved_at_peak(plan.layer_saved, plan.recompute_layers),
          "max(sum of the kept layers' saved sets, the largest re-run one)");
    } else {
      add(items, "every layer's saved tensors", saved_at_peak(plan.layer_saved, 0), "sum over layers of the saved set");
    }
    add(items, "backward temporaries of one layer", saved_max, "~ the largest layer's saved set");
    add(items, "KDA chunk states (inside the op)", kda_chunk_states, "H d^2 x 4 B / 64 (one state per chunk)");
    add(items, "DSA backward scratch (inverse index, dkv sum)", dsa_scratch_per_token,
        "6 x top_k x 4 B (key ids and positions, sorted copies, the sort's buffer) + 4 B (offsets) + (r + rope) x 4 B");
    add(items, "final norm, its gradient", final_part, "2 x D x a + 4 B");
    add(items, "attention-residual summary gradients", attn_res_part,
        fmt::format("D x (a + {:.0f} summaries x 4 B)", summaries));
    add(items, "EP dispatch buffers", ep_buffers, "top_k x D x a x (send 1 + receive capacity)");
    add(items, "context-parallel latent and key chunk (MLA)", cp_keys,
        fmt::format("2 (gathered, their gradient) x cp x (r + rope) x a + (3 x {:.0f} chunk rows / T + 1) x "
                    "H (qk + v) x a; 0 at cp 1", key_chunk));
  }
}

// Communication per rank per optimizer step (bytes sent; ring collectives send (n-1)/n).
void add_communication(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const LoraParameterCount& lora = plan.lora;
  const int64_t fsdp = plan.fsdp;
  const double a = in.a;
  const double world = static_cast<double>(plan.world);
  const double replicas = static_cast<double>(in.mesh.expert_replicas());
  const double non_expert_lora = static_cast<double>(lora.non_expert());
  const double expert_lora = local_share(plan, m, lora.routed_experts());
  const double k = static_cast<double>(m.moe.top_k);
  const double d = static_cast<double>(m.hidden_size);
  int64_t rerun_moe_layers = 0;  // of the first recompute_layers
  for (size_t i = 0; i < in.spec.mixers.size(); ++i) {
    if (static_cast<int64_t>(i) < plan.recompute_layers && in.spec.ffns[i] == FfnKind::kMoe) ++rerun_moe_layers;
  }
  const double fsdp_frac = static_cast<double>(fsdp - 1) / static_cast<double>(fsdp);
  const double micro = static_cast<double>(plan.micro_batches);
  const bool fp8 = m.weight_format == "fp8";
  add(plan.communication, "FSDP all-gather of frozen weights",
      static_cast<double>(plan.passes_per_step()) * 2 * non_expert_weight_bytes(plan, fp8) * fsdp_frac,
      fp8 ? "passes (grad_accum / train.expert_window, rounded up) x (forward + backward re-gather) x non-expert bytes "
            "(FP8 1 B + 4 B a block, the rest 2 B) x (fsdp-1)/fsdp"
          : "passes (grad_accum / train.expert_window, rounded up) x (forward + backward re-gather) x non-expert x 2 B x "
            "(fsdp-1)/fsdp");
  const double world_frac = (world - 1) / world;
  add(plan.communication, "reduce-scatter of LoRA grads", non_expert_lora * kF32 * world_frac,
      "non-expert LoRA x 4 B x (world-1)/world, once per step");
  add(plan.communication, "all-gather of updated LoRA", non_expert_lora * kF32 * world_frac,
      "non-expert LoRA x 4 B x (world-1)/world, once per step");
  add(plan.communication, "expert-adapter reduce-scatter + gather",
      2 * (replicas - 1) / replicas * expert_lora * kF32, "2 (r-1)/r x local expert LoRA x 4 B, r = world / ep");
  // 4 passes per MoE layer (dispatch and combine, forward and backward), 2 more where it re-runs.
  const double passes =
      4.0 * static_cast<double>(lora.num_moe_layers) + (plan.recompute ? 2.0 * rerun_moe_layers : 0.0);
  const double ep_frac = static_cast<double>(plan.ep - 1) / static_cast<double>(plan.ep);
  add(plan.communication, "EP all-to-all (dispatch + combine)",
      micro * passes * static_cast<double>(plan.tokens_per_micro_batch) * k * d * a * ep_frac,
      fmt::format("grad_accum x {:.0f} passes (4 per MoE layer, 6 where it re-runs) x tokens x top_k x D x a x (ep-1)/ep",
                  passes));
}

// Context parallelism per rank per optimizer step: every exchange is an all-gather of one piece
// per rank (padded to the longest shard) or the reduce-scatter of such pieces, so a rank sends
// (cp - 1) pieces. The layout changes only KDA's pieces: the balanced one gives a rank two spans a
// window, each with its (M, state) pair and its halo rows. Per layer and micro-batch, a forward
// that re-runs in the backward counts twice:
//   MLA  forward: the latent [r + rope] (each rank expands it); backward: its gradient (the
//        forward's gathered rows are kept)                                      -> 2 (+1 re-run)
//   DSA  forward: the latent and the indexer keys; backward: the latent, its gradient
//   KDA  forward: (M, S_local) in F32 and the short convolution's last width - 1 rows; backward:
//        (M, D_local), the rows again and the halo's gradient
void add_context_parallel_communication(MemoryPlan& plan, const PlanInputs& in) {
  if (plan.cp <= 1) return;
  const ModelConfig& m = in.spec.config;
  const double a = in.a, shards = static_cast<double>(plan.cp - 1), micro = static_cast<double>(plan.micro_batches);
  const double rows = static_cast<double>(plan.tokens_per_micro_batch);
  const double spans = plan.cp_balanced ? 2.0 * static_cast<double>(in.config.data.micro_batch) : 1.0;
  double mla = 0, dsa = 0, kda_states = 0, kda_halo = 0;
  for (size_t i = 0; i < in.spec.mixers.size(); ++i) {
    const double rerun = plan.recompute && static_cast<int64_t>(i) < plan.recompute_layers ? 1.0 : 0.0;
    switch (in.spec.mixers[i]) {
      case MixerKind::kMla:
        mla += (2 + rerun) * rows * static_cast<double>(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * a;
        break;
      case MixerKind::kDsa: {
        const double latent = static_cast<double>(m.mla.kv_lora_rank + m.mla.qk_rope_head_dim);
        dsa += ((1 + rerun) * (latent + static_cast<double>(m.dsa.index_head_dim)) + 2 * latent) * rows * a;
        break;
      }
      case MixerKind::kKda: {
        const double h = static_cast<double>(m.kda.num_heads), d = static_cast<double>(m.kda.head_dim);
        kda_states += spans * (2 + rerun) * h * d * (d + d) * kF32;
        kda_halo += spans * (3 + rerun) * static_cast<double>(m.kda.conv_width - 1) * 3 * h * d * a;
        break;
      }
    }
  }
  add(plan.communication, "CP MLA latent", micro * shards * mla,
      "grad_accum x (cp-1) x per MLA layer (2 + 1 if re-run) x T x (kv_r + d_r) x a");
  add(plan.communication, "CP DSA latent and indexer keys", micro * shards * dsa,
      "grad_accum x (cp-1) x per DSA layer ((1 + re-run) (kv_r + d_r + index_head_dim) + 2 (kv_r + d_r)) x T x a");
  const std::string per_span = plan.cp_balanced ? " x 2 x micro_batch spans a rank (balanced)" : "";
  add(plan.communication, "CP KDA state transitions", micro * shards * kda_states,
      "grad_accum x (cp-1) x per KDA layer (2 + 1 if re-run) x H d (d + d) x 4 B (M and a state)" + per_span);
  add(plan.communication, "CP KDA convolution halo", micro * shards * kda_halo,
      "grad_accum x (cp-1) x per KDA layer (3 + 1 if re-run) x (conv_width - 1) x 3 H d x a" + per_span);
}

// The busiest context-parallel rank's model FLOPs over the mean's, every window of the
// micro-batch one document, cut as the layout cuts it (ModelFlops::shard); 0 where the balanced
// layout cannot cut the window.
double busiest_shard_over_mean(const PlanInputs& in, int cp, ContextLayout layout) {
  if (cp <= 1) return 1.0;
  const int64_t window = in.config.data.seq_len, tokens = in.config.data.micro_batch * window;
  if (tokens <= 0) return 1.0;
  if (layout == ContextLayout::kBalanced && window % (2 * cp) != 0) return 0.0;
  std::vector<int32_t> cu;
  for (int64_t w = 0; w <= tokens; w += window) cu.push_back(static_cast<int32_t>(w));
  const ContextShards shards =
      layout == ContextLayout::kBalanced ? ContextShards::balanced(cu, cp, window) : ContextShards::even(cu, cp);
  const ModelFlops flops(in.spec, in.config.lora);
  const double mean = flops.step(tokens, cu).total() / cp;
  double busiest = 0;
  for (int r = 0; r < cp; ++r) busiest = std::max(busiest, flops.shard(shards, r).total());
  return mean > 0 ? busiest / mean : 1.0;
}

MemoryPlan plan_with_chunks(const PlanInputs& inputs, int64_t ffn_chunk_tokens, bool chosen, int64_t segment_tokens,
                            bool segment_chosen) {
  MemoryPlan plan = plan_layout(inputs);
  plan.ffn_chunk_tokens = ffn_chunk_tokens < plan.tokens_per_pass() ? ffn_chunk_tokens : 0;
  plan.ffn_chunk_auto = chosen && plan.ffn_chunk_tokens > 0;
  const bool has_kda = std::count(inputs.spec.mixers.begin(), inputs.spec.mixers.end(), MixerKind::kKda) > 0;
  plan.mixer_segment_tokens = has_kda && segment_tokens < plan.tokens_per_micro_batch ? segment_tokens : 0;
  plan.mixer_segment_auto = segment_chosen && plan.mixer_segment_tokens > 0;
  add_frozen_weights(plan, inputs);
  add_adapters_and_optimizer(plan, inputs);
  add_workspace(plan, inputs);
  add_activations(plan, inputs);
  add_communication(plan, inputs);
  add_context_parallel_communication(plan, inputs);
  plan.cp_busiest_contiguous = busiest_shard_over_mean(inputs, plan.cp, ContextLayout::kContiguous);
  plan.cp_busiest_balanced = busiest_shard_over_mean(inputs, plan.cp, ContextLayout::kBalanced);
  plan.cp_busiest_over_mean = plan.cp_balanced ? plan.cp_busiest_balanced : plan.cp_busiest_contiguous;
  return plan;
}

// The smallest chunk worth running: ~128 rows per local expert for the grouped GEMM, counting the
// rows every EP rank's chunk sends it.
int64_t smallest_ffn_chunk(const ModelConfig& m, int64_t ep) {
  if (m.moe.num_experts == 0 || m.moe.top_k == 0) return 1024;
  return std::max<int64_t>(1024, ceil_div(128 * m.moe.num_experts, m.moe.top_k * ep));
}

// The feed-forward chunk for a given KDA segment: the config's, or with the key at 0 the whole
// micro-batch when it fits, else the largest chunk that fits (at least the smallest worth
// running). The aux loss needs the whole micro-batch.
MemoryPlan choose_ffn_chunk(const PlanInputs& inputs, int64_t segment_tokens, bool segment_chosen) {
  const Config& config = inputs.config;
  if (config.parallel.ffn_chunk_tokens > 0) {
    return plan_with_chunks(inputs, config.parallel.ffn_chunk_tokens, false, segment_tokens, segment_chosen);
  }
  MemoryPlan whole = plan_with_chunks(inputs, 0, true, segment_tokens, segment_chosen);
  if (whole.fits() || inputs.spec.config.moe.aux_loss_coef > 0.0) return whole;
  const int64_t smallest = smallest_ffn_chunk(inputs.spec.config, whole.ep);
  MemoryPlan plan = plan_with_chunks(inputs, smallest, true, segment_tokens, segment_chosen);
  const double per_chunk_token = 2 * plan.ffn_saved_max_per_token;
  if (plan.ffn_chunk_tokens == 0 || !(per_chunk_token > 0)) return plan;
  const double room = plan.usable_bytes - plan.peak_bytes(plan.recompute) + per_chunk_token * static_cast<double>(smallest);
  // Multiples of 1024 tokens, so that the choice does not move with every byte of the inputs.
  const int64_t fitting = static_cast<int64_t>(std::floor(room / per_chunk_token)) / 1024 * 1024;
  return fitting > smallest ? plan_with_chunks(inputs, fitting, true, segment_tokens, segment_chosen) : plan;
}

// The KDA segments the plan tries when the whole-sequence mixer does not fit, longest first: past
// 16K tokens a segment's kernels are as efficient as the whole sequence's, below 1K the per-segment
// launches start to count.
constexpr int64_t kSegmentChoices[] = {16384, 8192, 4096, 2048, 1024};

// KDA layers that time segments can run: on one rank of the sequence (a context-parallel shard's
// KDA takes its state from the other ranks).
bool can_segment(const PlanInputs& inputs) {
  return inputs.config.parallel.cp == 1 &&
         std::count(inputs.spec.mixers.begin(), inputs.spec.mixers.end(), MixerKind::kKda) > 0;
}

// The segment and chunk choice for the inputs (see make_memory_plan).
MemoryPlan choose_plan(const PlanInputs& inputs) {
  const int64_t configured = inputs.config.parallel.mixer_segment_tokens;
  if (configured > 0) return choose_ffn_chunk(inputs, configured, false);
  MemoryPlan plan = choose_ffn_chunk(inputs, 0, false);
  if (plan.fits() || !can_segment(inputs)) return plan;
  for (int64_t segment : kSegmentChoices) {
    plan = choose_ffn_chunk(inputs, segment, true);
    if (plan.fits()) break;
  }
  return plan;
}

// The longest micro-batch that fits with every saving the plan can choose on (the chosen feed-forward
// chunk and KDA segment, else the smallest chunk and the shortest segment the plan tries), with
// parallel.offload as given.
int64_t longest_fitting(const PlanInputs& in, const MemoryPlan& chosen, bool offload) {
  Config config = in.config;
  config.parallel.offload = offload;
  if (config.parallel.ffn_chunk_tokens == 0 && in.spec.config.moe.aux_loss_coef == 0.0) {
    config.parallel.ffn_chunk_tokens =
        chosen.ffn_chunk_tokens > 0 ? chosen.ffn_chunk_tokens : smallest_ffn_chunk(in.spec.config, chosen.ep);
  }
  if (config.parallel.mixer_segment_tokens == 0 && can_segment(in)) {
    config.parallel.mixer_segment_tokens =
        chosen.mixer_segment_tokens > 0 ? chosen.mixer_segment_tokens : std::end(kSegmentChoices)[-1];
  }
  // Planned at a length past the chunk and segment, so that neither is dropped as the whole.
  config.data.seq_len = std::max<int64_t>(config.data.seq_len, 2 * std::max(config.parallel.ffn_chunk_tokens,
                                                                            config.parallel.mixer_segment_tokens));
  const PlanInputs inputs{config, in.options, in.spec, in.mesh, in.a};
  return plan_with_chunks(inputs, config.parallel.ffn_chunk_tokens, false, config.parallel.mixer_segment_tokens, false)
      .max_tokens(chosen.recompute);
}

}  // namespace

MemoryPlan make_memory_plan(const Config& config, const PlanOptions& options) {
  if (config.train.expert_window == 0) {
    Config trial = config;
    for (int64_t window = config.parallel.cp > 1 ? 1 : config.data.grad_accum; window >= 1; --window) {
      trial.train.expert_window = window;
      MemoryPlan plan = make_memory_plan(trial, options);
      plan.expert_window_auto = true;
      if (window == 1 || (plan.fits() && !plan.ffn_chunk_auto)) return plan;
    }
  }
  // With model.hf_dir the shape comes from config.json (merged as the trainer merges it).
  const ModelSpec spec = plan_model_spec(config.model.hf_dir ? resolve_model_spec(config).config : config.model);
  const MeshLayout mesh(options.world, MeshShape{config.parallel.fsdp, config.parallel.ep, config.parallel.cp}, spec.config.moe.num_experts,
                        config.source_path.empty() ? "config" : config.source_path);
  const PlanInputs inputs{config, options, spec, mesh, static_cast<double>(options.activation_bytes)};
  MemoryPlan plan = choose_plan(inputs);
  plan.longest_without_offload = longest_fitting(inputs, plan, false);
  plan.longest_with_offload = longest_fitting(inputs, plan, true);
  return plan;
}

}  // namespace moetrain
