#include "core/model/dsa.h"

#include "core/model/attention_context_parallel.h"
#include "core/model/fp8_storage.h"

namespace moetrain {

using kernels::CopyColumnsArgs;
using kernels::GemmArgs;
using kernels::SparseAttentionArgs;
using kernels::SparseAttentionBackwardArgs;

namespace {

// Head h's blocks of kv_b_proj's output rows (its weight [H (nope + v), r] and LoRA B alike):
// the nope rows of its key, then the v rows of its value.
TensorView key_rows(const TensorView& w, int64_t h, int64_t nope, int64_t v) {
  return w.slice_rows(h * (nope + v), h * (nope + v) + nope);
}
TensorView value_rows(const TensorView& w, int64_t h, int64_t nope, int64_t v) {
  return w.slice_rows(h * (nope + v) + nope, (h + 1) * (nope + v));
}

// c (=, or += with accumulate) alpha * op(a) . op(b).
void matmul(kernels::Backend& be, const TensorView& c, const TensorView& a, bool transpose_a, const TensorView& b,
            bool transpose_b, double alpha = 1.0, bool accumulate = false) {
  be.gemm(GemmArgs{c, a, b, transpose_a, transpose_b, alpha, accumulate ? 1.0 : 0.0});
}

// c = a . op(rows of the frozen kv_b_proj), in the weight's format.
void frozen_matmul(kernels::Backend& be, const TensorView& c, const TensorView& a, const FrozenRows& b,
                   bool transpose_b) {
  frozen_gemm(be, GemmArgs{c, a, b.weight, false, transpose_b, 1.0, 0.0}, b.scale);
}

// Head h's key or value rows of kv_b_proj's frozen weight (FP8 rows start whole 128-row blocks:
// DsaAttention keeps the weight in FP8 only when they do).
FrozenRows frozen_key_rows(const LoraLinear& kv_b, int64_t h, int64_t nope, int64_t v) {
  return frozen_rows(kv_b.weight, kv_b.weight_scale, h * (nope + v), h * (nope + v) + nope);
}
FrozenRows frozen_value_rows(const LoraLinear& kv_b, int64_t h, int64_t nope, int64_t v) {
  return frozen_rows(kv_b.weight, kv_b.weight_scale, h * (nope + v) + nope, (h + 1) * (nope + v));
}

}  // namespace

DsaAttention::DsaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
                           const RopeDeviceTables* rope)
    : proj(spec, layer, ctx, rope), indexer(spec, layer, ctx, rope) {
  // The absorbed products take kv_b_proj one head's key or value rows at a time: FP8 only when
  // those start whole 128-row blocks (DeepSeek-V3.2: 128 + 128 per head), else the working dtype
  // (an FP8 checkpoint's kv_b_proj is then dequantized at load).
  const MlaConfig& mla = spec.config.mla;
  const bool block_aligned = mla.qk_nope_head_dim % 128 == 0 && mla.v_head_dim % 128 == 0;
  if (proj.kv_b_proj.weight.dtype() == DType::kU8 && !block_aligned) {
    proj.kv_b_proj.weight = ctx.alloc(proj.kv_b_proj.weight.shape());
    proj.kv_b_proj.weight_scale = Tensor();
  }
}

void DsaAttention::collect_weights(std::vector<WeightSlot>& out) {
  proj.collect_weights(out);
  indexer.collect_weights(out);
}

