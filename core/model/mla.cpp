#include "core/model/mla.h"

#include "core/model/rope_tables.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;
using kernels::CopyColumnsArgs;
using kernels::RmsNormArgs;
using kernels::RmsNormBackwardArgs;
using kernels::RopeArgs;

MlaAttention::MlaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
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
  // transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps, so they
  // always use 1e-6; checkpoints were trained that way.
  eps_ = 1e-6;
  softmax_scale_ = mla_softmax_scale(mla);
  prefix_ = "model.layers." + std::to_string(layer) + ".self_attn.";
  MOETRAIN_ASSERT(!use_rope_ || rope_ != nullptr, "MLA with RoPE needs rope tables");

  const int64_t hidden = m.hidden_size;
  const int64_t qk = nope_ + rope_dim_;
  auto make = [&](LoraLinear& linear, const char* name, int64_t in, int64_t out) {
    linear = LoraLinear(prefix_ + name, in, out);
    linear.weight = ctx.alloc({out, in});
  };
  if (q_lora_rank_ > 0) {
    make(q_a_proj, "q_a_proj", hidden, q_lora_rank_);
    make(q_b_proj, "q_b_proj", q_lora_rank_, heads_ * qk);
    q_a_norm = ctx.alloc({q_lora_rank_});
  } else {
    make(q_proj, "q_proj", hidden, heads_ * qk);
  }
  make(kv_a_proj, "kv_a_proj_with_mqa", hidden, kv_rank_ + rope_dim_);
  kv_a_norm = ctx.alloc({kv_rank_});
  make(kv_b_proj, "kv_b_proj", kv_rank_, heads_ * (nope_ + v_dim_));
  make(o_proj, "o_proj", heads_ * v_dim_, hidden);
}

std::vector<LoraLinear*> MlaAttention::projections() {
  if (q_lora_rank_ > 0) return {&q_a_proj, &q_b_proj, &kv_a_proj, &kv_b_proj, &o_proj};
  return {&q_proj, &kv_a_proj, &kv_b_proj, &o_proj};
}

void MlaAttention::collect_parameters(std::vector<Parameter*>& out) {
  for (LoraLinear* p : projections()) p->collect_parameters(out);
}

void MlaAttention::collect_weights(std::vector<WeightSlot>& out) {
  for (LoraLinear* p : projections()) out.push_back({p->name() + ".weight", &p->weight});
  if (q_lora_rank_ > 0) out.push_back({prefix_ + "q_a_layernorm.weight", &q_a_norm});
  out.push_back({prefix_ + "kv_a_layernorm.weight", &kv_a_norm});
}

void MlaAttention::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t qk = nope_ + rope_dim_;
  Saved& s = saved_;

  // Queries.
  s.q = ctx.alloc({n, heads_, qk});
  TensorView q_rows = s.q.view().reshaped({n, heads_ * qk});
  if (q_lora_rank_ > 0) {
    s.q_a = ctx.alloc({n, q_lora_rank_});
    q_a_proj.forward(ctx, s.q_a, x);
    s.q_a_rstd = ctx.alloc_accum({n});
    s.q_a_normed = ctx.alloc({n, q_lora_rank_});
    be.rmsnorm_forward(RmsNormArgs{s.q_a_normed, s.q_a_rstd, s.q_a, q_a_norm, eps_});
    q_b_proj.forward(ctx, q_rows, s.q_a_normed);
  } else {
    q_proj.forward(ctx, q_rows, x);
  }

  // Compressed keys/values: the latent and the shared rotary key.
  Tensor compressed = ctx.alloc({n, kv_rank_ + rope_dim_});
  kv_a_proj.forward(ctx, compressed, x);
  s.kv_latent = ctx.alloc({n, kv_rank_});
  be.copy_columns(CopyColumnsArgs{s.kv_latent, compressed, 0, 0, kv_rank_, 1, false});
  s.kv_rstd = ctx.alloc_accum({n});
  s.kv_normed = ctx.alloc({n, kv_rank_});
  be.rmsnorm_forward(RmsNormArgs{s.kv_normed, s.kv_rstd, s.kv_latent, kv_a_norm, eps_});
  Tensor kv = ctx.alloc({n * heads_, nope_ + v_dim_});
  kv_b_proj.forward(ctx, kv.view().reshaped({n, heads_ * (nope_ + v_dim_)}), s.kv_normed);

  s.k = ctx.alloc({n, heads_, qk});
  TensorView k_rows = s.k.view().reshaped({n * heads_, qk});
  be.copy_columns(CopyColumnsArgs{k_rows, kv, 0, 0, nope_, 1, false});
  if (rope_dim_ > 0) {
    Tensor k_pe = ctx.alloc({n, rope_dim_});
    be.copy_columns(CopyColumnsArgs{k_pe, compressed, 0, kv_rank_, rope_dim_, 1, false});
    if (use_rope_) {
      TensorView q_rows_by_head = s.q.view().reshaped({n * heads_, qk});
      be.rope(RopeArgs{q_rows_by_head, q_rows_by_head, ctx.batch.positions, rope_->cos, rope_->sin, heads_, nope_,
                       rope_dim_});
      be.rope(RopeArgs{k_pe, k_pe, ctx.batch.positions, rope_->cos, rope_->sin, 1, 0, rope_dim_});
    }
    be.copy_columns(CopyColumnsArgs{k_rows, k_pe, nope_, 0, rope_dim_, heads_, false});
  }
  s.v = ctx.alloc({n, heads_, v_dim_});
  be.copy_columns(CopyColumnsArgs{s.v.view().reshaped({n * heads_, v_dim_}), kv, 0, nope_, v_dim_, 1, false});

  s.attn = ctx.alloc({n, heads_, v_dim_});
  s.lse = ctx.alloc_accum({n, heads_});
  be.attention_forward(AttentionArgs{s.attn, s.lse, s.q, s.k, s.v, ctx.batch.cu_seqlens, softmax_scale_});
  o_proj.forward(ctx, out, s.attn.view().reshaped({n, heads_ * v_dim_}));
}

