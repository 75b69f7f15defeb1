// DSA (DeepSeek Sparse Attention) and the attention output gate: their op arguments, part of the
// op interface of kernels/ops.h, which includes this file.
#pragma once

#include <cstdint>

#include "core/base/tensor.h"

namespace moetrain::kernels {

// DSA (DeepSeek Sparse Attention, transformers `deepseek_v32`) and the attention output gate.
// A dsa layer is MLA whose queries each attend to top_k keys a "lightning indexer" picks:
//   indexer  q_I = wq_b(q latent) [tokens, Hi, di], k_I = LayerNorm(wk(x)) [tokens, di] (one key
//            per token, shared by the indexer heads), both rotated on their first rope columns;
//            w = weights_proj(x) [tokens, Hi]; I[t, s] = scale * sum_j w[t, j] relu(q_I[t, j] . k_I[s])
//   select   the top_k keys s <= t of t's segment by I[t, s]
//   attend   MLA in MQA ("absorbed") form over the selected keys only: every head's query is
//            mapped into the latent space (q_nope W_UK_h, then q_pe), and attends to ONE latent
//            row per token kv[s] = [rmsnorm(kv latent) | k_pe] shared by all heads, whose first
//            v_dim columns are also the value; the head's output is mapped back by W_UV_h.
//            Mathematically the same attention as transformers' expanded per-head k/v (whose
//            mask keeps only the selected keys); in this form the selected rows are shared by
//            every head of a query, which is what a fused kernel (FlashMLA's sparse decoding
//            shapes: qk_dim 576, v_dim 512) is built around.
// The indexer is frozen and top-k has no gradient: layernorm_forward and dsa_indexer_topk are
// forward only.

// LayerNorm per row of dim = x.size(-1) (the indexer key's k_norm, eps 1e-6 in DeepSeek-V3.2):
//   y = (x - mean(x)) * rstd * weight + bias,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
// x, y: [rows, dim]; weight, bias: [dim]. Forward only (see above). y may alias x.
struct LayerNormArgs {
  TensorView y;
  TensorView x;
  TensorView weight;
  TensorView bias;
  double eps = 1e-6;
};

// The lightning indexer's scores and causal top-k, per query t within its segment:
//   I[t, s] = scale * sum_j weights[t, j] * relu(q[t, j] . k[s])   for s <= t in t's segment
// (scale: DeepSeek-V3.2 folds di^-0.5 and Hi^-0.5 here.) topk_index[t] lists the rows s (rows of
// k, i.e. global token indices of this call) of the top_k highest I[t, s], ties going to the
// lower s, in ascending s; when t has fewer than top_k keys available (s from its segment start
// to t) it lists all of them, then -1. No T x T score matrix needs to exist.
// q: [tokens, heads, dim]; k: [tokens, dim]; weights: [tokens, heads] accum; topk_index: int32
// [tokens, top_k] out. Scores are computed in the accumulation dtype.
// cu_seqlens_k, optional: the keys have tokens of their own (k: [k_tokens, dim]) in segments
// paired with the queries' as AttentionArgs::cu_seqlens_k pairs them: query i of a segment of
// q_len rows scores keys s <= i + k_len - q_len of its key segment, and topk_index lists rows of
// k.
struct DsaIndexerArgs {
  TensorView topk_index;
  TensorView q;
  TensorView k;
  TensorView weights;
  TensorView cu_seqlens;
  int64_t top_k = 1;
  double scale = 1.0;
  TensorView cu_seqlens_k{};  // optional (see above)
  bool causal = true;         // false: not with cu_seqlens_k
};

// Sparse attention in MQA form over selected keys. Per query t and head h, with S(t) the
// entries of topk_index[t] that are >= 0:
//   out[t, h] = sum_{s in S(t)} softmax_s(scale * q[t, h] . kv[s]) kv[s, :v_dim]
//   lse[t, h] = log sum_{s in S(t)} exp(scale * q[t, h] . kv[s])   (natural log, scale included)
// q: [tokens, heads, qk_dim]; kv: [tokens, qk_dim], one row per token shared by every head, its
// first v_dim (<= qk_dim) columns the value; out: [tokens, heads, v_dim]; lse: [tokens, heads]
// accum; topk_index: int32 [tokens, top_k] as dsa_indexer_topk writes it (valid rows first, in
// strictly ascending order, each <= t + key_offset; then -1). S(t) empty: out 0, lse -inf. With
// S(t) every key s <= t of t's segment this is `attention_forward` on k = kv and v = kv[:, :v_dim]
// broadcast over heads. Softmax in fp32 (or f64).
// key_offset: query t's own key is row t + key_offset of kv (0 but for a context-parallel shard,
// whose kv also holds the keys before it; kv: [key_offset + tokens, qk_dim]).
struct SparseAttentionArgs {
  TensorView out;
  TensorView lse;
  TensorView q;
  TensorView kv;
  TensorView topk_index;
  double scale = 1.0;
  int64_t key_offset = 0;  // see above
};
// dq and dkv overwritten. dkv[s] gathers every (query, head) that selected s, both as a key
// (all qk_dim columns) and as a value (the first v_dim): with P recomputed from q, kv and lse,
// D[t, h] = dout[t, h] . out[t, h] and dS = P (dout . kv[s, :v_dim] - D):
//   dq[t, h] = scale * sum_s dS kv[s];  dkv[s] = sum_{t, h} scale * dS q[t, h] + P dout[t, h] (value columns)
struct SparseAttentionBackwardArgs {
  TensorView dq;
  TensorView dkv;
  TensorView dout;
  TensorView q;
  TensorView kv;
  TensorView out;
  TensorView lse;
  TensorView topk_index;
  double scale = 1.0;
  int64_t key_offset = 0;  // as SparseAttentionArgs::key_offset
};

// The attention output gate ("gated attention": Qwen3-Next, Kimi K3's gated MLA, the seed's
// gated DSA), applied to the attention output before o_proj:
//   elementwise: y[t, h, c] = x[t, h, c] * sigmoid(gate[t, h, c])   gate [tokens, heads * dim]
//   headwise:    y[t, h, c] = x[t, h, c] * sigmoid(gate[t, h])      gate [tokens, heads]
// x, y: [tokens, heads, dim]; gate: the pre-activation (a projection of the layer input). y may
// alias x.
struct AttentionGateArgs {
  TensorView y;
  TensorView x;
  TensorView gate;
  bool headwise = false;
};
// dx = dy * sigmoid(gate); dgate = dy * x * sigmoid'(gate), summed over c when headwise. Both
// overwritten; dx may alias dy.
struct AttentionGateBackwardArgs {
  TensorView dx;
  TensorView dgate;
  TensorView dy;
  TensorView x;
  TensorView gate;
  bool headwise = false;
};

}  // namespace moetrain::kernels
