#include "core/model/mla.h"

#include "core/model/mla_blocked.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;

MlaAttention::MlaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
                           const RopeDeviceTables* rope)
    : proj(spec, layer, ctx, rope) {}

bool MlaAttention::blocked(const LayerContext& ctx) {
  return ctx.attention_query_block > 0 || ctx.context_key_chunk > 0;
}

MlaBlocks MlaAttention::blocks(const LayerContext& ctx, int64_t tokens) const {
  return MlaBlocks(ctx, proj, tokens, ctx.attention_query_block, ctx.context_key_chunk);
}

void MlaAttention::collect_weights(std::vector<WeightSlot>& out) { proj.collect_weights(out); }

void MlaAttention::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t heads = proj.heads(), qk = proj.qk_dim(), v_dim = proj.v_dim();
  Saved& s = saved_;

  proj.queries(ctx, x, s.stages);
  s.kv_normed = ctx.alloc({n, proj.kv_rank()});
  Tensor k_pe = ctx.alloc({n, proj.rope_dim()});
  proj.latent(ctx, x, s.kv_normed, k_pe, s.stages);

  Tensor attn = ctx.alloc({n, heads, v_dim});
  s.lse = ctx.alloc_accum({n, heads});
  if (ctx.context_parallel()) {
    // The latent travels, each rank expands it (mla_context_parallel.h).
    const MlaAcrossRanks across(ctx, proj);
    s.visible = across.gather(s.kv_normed, k_pe);
    across.forward(s.visible, attn, s.lse, s.stages.q);
  } else if (blocked(ctx)) {
    // The latent is kept in place of the keys and values, expanded again in the backward.
    s.k_pe = std::move(k_pe);
    blocks(ctx, n).forward(s.kv_normed, s.k_pe, attn, s.lse, s.stages.q);
  } else {
    s.k = ctx.alloc({n, heads, qk});
    s.v = ctx.alloc({n, heads, v_dim});
    proj.keys_values(ctx, s.k, s.v, s.kv_normed, k_pe);
    be.attention_forward(AttentionArgs{attn, s.lse, s.stages.q, s.k, s.v, ctx.batch.cu_seqlens, proj.softmax_scale()});
  }
  proj.output(ctx, out, std::move(attn), x, s.stages);
}

void MlaAttention::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  const int64_t heads = proj.heads(), qk = proj.qk_dim(), v_dim = proj.v_dim();
  Saved& s = saved_;

  Tensor dattn = ctx.alloc({n, heads, v_dim});
  proj.output_backward(ctx, dattn, dout, s.stages);
  Tensor dq = ctx.alloc({n, heads, qk});
  Tensor dkv_normed = ctx.alloc({n, proj.kv_rank()});
  Tensor dk_pe = ctx.alloc({n, proj.rope_dim()});
  if (ctx.context_parallel()) {
    MlaAcrossRanks(ctx, proj).backward(s.visible, dq, dkv_normed, dk_pe, dattn, s.stages.q, s.stages.attn, s.lse);
  } else if (blocked(ctx)) {
    blocks(ctx, n).backward(s.kv_normed, s.k_pe, dq, dkv_normed, dk_pe, dattn, s.stages.q, s.stages.attn, s.lse);
  } else {
    Tensor dk = ctx.alloc({n, heads, qk});
    Tensor dv = ctx.alloc({n, heads, v_dim});
    be.attention_backward(AttentionBackwardArgs{dq, dk, dv, dattn, s.stages.q, s.k, s.v, s.stages.attn, s.lse,
                                                ctx.batch.cu_seqlens, proj.softmax_scale()});
    proj.keys_values_backward(ctx, dkv_normed, dk_pe, dk, dv, s.kv_normed);
  }
  proj.latent_backward(ctx, dx, dkv_normed, dk_pe, x, s.stages);
  proj.queries_backward(ctx, dx, dq, x, s.stages);
  proj.gate_input_backward(ctx, dx, x, s.stages);
}

void MlaAttention::release_saved() { saved_ = Saved{}; }

}  // namespace moetrain
