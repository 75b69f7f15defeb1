// The projections MLA and DSA share (DeepSeek-V2/V3 MLA, Kimi's NoPE variant, Kimi K3's gate),
// as stages each mixer composes:
//   queries   q = q_b_proj(rmsnorm(q_a_proj(x)))  or  q_proj(x)     [tokens, heads, nope + rope]
//             q_pe (the last rope columns of each head) rotated, DeepSeek's interleaved layout
//   latent    c = kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_pe (rope, shared by heads)]
//             kv_normed = rmsnorm(latent), k_pe rotated
//   kv_b_proj latent -> per head [k_nope | v]: MLA expands keys and values with it, DSA folds it
//             into the queries and the attention output (MQA form); each mixer applies it itself
//   output    out = o_proj(attn * sigmoid(g_proj(x)))  with model.attention_gate headwise
//             (g_proj: D -> heads) or elementwise (D -> heads * v), or o_proj(attn) without a gate
// The norms' eps is 1e-6: transformers builds q_a_layernorm and kv_a_layernorm without passing
// rms_norm_eps, and checkpoints were trained that way. Every projection can carry LoRA.
#pragma once

#include <string>
#include <vector>

#include "core/model/layer.h"
#include "core/model/lora_linear.h"
#include "core/model/model_spec.h"

namespace moetrain {

struct RopeDeviceTables {
  Tensor cos;  // [positions, rope_dim / 2], accumulation dtype, on the device
  Tensor sin;
};

class MlaProjections {
 public:
  MlaProjections() = default;
  // `rope` may be null when the model rotates nothing (NoPE: model.mla.use_rope false).
  MlaProjections(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope);

  // Every projection, for LoRA targeting by module name and for parameters.
  std::vector<LoraLinear*> projections();
  void collect_weights(std::vector<WeightSlot>& out);

  LoraLinear q_proj;      // without q LoRA
  LoraLinear q_a_proj;    // with q LoRA
  LoraLinear q_b_proj;
  Tensor q_a_norm;        // q_a_layernorm.weight
  LoraLinear kv_a_proj;   // kv_a_proj_with_mqa
  Tensor kv_a_norm;       // kv_a_layernorm.weight
  LoraLinear kv_b_proj;
  LoraLinear g_proj;      // the output gate (model.attention_gate != none)
  LoraLinear o_proj;

  int64_t heads() const { return heads_; }
  int64_t nope() const { return nope_; }
  int64_t rope_dim() const { return rope_dim_; }
  int64_t qk_dim() const { return nope_ + rope_dim_; }
  int64_t v_dim() const { return v_dim_; }
  int64_t kv_rank() const { return kv_rank_; }
  bool has_q_lora() const { return q_lora_rank_ > 0; }
  double softmax_scale() const { return softmax_scale_; }
  const std::string& prefix() const { return prefix_; }  // model.layers.<L>.self_attn.
  const RopeDeviceTables* rope() const { return use_rope_ ? rope_ : nullptr; }

  // Forward stages. Each keeps what its backward needs in `saved`.
  struct Saved {
    Tensor q_a, q_a_rstd, q_latent;  // q LoRA path: q_a_proj's output, its rstd, the normed q latent
    Tensor q;                        // [tokens, heads, qk] with q_pe rotated
    Tensor kv_latent, kv_rstd;       // the latent before its norm, and the norm's rstd
    Tensor attn, gate;               // the output stage's input [tokens, heads, v] and gate pre-activation
    Tensor dgate;                    // output_backward -> gate_input_backward
  };
  // saved.q (and the q LoRA path).
  void queries(const LayerContext& ctx, const TensorView& x, Saved& saved) const;
  // kv_normed [tokens, kv_rank] and the rotated k_pe [tokens, rope]; saved.kv_latent, kv_rstd.
  void latent(const LayerContext& ctx, const TensorView& x, const TensorView& kv_normed, const TensorView& k_pe,
              Saved& saved) const;
  // The keys and values of latent rows (any rows: a context-parallel rank expands other ranks'):
  // kv_b_proj(kv_normed) per head [k_nope | v], k = [k_nope | k_pe broadcast over heads].
  // k [rows, heads, qk] and v [rows, heads, v] overwritten.
  void keys_values(const LayerContext& ctx, const TensorView& k, const TensorView& v, const TensorView& kv_normed,
                   const TensorView& k_pe) const;
  // out = o_proj(gate(attn)); saved.attn takes `attn` [tokens, heads, v].
  void output(const LayerContext& ctx, const TensorView& out, Tensor attn, const TensorView& x, Saved& saved) const;

  // Backward stages, in reverse order of the forward. dattn [tokens, heads, v] overwritten.
  void output_backward(const LayerContext& ctx, const TensorView& dattn, const TensorView& dout, Saved& saved) const;
  // keys_values' backward: dkv_normed [rows, kv_rank] and dk_pe [rows, rope] overwritten from dk
  // and dv, kv_b_proj's adapter gradients += (from these rows' kv_normed).
  void keys_values_backward(const LayerContext& ctx, const TensorView& dkv_normed, const TensorView& dk_pe,
                            const TensorView& dk, const TensorView& dv, const TensorView& kv_normed) const;
  // dx overwritten: the latent stage's input gradient, from d kv_normed and d k_pe (the latter
  // rotated back in place).
  void latent_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dkv_normed,
                       const TensorView& dk_pe, const TensorView& x, const Saved& saved) const;
  // dx += the query stage's input gradient; dq [tokens, heads, qk] is rotated back in place.
  void queries_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dq, const TensorView& x,
                        const Saved& saved) const;
  // dx += g_proj's input gradient (nothing without a gate).
  void gate_input_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& x,
                           const Saved& saved) const;

 private:
  enum class Gate { kNone, kHeadwise, kElementwise };
  bool gated() const { return gate_ != Gate::kNone; }

  int64_t heads_ = 0, nope_ = 0, rope_dim_ = 0, v_dim_ = 0, kv_rank_ = 0, q_lora_rank_ = 0;
  bool use_rope_ = false;  // false: the rope part of q and k is kept but not rotated (NoPE)
  Gate gate_ = Gate::kNone;
  double eps_ = 1e-6, softmax_scale_ = 1.0;
  const RopeDeviceTables* rope_ = nullptr;
  std::string prefix_;
};

}  // namespace moetrain
