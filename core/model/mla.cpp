#include "core/model/mla.h"

#include "core/model/attention_context_parallel.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;
using kernels::CopyColumnsArgs;

MlaAttention::MlaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
                           const RopeDeviceTables* rope)
    : proj(spec, layer, ctx, rope) {}

void MlaAttention::collect_weights(std::vector<WeightSlot>& out) { proj.collect_weights(out); }

void MlaAttention::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t heads = proj.heads(), nope = proj.nope(), rope = proj.rope_dim(), qk = proj.qk_dim();
  const int64_t v_dim = proj.v_dim(), kv_rank = proj.kv_rank();
  Saved& s = saved_;

  proj.queries(ctx, x, s.stages);
  s.kv_normed = ctx.alloc({n, kv_rank});
  Tensor k_pe = ctx.alloc({n, rope});
  proj.latent(ctx, x, s.kv_normed, k_pe, s.stages);

  // Keys and values per head: kv_b_proj's [k_nope | v], and k_pe shared by every head.
  Tensor kv = ctx.alloc({n * heads, nope + v_dim});
  proj.kv_b_proj.forward(ctx, kv.view().reshaped({n, heads * (nope + v_dim)}), s.kv_normed);
  s.k = ctx.alloc({n, heads, qk});
  TensorView k_rows = s.k.view().reshaped({n * heads, qk});
  be.copy_columns(CopyColumnsArgs{k_rows, kv, 0, 0, nope, 1, false});
  if (rope > 0) be.copy_columns(CopyColumnsArgs{k_rows, k_pe, nope, 0, rope, heads, false});
  s.v = ctx.alloc({n, heads, v_dim});
  be.copy_columns(CopyColumnsArgs{s.v.view().reshaped({n * heads, v_dim}), kv, 0, nope, v_dim, 1, false});

  Tensor attn = ctx.alloc({n, heads, v_dim});
  s.lse = ctx.alloc_accum({n, heads});
  const AttentionArgs attention{attn, s.lse, s.stages.q, s.k, s.v, ctx.batch.cu_seqlens, proj.softmax_scale()};
  if (ctx.context_parallel()) AttentionAcrossRanks(be, *ctx.context_group, *ctx.batch.context).forward(attention);
  else be.attention_forward(attention);
  proj.output(ctx, out, std::move(attn), x, s.stages);
}

void MlaAttention::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t heads = proj.heads(), nope = proj.nope(), rope = proj.rope_dim(), qk = proj.qk_dim();
  const int64_t v_dim = proj.v_dim(), kv_rank = proj.kv_rank();
  Saved& s = saved_;

  Tensor dattn = ctx.alloc({n, heads, v_dim});
  proj.output_backward(ctx, dattn, dout, s.stages);
  Tensor dq = ctx.alloc({n, heads, qk});
  Tensor dk = ctx.alloc({n, heads, qk});
  Tensor dv = ctx.alloc({n, heads, v_dim});
  const AttentionBackwardArgs attention{dq, dk, dv, dattn, s.stages.q, s.k, s.v, s.stages.attn, s.lse,
                                        ctx.batch.cu_seqlens, proj.softmax_scale()};
  if (ctx.context_parallel()) AttentionAcrossRanks(be, *ctx.context_group, *ctx.batch.context).backward(attention);
  else be.attention_backward(attention);

  // Back through the key/value assembly into kv_b_proj's output and k_pe.
  TensorView dk_rows = dk.view().reshaped({n * heads, qk});
  Tensor dkv = ctx.alloc({n * heads, nope + v_dim});
  be.copy_columns(CopyColumnsArgs{dkv, dk_rows, 0, 0, nope, 1, false});
  be.copy_columns(CopyColumnsArgs{dkv, dv.view().reshaped({n * heads, v_dim}), nope, 0, v_dim, 1, false});
  Tensor dk_pe = ctx.alloc({n, rope});
  if (rope > 0) {
    Tensor dk_pe_heads = ctx.alloc({n, heads, rope});
    be.copy_columns(CopyColumnsArgs{dk_pe_heads.view().reshaped({n * heads, rope}), dk_rows, 0, nope, rope, 1, false});
    be.sum_over_heads(dk_pe, dk_pe_heads);
  }
  Tensor dkv_normed = ctx.alloc({n, kv_rank});
  proj.kv_b_proj.backward(ctx, dkv_normed, dkv.view().reshaped({n, heads * (nope + v_dim)}), s.kv_normed, false);
  proj.latent_backward(ctx, dx, dkv_normed, dk_pe, x, s.stages);
  proj.queries_backward(ctx, dx, dq, x, s.stages);
  proj.gate_input_backward(ctx, dx, x, s.stages);
}

void MlaAttention::release_saved() { saved_ = Saved{}; }

}  // namespace moetrain