void DsaAttention::absorb_queries(const LayerContext& ctx, const TensorView& q_abs, const TensorView& q) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = q.size(0), heads = proj.heads(), nope = proj.nope(), v = proj.v_dim(), r = proj.kv_rank();
  const int64_t qk = proj.qk_dim(), abs_dim = r + proj.rope_dim();
  const TensorView q_rows = q.reshaped({n, heads * qk});
  const TensorView abs_rows = q_abs.reshaped({n, heads * abs_dim});
  const LoraAdapter* lora = proj.kv_b_proj.lora.get();
  Tensor q_nope = ctx.alloc({n, nope});
  Tensor q_latent = ctx.alloc({n, r});
  for (int64_t h = 0; h < heads; ++h) {
    be.copy_columns(CopyColumnsArgs{q_nope, q_rows, 0, h * qk, nope, 1, false});
    frozen_matmul(be, q_latent, q_nope, frozen_key_rows(proj.kv_b_proj, h, nope, v), false);
    if (lora) {  // + s (q_nope B_K_h) A: the adapter's part of W_K_h, kept apart from the frozen weight
      Tensor u = ctx.alloc({n, lora->a.value.size(0)});
      matmul(be, u, q_nope, false, key_rows(lora->b.value, h, nope, v), false);
      matmul(be, q_latent, u, false, lora->a.value, false, lora->scale, true);
    }
    be.copy_columns(CopyColumnsArgs{abs_rows, q_latent, h * abs_dim, 0, r, 1, false});
  }
}

void DsaAttention::expand_values(const LayerContext& ctx, const TensorView& attn, const TensorView& o) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = o.size(0), heads = proj.heads(), nope = proj.nope(), v = proj.v_dim(), r = proj.kv_rank();
  const TensorView o_rows = o.reshaped({n, heads * r});
  const TensorView attn_rows = attn.reshaped({n, heads * v});
  const LoraAdapter* lora = proj.kv_b_proj.lora.get();
  Tensor o_head = ctx.alloc({n, r});
  Tensor value = ctx.alloc({n, v});
  for (int64_t h = 0; h < heads; ++h) {
    be.copy_columns(CopyColumnsArgs{o_head, o_rows, 0, h * r, r, 1, false});
    frozen_matmul(be, value, o_head, frozen_value_rows(proj.kv_b_proj, h, nope, v), true);
    if (lora) {  // + s (o A^T) B_V_h^T
      Tensor u = ctx.alloc({n, lora->a.value.size(0)});
      matmul(be, u, o_head, false, lora->a.value, true);
      matmul(be, value, u, false, value_rows(lora->b.value, h, nope, v), true, lora->scale, true);
    }
    be.copy_columns(CopyColumnsArgs{attn_rows, value, h * v, 0, v, 1, false});
  }
}

void DsaAttention::absorb_queries_backward(const LayerContext& ctx, const TensorView& dq, const TensorView& dq_abs,
                                           const TensorView& q, const TensorView& dweight) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = dq.size(0), heads = proj.heads(), nope = proj.nope(), v = proj.v_dim(), r = proj.kv_rank();
  const int64_t qk = proj.qk_dim(), abs_dim = r + proj.rope_dim();
  const TensorView dq_rows = dq.reshaped({n, heads * qk});
  const TensorView abs_rows = dq_abs.reshaped({n, heads * abs_dim});
  const LoraAdapter* lora = proj.kv_b_proj.lora.get();
  Tensor dq_latent = ctx.alloc({n, r});
  Tensor dq_nope = ctx.alloc({n, nope});
  Tensor q_nope = ctx.alloc({n, nope});
  for (int64_t h = 0; h < heads; ++h) {
    be.copy_columns(CopyColumnsArgs{dq_latent, abs_rows, 0, h * abs_dim, r, 1, false});
    frozen_matmul(be, dq_nope, dq_latent, frozen_key_rows(proj.kv_b_proj, h, nope, v), true);
    if (lora) {
      Tensor u = ctx.alloc({n, lora->a.value.size(0)});
      matmul(be, u, dq_latent, false, lora->a.value, true);
      matmul(be, dq_nope, u, false, key_rows(lora->b.value, h, nope, v), true, lora->scale, true);
      // d W_K_h = q_nope^T dq_latent
      be.copy_columns(CopyColumnsArgs{q_nope, q.reshaped({n, heads * qk}), 0, h * qk, nope, 1, false});
      matmul(be, key_rows(dweight, h, nope, v), q_nope, true, dq_latent, false);
    }
    be.copy_columns(CopyColumnsArgs{dq_rows, dq_nope, h * qk, 0, nope, 1, false});
  }
}

