#include "core/model/mla_projections.h"

#include "core/model/rope_tables.h"

namespace moetrain {

using kernels::AttentionGateArgs;
using kernels::AttentionGateBackwardArgs;
using kernels::CopyColumnsArgs;
using kernels::RmsNormArgs;
using kernels::RmsNormBackwardArgs;
using kernels::RopeArgs;

MlaProjections::MlaProjections(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
                               const RopeDeviceTables* rope)
    : rope_(rope) {
  const ModelConfig& m = spec.config;
  const MlaConfig& mla = m.mla;
  heads_ = mla.num_heads;
  nope_ = mla.qk_nope_head_dim;
  rope_dim_ = mla.qk_rope_head_dim;  // kept in the shapes even when not rotated (Kimi's NoPE MLA)
  use_rope_ = mla.use_rope;
  v_dim_ = mla.v_head_dim;
  kv_rank_ = mla.kv_lora_rank;
  q_lora_rank_ = mla.q_lora_rank.value_or(0);
  gate_ = m.attention_gate == "headwise"      ? Gate::kHeadwise
          : m.attention_gate == "elementwise" ? Gate::kElementwise
                                              : Gate::kNone;
  softmax_scale_ = mla_softmax_scale(mla);
  prefix_ = "model.layers." + std::to_string(layer) + ".self_attn.";
  MOETRAIN_ASSERT(!use_rope_ || rope_ != nullptr, "MLA with RoPE needs rope tables");

  const int64_t hidden = m.hidden_size;
  auto make = [&](LoraLinear& linear, const char* name, int64_t in, int64_t out) {
    linear = LoraLinear(prefix_ + name, in, out);
    linear.alloc_weight(ctx, m);
  };
  if (q_lora_rank_ > 0) {
    make(q_a_proj, "q_a_proj", hidden, q_lora_rank_);
    make(q_b_proj, "q_b_proj", q_lora_rank_, heads_ * qk_dim());
    q_a_norm = ctx.alloc({q_lora_rank_});
  } else {
    make(q_proj, "q_proj", hidden, heads_ * qk_dim());
  }
  make(kv_a_proj, "kv_a_proj_with_mqa", hidden, kv_rank_ + rope_dim_);
  kv_a_norm = ctx.alloc({kv_rank_});
  make(kv_b_proj, "kv_b_proj", kv_rank_, heads_ * (nope_ + v_dim_));
  if (gated()) make(g_proj, "g_proj", hidden, gate_ == Gate::kHeadwise ? heads_ : heads_ * v_dim_);
  make(o_proj, "o_proj", heads_ * v_dim_, hidden);
}

std::vector<LoraLinear*> MlaProjections::projections() {
  std::vector<LoraLinear*> out;
  if (q_lora_rank_ > 0) {
    out = {&q_a_proj, &q_b_proj};
  } else {
    out = {&q_proj};
  }
  for (LoraLinear* p : {&kv_a_proj, &kv_b_proj, &g_proj, &o_proj}) {
    if (p != &g_proj || gated()) out.push_back(p);
  }
  return out;
}

void MlaProjections::collect_weights(std::vector<WeightSlot>& out) {
  for (LoraLinear* p : projections()) out.push_back(p->weight_slot());
  if (q_lora_rank_ > 0) out.push_back({prefix_ + "q_a_layernorm.weight", &q_a_norm});
  out.push_back({prefix_ + "kv_a_layernorm.weight", &kv_a_norm});
}

void MlaProjections::queries(const LayerContext& ctx, const TensorView& x, Saved& s) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  s.q = ctx.alloc({n, heads_, qk_dim()});
  TensorView q_rows = s.q.view().reshaped({n, heads_ * qk_dim()});
  if (q_lora_rank_ > 0) {
    s.q_a = ctx.alloc({n, q_lora_rank_});
    q_a_proj.forward(ctx, s.q_a, x);
    s.q_a_rstd = ctx.alloc_accum({n});
    s.q_latent = ctx.alloc({n, q_lora_rank_});
    be.rmsnorm_forward(RmsNormArgs{s.q_latent, s.q_a_rstd, s.q_a, q_a_norm, eps_});
    q_b_proj.forward(ctx, q_rows, s.q_latent);
  } else {
    q_proj.forward(ctx, q_rows, x);
  }
  if (use_rope_ && rope_dim_ > 0) {
    TensorView by_head = s.q.view().reshaped({n * heads_, qk_dim()});
    be.rope(RopeArgs{by_head, by_head, ctx.batch.positions, rope_->cos, rope_->sin, heads_, nope_, rope_dim_});
  }
}

