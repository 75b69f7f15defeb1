// The numbers of `moetrain plan` (formulas explained in docs/PLAN.md).
#include "core/plan/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

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
LayerSaved layer_saved_per_token(const ModelSpec& spec, size_t i, double a, double capacity, const Config& config) {
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
    // KdaAttention::Saved, c = H d: q/k/v before the conv (3c), after it (3c), q and k
    // normalised (2c), the forget gate's f (c) and f_a output (d), the KDA output (c), the output
    // gate (c, plus its g_a output d when low rank), o_proj's input (c); F32: the decay g (c),
    // beta (H), the q/k inverse norms and the output norm's rstd (3H).
    const KdaConfig& kda = m.kda;
    const double kd = static_cast<double>(kda.head_dim);
    const double kh = static_cast<double>(kda.num_heads);
    const double c = kh * kd;
    bytes += (12 * c + kd + (kda.full_rank_output_gate ? 0 : kd)) * a + (c + 4 * kh) * kF32;
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
      bytes += kv_rank * a + 2 * h * qk * a + h * v * a + h * kF32;  // kv_normed, q, k, v, lse
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

// The frozen base weights: this rank's FSDP shards, the layers gathered ahead of use, its experts.
void add_frozen_weights(MemoryPlan& plan, const PlanInputs& in) {
  const ModelConfig& m = in.spec.config;
  const ModelParameterCount& p = plan.params;
  const int64_t fsdp = plan.fsdp;
  const int64_t moe_layers = plan.lora.num_moe_layers;
  // FSDP buckets: one per layer (its non-expert weights), plus the embedding, the head and the
  // final norm; each padded to a multiple of fsdp.
  std::vector<int64_t> buckets = {p.embedding, p.lm_head + p.final_norm};
  int64_t largest_layer = 0;
  for (const LayerParameterCount& l : p.layers) {
    buckets.push_back(l.non_expert());
    largest_layer = std::max(largest_layer, l.non_expert());
  }
  int64_t shard_elements = 0;
  for (int64_t b : buckets) shard_elements += ceil_div(b, fsdp);
  add(plan.fixed, "frozen weight shards (bf16)", shard_elements * kBf16,
      fmt::format("sum over {} buckets of ceil(bucket / fsdp {}) x 2 B; non-expert weights {:.3g}", buckets.size(),
                  fsdp, static_cast<double>(p.non_expert())));
  const int64_t largest_edge = std::max(p.embedding, p.lm_head);
  const int64_t gathered = std::max((plan.prefetch + 1) * largest_layer, largest_edge);
  add(plan.fixed, "gathered weights (bf16)", fsdp > 1 ? gathered * kBf16 : 0.0,
      fmt::format("max((prefetch {} + 1) x largest layer {:.3g}, embedding/head {:.3g}) x 2 B; 0 when fsdp = 1",
                  plan.prefetch, static_cast<double>(largest_layer), static_cast<double>(largest_edge)));
  const int64_t expert_elements = p.routed_expert_per_layer() / std::max<int64_t>(1, m.moe.num_experts);
  // MXFP4 experts stay packed on the device: half a byte per weight and one E8M0 byte per 32.
  const bool mxfp4 = m.moe.expert_format == "mxfp4";
  const double expert_bytes_per = mxfp4 ? 0.5 + 1.0 / 32 : kBf16;
  const double expert_bytes = static_cast<double>(plan.local_experts * moe_layers * expert_elements) * expert_bytes_per;
  add(plan.fixed, mxfp4 ? "routed experts (mxfp4)" : "routed experts (bf16)", expert_bytes,
      mxfp4 ? fmt::format("{} local experts x {} MoE layers x 3 D F = {:.3g} x (0.5 + 1/32) B (BF16 would be {:.1f} GB)",
                          plan.local_experts, moe_layers, static_cast<double>(expert_elements),
                          expert_bytes / expert_bytes_per * kBf16 / 1e9)
            : fmt::format("{} local experts x {} MoE layers x 3 D F = {:.3g} x 2 B (MXFP4 would be {:.1f} GB)",
                          plan.local_experts, moe_layers, static_cast<double>(expert_elements),
                          expert_bytes / kBf16 * (0.5 + 1.0 / 32) / 1e9));
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
    const LayerSaved saved = layer_saved_per_token(spec, i, a, in.options.capacity_factor, in.config);
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
  const double kda_chunk_states =
      std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kKda) > 0
          ? static_cast<double>(m.kda.num_heads * m.kda.head_dim * m.kda.head_dim) * kF32 / 64.0
          : 0.0;
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
  // Context parallelism: an MLA layer's forward and backward gather every shard's keys and values
  // (padded to the longest shard), copy out the visible ones and, in the backward, their
  // gradients: up to cp x this rank's tokens x H (qk + v) each, for the layer being run.
  const bool has_mla = std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kMla) > 0;
  const double mla_head_row = static_cast<double>(m.mla.num_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim +
                                                                      m.mla.v_head_dim));
  const double cp_keys = plan.cp > 1 && has_mla ? 3.0 * static_cast<double>(plan.cp) * mla_head_row * a : 0.0;
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
    add(items, "context-parallel keys and values (MLA)", cp_keys,
        "3 (gathered, visible, their gradient) x cp x H (qk + v) x a; 0 at cp 1");
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
  add(plan.communication, "FSDP all-gather of frozen weights",
      static_cast<double>(plan.passes_per_step()) * 2 * static_cast<double>(plan.params.non_expert()) * kBf16 * fsdp_frac,
      "passes (grad_accum / train.expert_window, rounded up) x (forward + backward re-gather) x non-expert x 2 B x "
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

MemoryPlan plan_with_chunks(const PlanInputs& inputs, int64_t ffn_chunk_tokens, bool chosen) {
  MemoryPlan plan = plan_layout(inputs);
  plan.ffn_chunk_tokens = ffn_chunk_tokens < plan.tokens_per_pass() ? ffn_chunk_tokens : 0;
  plan.ffn_chunk_auto = chosen && plan.ffn_chunk_tokens > 0;
  add_frozen_weights(plan, inputs);
  add_adapters_and_optimizer(plan, inputs);
  add_workspace(plan, inputs);
  add_activations(plan, inputs);
  add_communication(plan, inputs);
  return plan;
}

// The smallest chunk worth running: ~128 rows per local expert for the grouped GEMM, counting the
// rows every EP rank's chunk sends it.
int64_t smallest_ffn_chunk(const ModelConfig& m, int64_t ep) {
  if (m.moe.num_experts == 0 || m.moe.top_k == 0) return 1024;
  return std::max<int64_t>(1024, ceil_div(128 * m.moe.num_experts, m.moe.top_k * ep));
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
  if (config.parallel.ffn_chunk_tokens > 0) return plan_with_chunks(inputs, config.parallel.ffn_chunk_tokens, false);
  // parallel.ffn_chunk_tokens 0: the whole micro-batch when it fits, else the largest chunk that
  // fits (at least the smallest worth running). The aux loss needs the whole micro-batch.
  MemoryPlan whole = plan_with_chunks(inputs, 0, true);
  if (whole.fits() || spec.config.moe.aux_loss_coef > 0.0) return whole;
  const int64_t smallest = smallest_ffn_chunk(spec.config, whole.ep);
  MemoryPlan plan = plan_with_chunks(inputs, smallest, true);
  const double per_chunk_token = 2 * plan.ffn_saved_max_per_token;
  if (plan.ffn_chunk_tokens == 0 || !(per_chunk_token > 0)) return plan;
  const double room = plan.usable_bytes - plan.peak_bytes(plan.recompute) + per_chunk_token * static_cast<double>(smallest);
  // Multiples of 1024 tokens, so that the choice does not move with every byte of the inputs.
  const int64_t fitting = static_cast<int64_t>(std::floor(room / per_chunk_token)) / 1024 * 1024;
  return fitting > smallest ? plan_with_chunks(inputs, fitting, true) : plan;
}

}  // namespace moetrain