void DsaAttention::expand_values_backward(const LayerContext& ctx, const TensorView& d_o, const TensorView& dattn,
                                          const TensorView& o, const TensorView& dweight) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = o.size(0), heads = proj.heads(), nope = proj.nope(), v = proj.v_dim(), r = proj.kv_rank();
  const TensorView o_rows = o.reshaped({n, heads * r});
  const TensorView do_rows = d_o.reshaped({n, heads * r});
  const TensorView dattn_rows = dattn.reshaped({n, heads * v});
  const LoraAdapter* lora = proj.kv_b_proj.lora.get();
  Tensor dvalue = ctx.alloc({n, v});
  Tensor do_head = ctx.alloc({n, r});
  Tensor o_head = ctx.alloc({n, r});
  for (int64_t h = 0; h < heads; ++h) {
    be.copy_columns(CopyColumnsArgs{dvalue, dattn_rows, 0, h * v, v, 1, false});
    frozen_matmul(be, do_head, dvalue, frozen_value_rows(proj.kv_b_proj, h, nope, v), false);
    if (lora) {
      Tensor u = ctx.alloc({n, lora->a.value.size(0)});
      matmul(be, u, dvalue, false, value_rows(lora->b.value, h, nope, v), false);
      matmul(be, do_head, u, false, lora->a.value, false, lora->scale, true);
      // d W_V_h = dvalue^T o_h
      be.copy_columns(CopyColumnsArgs{o_head, o_rows, 0, h * r, r, 1, false});
      matmul(be, value_rows(dweight, h, nope, v), dvalue, true, o_head, false);
    }
    be.copy_columns(CopyColumnsArgs{do_rows, do_head, h * r, 0, r, 1, false});
  }
}

void DsaAttention::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0), heads = proj.heads(), rope = proj.rope_dim(), r = proj.kv_rank();
  const int64_t abs_dim = r + rope;
  Saved& s = saved_;

  proj.queries(ctx, x, s.stages);
  s.selected = indexer.select(ctx, x, s.stages.q_latent);

  // The shared latent rows [kv_normed | k_pe].
  Tensor kv_normed = ctx.alloc({n, r});
  Tensor k_pe = ctx.alloc({n, rope});
  proj.latent(ctx, x, kv_normed, k_pe, s.stages);
  s.kv = ctx.alloc({n, abs_dim});
  be.copy_columns(CopyColumnsArgs{s.kv, kv_normed, 0, 0, r, 1, false});
  if (rope > 0) be.copy_columns(CopyColumnsArgs{s.kv, k_pe, r, 0, rope, 1, false});

  // Queries in the latent space, then their rotary part as it is.
  s.q_abs = ctx.alloc({n, heads, abs_dim});
  absorb_queries(ctx, s.q_abs, s.stages.q);
  if (rope > 0) {
    be.copy_columns(CopyColumnsArgs{s.q_abs.view().reshaped({n * heads, abs_dim}),
                                    s.stages.q.view().reshaped({n * heads, proj.qk_dim()}), r, proj.nope(), rope, 1,
                                    false});
  }
  if (!proj.kv_b_proj.lora) s.stages.q.reset();  // only kv_b_proj's weight gradient reads q again

  s.o = ctx.alloc({n, heads, r});
  s.lse = ctx.alloc_accum({n, heads});
  if (ctx.context_parallel()) {
    // Each span's selection names rows of the latent rows it sees (up to its end), gathered from
    // every rank.
    const Tensor visible = gather_visible_rows(be, *ctx.context_group, *ctx.batch.context, s.kv);
    for (const SpanQueries& p : span_queries(be, *ctx.batch.context, ctx.context_group->rank())) {
      auto rows = [&](const Tensor& t) { return t.view().slice_rows(p.row, p.row + p.tokens); };
      be.sparse_attention_forward(SparseAttentionArgs{rows(s.o), rows(s.lse), rows(s.q_abs),
                                                      visible.view().slice_rows(p.key_from, p.key_to), rows(s.selected),
                                                      proj.softmax_scale(), p.key_to - p.key_from - p.tokens});
    }
  } else {
    be.sparse_attention_forward(SparseAttentionArgs{s.o, s.lse, s.q_abs, s.kv, s.selected, proj.softmax_scale()});
  }
  Tensor attn = ctx.alloc({n, heads, proj.v_dim()});
  expand_values(ctx, attn, s.o);
  proj.output(ctx, out, std::move(attn), x, s.stages);
}