void MlaProjections::latent(const LayerContext& ctx, const TensorView& x, const TensorView& kv_normed,
                            const TensorView& k_pe, Saved& s) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  Tensor compressed = ctx.alloc({n, kv_rank_ + rope_dim_});
  kv_a_proj.forward(ctx, compressed, x);
  s.kv_latent = ctx.alloc({n, kv_rank_});
  be.copy_columns(CopyColumnsArgs{s.kv_latent, compressed, 0, 0, kv_rank_, 1, false});
  s.kv_rstd = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{kv_normed, s.kv_rstd, s.kv_latent, kv_a_norm, eps_});
  if (rope_dim_ == 0) return;
  be.copy_columns(CopyColumnsArgs{k_pe, compressed, 0, kv_rank_, rope_dim_, 1, false});
  if (use_rope_) be.rope(RopeArgs{k_pe, k_pe, ctx.batch.positions, rope_->cos, rope_->sin, 1, 0, rope_dim_});
}

void MlaProjections::output(const LayerContext& ctx, const TensorView& out, Tensor attn, const TensorView& x,
                            Saved& s) const {
  const int64_t n = x.size(0);
  s.attn = std::move(attn);
  if (!gated()) {
    o_proj.forward(ctx, out, s.attn.view().reshaped({n, heads_ * v_dim_}));
    return;
  }
  s.gate = ctx.alloc({n, g_proj.out_features()});
  g_proj.forward(ctx, s.gate, x);
  Tensor gated_attn = ctx.alloc({n, heads_, v_dim_});
  ctx.backend.attention_gate_forward(AttentionGateArgs{gated_attn, s.attn, s.gate, gate_ == Gate::kHeadwise});
  o_proj.forward(ctx, out, gated_attn.view().reshaped({n, heads_ * v_dim_}));
}

void MlaProjections::output_backward(const LayerContext& ctx, const TensorView& dattn, const TensorView& dout,
                                     Saved& s) const {
  const int64_t n = dout.size(0);
  const TensorView dattn_rows = dattn.reshaped({n, heads_ * v_dim_});
  if (!gated()) {
    o_proj.backward(ctx, dattn_rows, dout, s.attn.view().reshaped({n, heads_ * v_dim_}), false);
    return;
  }
  const bool headwise = gate_ == Gate::kHeadwise;
  // o_proj's input, recomputed (an elementwise product) rather than kept from the forward.
  Tensor gated_attn = ctx.alloc({n, heads_, v_dim_});
  ctx.backend.attention_gate_forward(AttentionGateArgs{gated_attn, s.attn, s.gate, headwise});
  o_proj.backward(ctx, dattn_rows, dout, gated_attn.view().reshaped({n, heads_ * v_dim_}), false);
  s.dgate = ctx.alloc(s.gate.shape());
  ctx.backend.attention_gate_backward(AttentionGateBackwardArgs{dattn, s.dgate, dattn, s.attn, s.gate, headwise});
}

void MlaProjections::keys_values(const LayerContext& ctx, const TensorView& k, const TensorView& v,
                                 const TensorView& kv_normed, const TensorView& k_pe) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = kv_normed.size(0);
  Tensor kv = ctx.alloc({n * heads_, nope_ + v_dim_});
  kv_b_proj.forward(ctx, kv.view().reshaped({n, heads_ * (nope_ + v_dim_)}), kv_normed);
  const TensorView k_rows = k.reshaped({n * heads_, qk_dim()});
  be.copy_columns(CopyColumnsArgs{k_rows, kv, 0, 0, nope_, 1, false});
  if (rope_dim_ > 0) be.copy_columns(CopyColumnsArgs{k_rows, k_pe, nope_, 0, rope_dim_, heads_, false});
  be.copy_columns(CopyColumnsArgs{v.reshaped({n * heads_, v_dim_}), kv, 0, nope_, v_dim_, 1, false});
}

