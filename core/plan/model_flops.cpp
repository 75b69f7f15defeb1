#include "core/plan/model_flops.h"

#include <algorithm>

#include "core/plan/param_count.h"

namespace moetrain {

ModelFlops::ModelFlops(const ModelSpec& spec, const LoraConfig& lora) {
  const ModelConfig& m = spec.config;
  const MlaConfig& a = m.mla;
  const double d = static_cast<double>(m.hidden_size);
  const double heads = static_cast<double>(a.num_heads);
  const double qk = static_cast<double>(a.qk_nope_head_dim + a.qk_rope_head_dim);
  const double v = static_cast<double>(a.v_head_dim);
  const double q_weights = a.q_lora_rank ? d * static_cast<double>(*a.q_lora_rank) + static_cast<double>(*a.q_lora_rank) * heads * qk
                                         : d * heads * qk;
  const double kv_rank = static_cast<double>(a.kv_lora_rank);
  const double mla_weights = q_weights + d * (kv_rank + static_cast<double>(a.qk_rope_head_dim)) +
                             kv_rank * heads * (static_cast<double>(a.qk_nope_head_dim) + v) + heads * v * d;
  const double expert_intermediate = static_cast<double>(m.moe.expert_intermediate_size);
  const double shared_weights = 3.0 * d * expert_intermediate;
  // Latent MoE (K3): routed experts at the latent width, plus the down- and up-projection.
  const double latent = static_cast<double>(m.moe.latent_size);
  const double routed_weights = latent > 0 ? 3.0 * latent * expert_intermediate : shared_weights;
  const double latent_weights = 2.0 * latent * d;

  // KDA's projections (the convs, gate and norms are elementwise, not counted) and its recurrence.
  const KdaConfig& k = m.kda;
  const double kd = static_cast<double>(k.head_dim);
  const double kh = static_cast<double>(k.num_heads);
  const double c = kh * kd;
  const double kda_weights = 3.0 * c * d + (d * kd + kd * c) + kh * d +
                             (k.full_rank_output_gate ? c * d : d * kd + kd * c) + c * d;

  // The output gate's g_proj on MLA and DSA layers.
  const double gate_weights = m.attention_gate == "headwise"      ? d * heads
                              : m.attention_gate == "elementwise" ? d * heads * v
                                                                  : 0.0;
  // DSA's indexer: wq_b [Hi di, q_r], wk [di, D], weights_proj [Hi, D].
  const DsaConfig& dsa = m.dsa;
  const double index_heads = static_cast<double>(dsa.index_n_heads), index_dim = static_cast<double>(dsa.index_head_dim);
  const double indexer_weights = index_heads * index_dim * static_cast<double>(a.q_lora_rank.value_or(0)) +
                                 index_dim * d + index_heads * d;
  index_topk_ = dsa.index_topk;

  frozen_per_token_ = d * static_cast<double>(m.vocab_size);  // the LM head (tied or not)
  for (size_t l = 0; l < spec.mixers.size(); ++l) {
    if (spec.mixers[l] == MixerKind::kMla) {
      frozen_per_token_ += mla_weights + gate_weights;
      attention_per_pair_ += 2.0 * (qk + v) * heads;
    }
    if (spec.mixers[l] == MixerKind::kDsa) {
      frozen_per_token_ += mla_weights + gate_weights;
      indexer_weights_per_token_ += indexer_weights;
      indexer_per_pair_ += 2.0 * index_heads * index_dim;
      sparse_per_pair_ += 2.0 * (2.0 * kv_rank + static_cast<double>(a.qk_rope_head_dim)) * heads;
    }
    if (spec.mixers[l] == MixerKind::kKda) {
      frozen_per_token_ += kda_weights;
      recurrence_per_token_ += 6.0 * kh * kd * kd;
    }
    if (spec.ffns[l] == FfnKind::kDense) {
      frozen_per_token_ += 3.0 * d * static_cast<double>(m.intermediate_size);
    } else {
      frozen_per_token_ += routed_weights * static_cast<double>(m.moe.top_k) +
                           shared_weights * static_cast<double>(m.moe.num_shared_experts) + latent_weights +
                           d * static_cast<double>(m.moe.num_experts);  // + the router
    }
  }

  const LoraParameterCount adapters = count_lora_parameters(spec, lora);
  lora_per_token_ = static_cast<double>(adapters.non_expert());
  // A shared expert A meets every routed row: top_k per token.
  lora_per_token_ += static_cast<double>(adapters.shared_expert_a) * static_cast<double>(m.moe.top_k - 1);
  if (m.moe.num_experts > 0) {
    lora_per_token_ += static_cast<double>(adapters.routed_experts()) * static_cast<double>(m.moe.top_k) /
                       static_cast<double>(m.moe.num_experts);
  }
}

StepFlops ModelFlops::step(int64_t tokens, const std::vector<int32_t>& cu_seqlens) const {
  double pairs = 0.0;     // causal (query, key <= query) pairs within each segment
  double selected = 0.0;  // of those, the ones a DSA top-k keeps: min(k, i + 1) for the i-th query
  const double k = static_cast<double>(index_topk_);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const double length = cu_seqlens[s + 1] - cu_seqlens[s];
    pairs += length * (length + 1.0) / 2.0;
    const double full = std::min(length, k);  // the first `full` queries keep every key
    selected += full * (full + 1.0) / 2.0 + (length - full) * k;
  }
  const double n = static_cast<double>(tokens);
  StepFlops flops;
  flops.frozen = 4.0 * frozen_per_token_ * n + 2.0 * indexer_weights_per_token_ * n;
  flops.lora = 6.0 * lora_per_token_ * n;
  flops.attention = 3.5 * attention_per_pair_ * pairs + 3.0 * recurrence_per_token_ * n +
                    3.5 * sparse_per_pair_ * selected + indexer_per_pair_ * pairs;
  return flops;
}

StepFlops ModelFlops::shard(const ContextShards& shards, int rank) const {
  // The micro-batch's first n tokens, in its segments.
  auto first = [&](int64_t n) {
    std::vector<int32_t> cu = {0};
    for (int32_t offset : shards.window_cu())
      if (offset > 0 && offset < n) cu.push_back(offset);
    cu.push_back(static_cast<int32_t>(n));
    return n > 0 ? step(n, cu) : StepFlops{};
  };
  StepFlops flops;
  for (int s : shards.spans_of(rank)) {
    const StepFlops to = first(shards.spans()[s].end), from = first(shards.spans()[s].begin);
    flops.frozen += to.frozen - from.frozen;
    flops.lora += to.lora - from.lora;
    flops.attention += to.attention - from.attention;
  }
  return flops;
}

}  // namespace moetrain