void MlaAttention::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t qk = nope_ + rope_dim_;
  Saved& s = saved_;

  Tensor dattn = ctx.alloc({n, heads_, v_dim_});
  o_proj.backward(ctx, dattn.view().reshaped({n, heads_ * v_dim_}), dout,
                  s.attn.view().reshaped({n, heads_ * v_dim_}), false);
  Tensor dq = ctx.alloc({n, heads_, qk});
  Tensor dk = ctx.alloc({n, heads_, qk});
  Tensor dv = ctx.alloc({n, heads_, v_dim_});
  be.attention_backward(AttentionBackwardArgs{dq, dk, dv, dattn, s.q, s.k, s.v, s.attn, s.lse,
                                              ctx.batch.cu_seqlens, softmax_scale_});

  // Back through the key/value assembly into kv_b_proj's output and the compressed vector.
  TensorView dk_rows = dk.view().reshaped({n * heads_, qk});
  Tensor dkv = ctx.alloc({n * heads_, nope_ + v_dim_});
  be.copy_columns(CopyColumnsArgs{dkv, dk_rows, 0, 0, nope_, 1, false});
  be.copy_columns(CopyColumnsArgs{dkv, dv.view().reshaped({n * heads_, v_dim_}), nope_, 0, v_dim_, 1, false});
  Tensor dcompressed = ctx.alloc({n, kv_rank_ + rope_dim_});
  if (rope_dim_ > 0) {
    Tensor dk_pe_heads = ctx.alloc({n, heads_, rope_dim_});
    be.copy_columns(CopyColumnsArgs{dk_pe_heads.view().reshaped({n * heads_, rope_dim_}), dk_rows, 0, nope_,
                                    rope_dim_, 1, false});
    Tensor dk_pe = ctx.alloc({n, rope_dim_});
    be.sum_over_heads(dk_pe, dk_pe_heads);
    if (use_rope_) {
      RopeArgs k_back{dk_pe, dk_pe, ctx.batch.positions, rope_->cos, rope_->sin, 1, 0, rope_dim_};
      k_back.inverse = true;
      be.rope(k_back);
      TensorView dq_rows = dq.view().reshaped({n * heads_, qk});
      RopeArgs q_back{dq_rows, dq_rows, ctx.batch.positions, rope_->cos, rope_->sin, heads_, nope_, rope_dim_};
      q_back.inverse = true;
      be.rope(q_back);
    }
    be.copy_columns(CopyColumnsArgs{dcompressed, dk_pe, kv_rank_, 0, rope_dim_, 1, false});
  }
  Tensor dkv_normed = ctx.alloc({n, kv_rank_});
  kv_b_proj.backward(ctx, dkv_normed, dkv.view().reshaped({n, heads_ * (nope_ + v_dim_)}), s.kv_normed, false);
  Tensor dlatent = ctx.alloc({n, kv_rank_});
  be.rmsnorm_backward(RmsNormBackwardArgs{dlatent, {}, dkv_normed, s.kv_latent, kv_a_norm, s.kv_rstd, false});
  be.copy_columns(CopyColumnsArgs{dcompressed, dlatent, 0, 0, kv_rank_, 1, false});
  kv_a_proj.backward(ctx, dx, dcompressed, x, false);

  TensorView dq_flat = dq.view().reshaped({n, heads_ * qk});
  if (q_lora_rank_ > 0) {
    Tensor dq_a_normed = ctx.alloc({n, q_lora_rank_});
    q_b_proj.backward(ctx, dq_a_normed, dq_flat, s.q_a_normed, false);
    Tensor dq_a = ctx.alloc({n, q_lora_rank_});
    be.rmsnorm_backward(RmsNormBackwardArgs{dq_a, {}, dq_a_normed, s.q_a, q_a_norm, s.q_a_rstd, false});
    q_a_proj.backward(ctx, dx, dq_a, x, true);
  } else {
    q_proj.backward(ctx, dx, dq_flat, x, true);
  }
}

void MlaAttention::release_saved() { saved_ = Saved{}; }

}  // namespace moetrain