void MlaProjections::keys_values_backward(const LayerContext& ctx, const TensorView& dkv_normed,
                                          const TensorView& dk_pe, const TensorView& dk, const TensorView& dv,
                                          const TensorView& kv_normed) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = kv_normed.size(0);
  const TensorView dk_rows = dk.reshaped({n * heads_, qk_dim()});
  Tensor dkv = ctx.alloc({n * heads_, nope_ + v_dim_});
  be.copy_columns(CopyColumnsArgs{dkv, dk_rows, 0, 0, nope_, 1, false});
  be.copy_columns(CopyColumnsArgs{dkv, dv.reshaped({n * heads_, v_dim_}), nope_, 0, v_dim_, 1, false});
  if (rope_dim_ > 0) {
    Tensor dk_pe_heads = ctx.alloc({n, heads_, rope_dim_});
    be.copy_columns(CopyColumnsArgs{dk_pe_heads.view().reshaped({n * heads_, rope_dim_}), dk_rows, 0, nope_, rope_dim_,
                                    1, false});
    be.sum_over_heads(dk_pe, dk_pe_heads);
  }
  kv_b_proj.backward(ctx, dkv_normed, dkv.view().reshaped({n, heads_ * (nope_ + v_dim_)}), kv_normed, false);
}

void MlaProjections::latent_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dkv_normed,
                                     const TensorView& dk_pe, const TensorView& x, const Saved& s) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  Tensor dcompressed = ctx.alloc({n, kv_rank_ + rope_dim_});
  if (rope_dim_ > 0) {
    if (use_rope_) {
      RopeArgs back{dk_pe, dk_pe, ctx.batch.positions, rope_->cos, rope_->sin, 1, 0, rope_dim_};
      back.inverse = true;
      be.rope(back);
    }
    be.copy_columns(CopyColumnsArgs{dcompressed, dk_pe, kv_rank_, 0, rope_dim_, 1, false});
  }
  Tensor dlatent = ctx.alloc({n, kv_rank_});
  be.rmsnorm_backward(RmsNormBackwardArgs{dlatent, {}, dkv_normed, s.kv_latent, kv_a_norm, s.kv_rstd, false});
  be.copy_columns(CopyColumnsArgs{dcompressed, dlatent, 0, 0, kv_rank_, 1, false});
  kv_a_proj.backward(ctx, dx, dcompressed, x, false);
}

void MlaProjections::queries_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dq,
                                      const TensorView& x, const Saved& s) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  if (use_rope_ && rope_dim_ > 0) {
    TensorView by_head = dq.reshaped({n * heads_, qk_dim()});
    RopeArgs back{by_head, by_head, ctx.batch.positions, rope_->cos, rope_->sin, heads_, nope_, rope_dim_};
    back.inverse = true;
    be.rope(back);
  }
  const TensorView dq_rows = dq.reshaped({n, heads_ * qk_dim()});
  if (q_lora_rank_ > 0) {
    Tensor dq_latent = ctx.alloc({n, q_lora_rank_});
    q_b_proj.backward(ctx, dq_latent, dq_rows, s.q_latent, false);
    Tensor dq_a = ctx.alloc({n, q_lora_rank_});
    be.rmsnorm_backward(RmsNormBackwardArgs{dq_a, {}, dq_latent, s.q_a, q_a_norm, s.q_a_rstd, false});
    q_a_proj.backward(ctx, dx, dq_a, x, true);
  } else {
    q_proj.backward(ctx, dx, dq_rows, x, true);
  }
}

void MlaProjections::gate_input_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& x,
                                         const Saved& s) const {
  if (gated()) g_proj.backward(ctx, dx, s.dgate, x, true);
}

}  // namespace moetrain
