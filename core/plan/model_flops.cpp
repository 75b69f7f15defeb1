#include "core/plan/model_flops.h"

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
  const double expert_weights = 3.0 * d * static_cast<double>(m.moe.expert_intermediate_size);

  // KDA's projections (the convs, gate and norms are elementwise, not counted) and its recurrence.
  const KdaConfig& k = m.kda;
  const double kd = static_cast<double>(k.head_dim);
  const double kh = static_cast<double>(k.num_heads);
  const double c = kh * kd;
  const double kda_weights = 3.0 * c * d + (d * kd + kd * c) + kh * d +
                             (k.full_rank_output_gate ? c * d : d * kd + kd * c) + c * d;

  frozen_per_token_ = d * static_cast<double>(m.vocab_size);  // the LM head (tied or not)
  for (size_t l = 0; l < spec.mixers.size(); ++l) {
    if (spec.mixers[l] == MixerKind::kMla) {
      frozen_per_token_ += mla_weights;
      attention_per_pair_ += 2.0 * (qk + v) * heads;
    }
    if (spec.mixers[l] == MixerKind::kKda) {
      frozen_per_token_ += kda_weights;
      recurrence_per_token_ += 6.0 * kh * kd * kd;
    }
    if (spec.ffns[l] == FfnKind::kDense) {
      frozen_per_token_ += 3.0 * d * static_cast<double>(m.intermediate_size);
    } else {
      frozen_per_token_ += expert_weights * static_cast<double>(m.moe.top_k + m.moe.num_shared_experts) +
                           d * static_cast<double>(m.moe.num_experts);  // + the router
    }
  }

  const LoraParameterCount adapters = count_lora_parameters(spec, lora);
  lora_per_token_ = static_cast<double>(adapters.non_expert());
  if (m.moe.num_experts > 0) {
    lora_per_token_ += static_cast<double>(adapters.routed_experts()) * static_cast<double>(m.moe.top_k) /
                       static_cast<double>(m.moe.num_experts);
  }
}

StepFlops ModelFlops::step(int64_t tokens, const std::vector<int32_t>& cu_seqlens) const {
  double pairs = 0.0;  // causal (query, key <= query) pairs within each segment
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const double length = cu_seqlens[s + 1] - cu_seqlens[s];
    pairs += length * (length + 1.0) / 2.0;
  }
  StepFlops flops;
  flops.frozen = 4.0 * frozen_per_token_ * static_cast<double>(tokens);
  flops.lora = 6.0 * lora_per_token_ * static_cast<double>(tokens);
  flops.attention = 3.5 * attention_per_pair_ * pairs + 3.0 * recurrence_per_token_ * static_cast<double>(tokens);
  return flops;
}

}  // namespace moetrain
