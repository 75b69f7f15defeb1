// Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-Linear's NoPE variant).
//
//   q  = q_b_proj(rmsnorm(q_a_proj(x)))  or  q_proj(x)          [tokens, heads, nope + rope]
//   c  = kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_pe (rope, shared by all heads)]
//   kv = kv_b_proj(rmsnorm(latent))       per head: [k_nope | v]
//   q_pe, k_pe rotated (DeepSeek's interleaved RoPE); k = [k_nope | k_pe broadcast over heads]
//   out = o_proj(causal_attention(q, k, v) within each segment)
#pragma once

#include <memory>
#include <optional>
#include <random>

#include "core/model/layer.h"
#include "core/model/lora_linear.h"
#include "core/model/model_spec.h"

namespace moetrain {

struct RopeDeviceTables {
  Tensor cos;  // [positions, rope_dim / 2], compute dtype, on the device
  Tensor sin;
};

class MlaAttention final : public Mixer {
 public:
  // `rope` may be null when the model rotates nothing (NoPE: model.mla.use_rope false).
  MlaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_parameters(std::vector<Parameter*>& out) override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // Every projection, for LoRA targeting by module name.
  std::vector<LoraLinear*> projections();

  bool has_q_lora() const { return q_lora_rank_ > 0; }

  LoraLinear q_proj;      // without q LoRA
  LoraLinear q_a_proj;    // with q LoRA
  LoraLinear q_b_proj;
  Tensor q_a_norm;        // q_a_layernorm.weight
  LoraLinear kv_a_proj;   // kv_a_proj_with_mqa
  Tensor kv_a_norm;       // kv_a_layernorm.weight
  LoraLinear kv_b_proj;
  LoraLinear o_proj;

 private:
  int64_t heads_, nope_, rope_dim_, v_dim_, kv_rank_, q_lora_rank_;
  bool use_rope_;  // false: the rope part of q and k is kept but not rotated (NoPE)
  double eps_, softmax_scale_;  // eps_: of the q_a / kv_a latent norms
  const RopeDeviceTables* rope_;
  std::string prefix_;

  struct Saved {
    Tensor q_a, q_a_rstd, q_a_normed;  // q LoRA path
    Tensor kv_latent, kv_rstd, kv_normed;
    Tensor q, k, v, attn, lse;
  } saved_;
};

}  // namespace moetrain