void DsaAttention::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0), heads = proj.heads(), rope = proj.rope_dim(), r = proj.kv_rank();
  const int64_t abs_dim = r + rope, qk = proj.qk_dim();
  Saved& s = saved_;
  const LoraAdapter* lora = proj.kv_b_proj.lora.get();
  // The gradient of kv_b_proj's effective weight W + s B A, for its adapter.
  Tensor dweight;
  if (lora) dweight = ctx.alloc_accum(proj.kv_b_proj.weight.shape());

  Tensor dattn = ctx.alloc({n, heads, proj.v_dim()});
  proj.output_backward(ctx, dattn, dout, s.stages);
  Tensor d_o = ctx.alloc({n, heads, r});
  expand_values_backward(ctx, d_o, dattn, s.o, dweight);

  Tensor dq_abs = ctx.alloc({n, heads, abs_dim});
  Tensor dkv = ctx.alloc({n, abs_dim});
  if (ctx.context_parallel()) {
    // The latent rows as the forward gathered them; their gradient goes back to their owners.
    // Spans may see the same rows: their gradients add up.
    const Tensor visible = gather_visible_rows(be, *ctx.context_group, *ctx.batch.context, s.kv);
    Tensor dvisible = ctx.alloc(visible.shape());
    be.fill(dvisible, 0.0);
    for (const SpanQueries& p : span_queries(be, *ctx.batch.context, ctx.context_group->rank())) {
      auto rows = [&](const Tensor& t) { return t.view().slice_rows(p.row, p.row + p.tokens); };
      Tensor dseen = ctx.alloc({p.key_to - p.key_from, abs_dim});
      be.sparse_attention_backward(SparseAttentionBackwardArgs{
          rows(dq_abs), dseen, rows(d_o), rows(s.q_abs), visible.view().slice_rows(p.key_from, p.key_to), rows(s.o),
          rows(s.lse), rows(s.selected), proj.softmax_scale(), p.key_to - p.key_from - p.tokens});
      be.axpby(dvisible.view().slice_rows(p.key_from, p.key_to), dseen, 1.0, 1.0);
    }
    return_visible_gradient(be, *ctx.context_group, *ctx.batch.context, dvisible, dkv);
  } else {
    be.sparse_attention_backward(SparseAttentionBackwardArgs{dq_abs, dkv, d_o, s.q_abs, s.kv, s.o, s.lse, s.selected,
                                                             proj.softmax_scale()});
  }

  Tensor dq = ctx.alloc({n, heads, qk});
  absorb_queries_backward(ctx, dq, dq_abs, s.stages.q, dweight);
  if (rope > 0) {
    be.copy_columns(CopyColumnsArgs{dq.view().reshaped({n * heads, qk}), dq_abs.view().reshaped({n * heads, abs_dim}),
                                    proj.nope(), r, rope, 1, false});
  }
  if (lora) {
    // W + s B A: dB += s dW A^T, dA += s B^T dW.
    matmul(be, lora->b.grad, dweight, false, lora->a.value, true, lora->scale, true);
    matmul(be, lora->a.grad, lora->b.value, true, dweight, false, lora->scale, true);
  }

  Tensor dkv_normed = ctx.alloc({n, r});
  be.copy_columns(CopyColumnsArgs{dkv_normed, dkv, 0, 0, r, 1, false});
  Tensor dk_pe = ctx.alloc({n, rope});
  if (rope > 0) be.copy_columns(CopyColumnsArgs{dk_pe, dkv, 0, r, rope, 1, false});
  proj.latent_backward(ctx, dx, dkv_normed, dk_pe, x, s.stages);
  proj.queries_backward(ctx, dx, dq, x, s.stages);
  proj.gate_input_backward(ctx, dx, x, s.stages);
}

void DsaAttention::release_saved() { saved_ = Saved{}; }

}  // namespace moetrain
