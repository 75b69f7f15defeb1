// The backend-neutral op interface. No CUDA types here: host code (core/, apps/) builds
// without nvcc and calls every op through a `Backend`.
//
// kernels/cpu implements every op plainly, templated on float/double: that implementation
// is the spec, checked by finite differences in double. kernels/cuda implements the same ops
// and is tested against the CPU one. A layer (MLA, KDA, DSA, MoE, ...) is composed from these
// ops in core/model; a new mixer adds its ops here, never a side channel. The argument structs of
// two families live in their own headers, included below: kernels/dsa_ops.h (DSA and the
// attention output gate) and kernels/vision_ops.h (the vision tower).
//
// Conventions
// - Tensors are row-major and contiguous. Activations are [tokens, ...] with the batch's
//   sequences laid end to end ("packed"); `cu_seqlens` ([num_seqs + 1] int32 prefix sums)
//   marks the segments that attention, convolutions and recurrent state must not cross.
// - Compute dtype: F32 or F64 on the CPU (every operand of one call has the same dtype, except
//   integer indices). On CUDA, two classes of operand:
//     activations and frozen weights: BF16 (F32 also accepted, for tests and sensitive spots;
//     frozen weights also as MXFP4 or FP8 codes with their scales where an op says so);
//     "accumulation" operands: F32 always: LoRA parameters and all gradients of parameters,
//     Adam moments, saved statistics (rstd, lse), router logits/scores/top-k weights and their
//     gradients, aux and cross-entropy losses, cos/sin tables.
//   Every op accumulates in F32. gemm/grouped_gemm take each of a, b, c as BF16 or F32
//   independently; an F32 input operand is rounded to BF16 before the tensor-core product (as
//   autocast does), c is written in its own dtype. Elementwise ops take BF16 or F32 for each
//   activation operand independently (e.g. moe_combine: rows BF16, weight F32, out BF16).
// - Gradients are `d`-prefixed. Unless an argument says `accumulate`, a backward op
//   overwrites (`=`) its gradient outputs. Nothing uses atomics for gradient sums: every
//   backward is deterministic.
// - Statistics saved for backward (rstd, lse) use the accumulation dtype: F64 when the
//   compute dtype is F64, otherwise F32.
// - An optional operand ("may be empty") is left out by passing a default TensorView
//   (data == nullptr).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/base/tensor.h"
#include "kernels/dsa_ops.h"
#include "kernels/vision_ops.h"

namespace moetrain::kernels {

// ---------------------------------------------------------------------------------------------
// Argument structs: an op with more than about five parameters, or any flag, takes a struct

// c[m, n] = alpha * op(a) . op(b) + beta * c, with op(x) = x or x^T; all row-major 2-D.
struct GemmArgs {
  TensorView c;
  TensorView a;
  TensorView b;
  bool transpose_a = false;
  bool transpose_b = false;
  double alpha = 1.0;
  double beta = 0.0;
};

// gemm with b in FP8 with 128 x 128 block scales (frozen DeepSeek-V3 / Kimi K2 weights as shipped;
// kernels/fp8_format.h has the format): product.b is U8 E4M3 codes in its stored shape
// [rows_b, cols_b] (HF's [out, in] weight: transpose_b for x W^T, not for the input gradient dy W)
// and b_scale F32 [ceil(rows_b / 128), ceil(cols_b / 128)]. The result is the gemm of the
// dequantized b, each value code x scale rounded once to the compute dtype (BF16 on CUDA), with
// F32 accumulation. The weight is frozen: there is no weight gradient.
struct GemmFp8Args {
  GemmArgs product;
  TensorView b_scale;
};

// A grouped GEMM over row groups, the MoE expert layout (tokens sorted by expert).
// group_offsets: int32 [G + 1] prefix sums of rows per group, on the backend's device.
//  kMGrouped: for each g, c[rows_g, :] = alpha * a[rows_g, :] . op(b[g]) + beta * c[rows_g, :]
//             b is [G, n, k] with transpose_b (expert weights as HF stores them: [out, in]),
//             or [G, k, n] without.
//  kKGrouped: for each g, c[g] = alpha * a[rows_g, :]^T . b[rows_g, :] + beta * c[g]
//             (weight gradients: a = dy [rows, n_out], b = x [rows, n_in], c [G, n_out, n_in]).
enum class GroupedGemmKind { kMGrouped, kKGrouped };
struct GroupedGemmArgs {
  GroupedGemmKind kind = GroupedGemmKind::kMGrouped;
  TensorView c;
  TensorView a;
  TensorView b;
  TensorView group_offsets;
  // Optional: group_offsets' values on the host (the caller's copy, [groups + 1]), checked as
  // prefix sums when given; they must equal the device values (the CPU backend checks that they
  // do). The CUDA backend reads the offsets on the device and never waits for them.
  const int32_t* host_group_offsets = nullptr;
  bool transpose_b = true;
  double alpha = 1.0;
  double beta = 0.0;
  // Optional (kMGrouped only): b in MXFP4 (frozen Kimi K3 experts; kernels/cpu/mxfp4.h has the
  // format), packed along its input dimension. b is then U8, two E2M1 codes per byte (the even
  // element in the low nibble), and b_scale U8 holds one E8M0 exponent per 32 elements:
  //   transpose_b:  b [G, n, k / 2], b_scale [G, n, k / 32]  (k % 32 == 0; HF's [out, in] weight)
  //   otherwise:    b [G, k, n / 2], b_scale [G, k, n / 32]  (n % 32 == 0; the same weight in dy W)
  // The product is that of the dequantized b (exact in BF16 short of overflow or subnormals).
  // An F32 b_scale instead says b is FP8 with 128 x 128 block scales (GemmFp8Args, per
  // group): b U8 E4M3 codes [G, n, k] (transpose_b) or [G, k, n], b_scale F32
  // [G, ceil(n / 128), ceil(k / 128)] or [G, ceil(k / 128), ceil(n / 128)].
  TensorView b_scale;
  // Optional (kMGrouped, b not MXFP4 or FP8): a second product summed into the same output,
  //   c[rows_g, :] = alpha * (a[rows_g, :] . op(b[g]) + a2[rows_g, :] . op(b2[g])) + beta * c[rows_g, :]
  // with a2 [rows, k2] and b2 [G, n, k2] (transpose_b) or [G, k2, n]: a LoRA term (x A^T) B^T
  // folded into the base weight's GEMM as k2 more inner terms, instead of a pass of its own over c.
  TensorView a2;
  TensorView b2;
};

// The random initialisation of frozen MXFP4 weights (Kimi K3's experts: 33B values per layer, too
// many to make and quantize on the host): codes [..., cols / 2] and scales [..., cols / 32] (U8,
// the format of GroupedGemmArgs::b_scale; leading dimensions fold into rows) receive the MXFP4
// quantization (kernels/mxfp4_format.h, mxfp4_quantize) of the uniform weights
//   w[r, c] = uniform_weight(seed + first_element + r * cols + c, half_width)   (core/base/random.h),
// the same bytes on every backend.
struct RandomMxfp4Args {
  TensorView codes;
  TensorView scales;
  uint64_t seed = 0;
  uint64_t first_element = 0;
  double half_width = 0.0;
};

// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), per row of length `dim`.
struct RmsNormArgs {
  TensorView y;     // [rows, dim]
  TensorView rstd;  // [rows], saved for backward
  TensorView x;     // [rows, dim]
  TensorView weight;  // [dim]
  double eps = 1e-6;
};
struct RmsNormBackwardArgs {
  TensorView dx;       // [rows, dim]; `accumulate` adds into it (residual stream)
  TensorView dweight;  // [dim], optional (frozen norms pass an empty view)
  TensorView dy;
  TensorView x;
  TensorView weight;
  TensorView rstd;
  bool accumulate = false;
};

// Rotary embedding on columns [col_offset, col_offset + rope_dim) of each row of `x`
// ([tokens * heads, row_width]); row r belongs to token r / heads, at position positions[token].
// cos/sin: [max_position, rope_dim / 2] tables (YaRN scaling already folded in by the host).
// Layout kInterleaved is DeepSeek's: the input pairs (x[2i], x[2i+1]) are rotated by angle i
// and written de-interleaved, out[i] and out[i + rope_dim/2] (as transformers does).
// kAdjacent rotates the same pairs and writes them back in place (torch.view_as_complex: the
// vision tower's 2-D RoPE, whose table has a row per token). kHalfSplit pairs x[i], x[i + half].
// `inverse` rotates by the negative angle and undoes the layout: that is the backward.
// In place when out and x are the same tensor.
enum class RopeLayout { kInterleaved, kHalfSplit, kAdjacent };
struct RopeArgs {
  TensorView out;
  TensorView x;
  TensorView positions;  // int32 [tokens]
  TensorView cos;
  TensorView sin;
  int64_t heads = 1;
  int64_t col_offset = 0;
  int64_t rope_dim = 0;
  RopeLayout layout = RopeLayout::kInterleaved;
  bool inverse = false;
};

// Causal softmax attention within each segment of cu_seqlens. Per head h and query t:
// out[t, h] = sum_s softmax_s(scale * q[t, h] . k[s, h]) v[s, h], s <= t in t's segment.
// causal false: every s of t's segment (the vision tower's attention within each image).
// q, k: [tokens, heads, qk_dim]; v, out: [tokens, heads, v_dim]; lse: [tokens, heads],
// lse[t, h] = log sum_s exp(scale * q[t, h] . k[s, h]) (natural log, scale included).
// Softmax in fp32 (or f64) whatever the storage dtype.
// cu_seqlens_k, optional: the keys have tokens of their own (k, v: [k_tokens, heads, ...]) in as
// many segments as the queries, and each query segment is the last rows of its key segment
// (queries of a context-parallel shard against every key up to the shard's end): query i of a
// segment of q_len rows attends keys s <= i + k_len - q_len of its key segment (q_len <= k_len).
// key_shift, with cu_seqlens_k only: query row t attends the key rows s <= t + key_shift of its
// key segment instead (rows of this call; any q_len, k_len): one chunk of a shard's keys, a query
// seeing none of them getting out 0 and lse -inf; attention_merge folds the chunks together.
// (The CUDA backend runs such calls on its SIMT kernels, kernels/cuda/attention/attention.cu.)
constexpr int64_t kShiftFromSegments = INT64_MIN;
struct AttentionArgs {
  TensorView out;
  TensorView lse;
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView cu_seqlens;
  double scale = 1.0;
  TensorView cu_seqlens_k{};  // optional (see above)
  int64_t key_shift = kShiftFromSegments;  // see above
  bool causal = true;         // false: not with cu_seqlens_k
};
// dk, dv are shaped like k, v (with cu_seqlens_k, the keys' tokens). Over a chunk of the keys
// (key_shift) with the lse and out of all of them, P and D are the whole softmax's: dk, dv of the
// chunk's keys are exact, dq is the chunk's share (the chunks' dq sum to the whole).
struct AttentionBackwardArgs {
  TensorView dq;
  TensorView dk;
  TensorView dv;
  TensorView dout;
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView out;
  TensorView lse;
  TensorView cu_seqlens;
  double scale = 1.0;
  TensorView cu_seqlens_k{};  // optional (see AttentionArgs)
  int64_t key_shift = kShiftFromSegments;  // as AttentionArgs::key_shift
  bool causal = true;         // as AttentionArgs::causal
};
// Folds attention over more keys (chunk_out, chunk_lse) into (out, lse), by the log-sum-exp rule:
// lse' = log(exp(lse) + exp(chunk_lse)), out' = exp(lse - lse') out + exp(chunk_lse - lse') chunk_out;
// an lse of -inf (no keys yet) gives the other side whole. out, chunk_out: [tokens, heads, v_dim];
// lse, chunk_lse: [tokens, heads] accum.
struct AttentionMergeArgs {
  TensorView out;
  TensorView lse;
  TensorView chunk_out;
  TensorView chunk_lse;
};

// SwiGLU: h = silu(gate) * up; gate_up is [rows, 2 * width] with gate in the first half.
struct SwigluBackwardArgs {
  TensorView dgate_up;  // [rows, 2 * width]
  TensorView dh;        // [rows, width]
  TensorView gate_up;
};

// SiTU (Kimi K3's `hidden_act: situ`), a bounded SwiGLU: with gate_up = [g | u] per row,
//   h = beta * tanh(g / beta) * sigmoid(g) * v,   v = linear_beta * tanh(u / linear_beta)
// (v = u when linear_beta is 0, i.e. `activation_situ_linear_beta: null`). K3 ships beta 4 and
// linear_beta 25. The tanh caps keep the gate below beta and the up branch inside +-linear_beta.
struct SituArgs {
  TensorView h;        // [rows, width] out
  TensorView gate_up;  // [rows, 2 * width]
  double beta = 4.0;         // > 0
  double linear_beta = 0.0;  // > 0, or 0 for an unbounded up branch
};
struct SituBackwardArgs {
  TensorView dgate_up;  // [rows, 2 * width]; may alias gate_up
  TensorView dh;        // [rows, width]
  TensorView gate_up;
  double beta = 4.0;
  double linear_beta = 0.0;
};

// MoE routing (DeepSeek-V3 / Kimi): scores = sigmoid(logits) or softmax(logits);
// selection uses scores + bias (+ noise), restricted to the best `topk_groups` of `num_groups`
// expert groups (a group's score: the sum of its two best selection scores, for sigmoid and
// softmax alike, as transformers' DeepSeek-V3 and Kimi-Linear gates do); experts of the other
// groups are never chosen (transformers fills them with 0.0, which differs only when a kept
// expert's selection score is negative). Weights are the unbiased scores of the chosen experts,
// divided by (their sum + 1e-20) when `normalize`, times `scaling`. Ties go to the lower expert
// (and group) index.
enum class RouterScoring { kSigmoid, kSoftmax };
struct RouterArgs {
  TensorView scores;        // [tokens, experts] out, saved for backward
  TensorView topk_index;    // int32 [tokens, top_k] out, in descending selection score
  TensorView topk_weight;   // [tokens, top_k] out
  TensorView logits;        // [tokens, experts]
  TensorView bias;          // [experts] score-correction bias (selection only); may be empty
  TensorView noise;         // [tokens, experts] added to selection scores; may be empty
  RouterScoring scoring = RouterScoring::kSigmoid;
  int64_t top_k = 1;
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  bool normalize = true;
  double scaling = 1.0;
};
// dlogits from dtopk_weight (and dscores from the aux loss, if given: added before the
// scoring function's backward). Top-k selection itself has no gradient.
struct RouterBackwardArgs {
  TensorView dlogits;       // [tokens, experts]
  TensorView dtopk_weight;  // [tokens, top_k]
  TensorView dscores_extra; // [tokens, experts] or empty
  TensorView scores;
  TensorView topk_index;
  RouterScoring scoring = RouterScoring::kSigmoid;
  bool normalize = true;
  double scaling = 1.0;
};

// Auxiliary load-balancing loss over segments of `tokens_per_segment` tokens (one sequence:
// DeepSeek's sequence-wise loss; all tokens: the batch-wise switch loss):
//   L = coef * mean_segments sum_e f_e * P_e,
//   f_e = experts / (top_k * T) * #{t in segment: e chosen},  P_e = mean_t s'[t, e],
// with s' the scores normalised per token. dscores gets dL/dscores (the count f is constant).
struct AuxLossArgs {
  TensorView loss;     // [1] out, the compute dtype
  TensorView dscores;  // [tokens, experts] out
  TensorView scores;
  TensorView topk_index;
  int64_t tokens_per_segment = 0;
  double coef = 0.0;
};

// Stable sort of the (token, slot) pairs of a top-k assignment by expert, for the grouped GEMM:
// sorted_pair[p] = t * top_k + j of the p-th row in expert order (ties in token order);
// pair_row[t * top_k + j] = that pair's row; expert_offsets [experts + 1] prefix sums.
struct MoePermutationArgs {
  TensorView expert_offsets;  // int32 [experts + 1]
  TensorView sorted_pair;     // int32 [tokens * top_k]
  TensorView pair_row;        // int32 [tokens * top_k]
  TensorView topk_index;      // int32 [tokens, top_k]
  int64_t num_experts = 0;
};

// out[t, :] = sum_j weight[t, j] * rows[pair_row[t * top_k + j], :]
struct MoeCombineArgs {
  TensorView out;        // [tokens, dim]
  TensorView rows;       // [tokens * top_k, dim] expert outputs in expert order
  TensorView weight;     // [tokens, top_k]
  TensorView pair_row;
};
struct MoeCombineBackwardArgs {
  TensorView drows;      // [tokens * top_k, dim]
  TensorView dweight;    // [tokens, top_k]
  TensorView dout;       // [tokens, dim]
  TensorView rows;
  TensorView weight;
  TensorView pair_row;
};

// Cross-entropy on a chunk of rows: loss[r] = logsumexp(logits[r]) - logits[r, label[r]],
// dlogits[r] = (softmax(logits[r]) - onehot(label[r])) * grad_scale. Rows with label < 0 are
// not targets: loss 0, gradient 0. Labels >= vocab are a bug upstream (checked on the host).
// dlogits may alias logits (the chunk's logits are not needed afterwards).
struct CrossEntropyArgs {
  TensorView loss;     // [rows] out
  TensorView dlogits;  // [rows, vocab] out
  TensorView logits;   // [rows, vocab]
  TensorView labels;   // int32 [rows]
  double grad_scale = 1.0;
};

// Decoupled-weight-decay Adam (Loshchilov & Hutter) with bias correction, in place.
struct AdamWArgs {
  TensorView param;
  TensorView grad;
  TensorView exp_avg;
  TensorView exp_avg_sq;
  double lr = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1-based, for bias correction
};

// dst[r, dst_col + c] (+)= src[r / src_row_repeat, src_col + c] for c < cols: splitting and
// concatenating head parts (MLA's nope/rope halves) and broadcasting a shared part over heads.
struct CopyColumnsArgs {
  TensorView dst;
  TensorView src;
  int64_t dst_col = 0;
  int64_t src_col = 0;
  int64_t cols = 0;
  int64_t src_row_repeat = 1;
  bool accumulate = false;
};

// A rectangle of each matrix of a batch, scaled: for b < batch, i < rows, j < cols,
//   dst[b, dst_row + i, dst_col + j] (+)= alpha * src[b, src_row + i, src_col + j]
// dst [batch, dst_rows, dst_width] and src [batch, src_rows, src_width] (3-D views). Packs the
// adapters of several projections into one block-diagonal adapter for a single GEMM (and takes
// the blocks' gradients back out); on CUDA dst and src may differ in dtype (F32 <-> BF16, rounded
// to nearest even), on the CPU they share one.
struct CopyBlockArgs {
  TensorView dst;
  TensorView src;
  int64_t dst_row = 0, dst_col = 0;
  int64_t src_row = 0, src_col = 0;
  int64_t rows = 0, cols = 0;
  double alpha = 1.0;
  bool accumulate = false;
};

// ---------------------------------------------------------------------------------------------
// KDA (Kimi Delta Attention) and the ops around it. "accum" below is the accumulation dtype
// (F32 on CUDA, F64 when computing in F64 on the CPU). Activations: BF16 or F32 on CUDA.

// Causal depthwise convolution over time (width W = weight.size(1)) within each segment, zero
// history at a segment start, then SiLU when `silu`:
//   y[t, c] = act(sum_{i < W} weight[c, i] * x[t - W + 1 + i, c])
// x, y: [tokens, channels]; weight: [channels, W] (HF's conv1d weight [C, 1, W] squeezed), frozen.
struct ShortConvArgs {
  TensorView y;
  TensorView x;
  TensorView weight;
  TensorView cu_seqlens;
  bool silu = true;
};
struct ShortConvBackwardArgs {
  TensorView dx;       // [tokens, channels], overwritten
  TensorView dweight;  // [channels, W], optional (frozen conv: empty)
  TensorView dy;
  TensorView x;
  TensorView weight;
  TensorView cu_seqlens;
  bool silu = true;
};

// y = x / sqrt(sum(x^2) + eps) per row of length dim = x.size(-1) (fla's / transformers' l2norm,
// eps inside the sqrt). inv_norm [rows] (accum) saved for backward.
struct L2NormArgs {
  TensorView y;
  TensorView inv_norm;
  TensorView x;
  double eps = 1e-6;
};
struct L2NormBackwardArgs {
  TensorView dx;  // overwritten
  TensorView dy;
  TensorView x;
  TensorView inv_norm;
};

// The KDA forget gate (log decay), per token t, head h, channel c; f is [tokens, heads * dim]:
//   lower_bound == 0 (Kimi-Linear): g = -exp(a_log[h]) * softplus(f[t, h, c] + dt_bias[h, c])
//   lower_bound <  0 (Kimi K3):     g = lower_bound * sigmoid(exp(a_log[h]) * (f[t, h, c] + dt_bias[h, c]))
// g: [tokens, heads, dim] accum. a_log [heads], dt_bias [heads * dim]: accum, frozen.
struct KdaGateArgs {
  TensorView g;
  TensorView f;
  TensorView a_log;
  TensorView dt_bias;
  double lower_bound = 0.0;
};
struct KdaGateBackwardArgs {
  TensorView df;  // [tokens, heads * dim], overwritten
  TensorView dg;  // accum
  TensorView f;
  TensorView a_log;
  TensorView dt_bias;
  double lower_bound = 0.0;
};

// The gated delta rule (Kimi Delta Attention), per segment and head, from a zero state
// S [k_dim, v_dim] at every segment start:
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   out_t = S_t^T (scale * q_t)
// i.e. decay S's rows by exp(g_t), then S += k_t (beta_t (v_t - S^T k_t))^T, then read with q.
// q, k: [tokens, heads, k_dim] (already L2-normalised by the caller); v, out: [tokens, heads, v_dim];
// g: [tokens, heads, k_dim] accum (<= 0); beta: [tokens, heads] accum. scale: k_dim^-0.5 in the models.
// For a sequence split across ranks (context parallelism), the first segment may continue a
// document from an earlier rank and the last may go on to a later one:
//   initial_state [heads, k_dim, v_dim] accum, optional: the first segment's starting S (else 0);
//   final_state   [heads, k_dim, v_dim] accum, optional output: the last segment's S after its
//                 last token.
struct KdaArgs {
  TensorView out;
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView g;
  TensorView beta;
  TensorView cu_seqlens;
  double scale = 1.0;
  TensorView initial_state{};  // optional (see above)
  TensorView final_state{};  // optional (see above)
};
// Every gradient overwritten (dg, dbeta accum). The backward recomputes what it needs from the inputs.
// With states: initial_state as in the forward; dfinal_state [heads, k_dim, v_dim] accum, optional:
// the gradient arriving at the last segment's final S (else 0); dinitial_state, optional output:
// the gradient of the first segment's starting S.
struct KdaBackwardArgs {
  TensorView dq;
  TensorView dk;
  TensorView dv;
  TensorView dg;
  TensorView dbeta;
  TensorView dout;
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView g;
  TensorView beta;
  TensorView cu_seqlens;
  double scale = 1.0;
  TensorView initial_state{};  // optional (see above)
  TensorView dfinal_state{};  // optional (see above)
  TensorView dinitial_state{};  // optional (see above)
};

// The KDA output norm (transformers' RMSNormGated with activation sigmoid), per row of dim:
//   y = x * rstd * weight * sigmoid(gate),  rstd = 1 / sqrt(mean(x^2) + eps)
// x, gate, y: [rows, dim]; weight [dim]; rstd [rows] accum saved for backward.
struct GatedRmsNormArgs {
  TensorView y;
  TensorView rstd;
  TensorView x;
  TensorView gate;
  TensorView weight;
  double eps = 1e-6;
};
struct GatedRmsNormBackwardArgs {
  TensorView dx;       // overwritten
  TensorView dgate;    // overwritten
  TensorView dweight;  // optional (frozen norm: empty)
  TensorView dy;
  TensorView x;
  TensorView gate;
  TensorView weight;
  TensorView rstd;
};

// ---------------------------------------------------------------------------------------------
// Block Attention Residuals (Kimi K3; arXiv 2603.15031): instead of adding every layer's output
// into one residual stream, a layer's input is a softmax mix over depth of the block summaries
// kept so far and the current block's partial sum. Per row t, over m values V_i (each [rows, dim]):
//   r_i = 1 / sqrt(mean_d V_i[t, d]^2 + eps)          (an RMSNorm without its weight: the key)
//   s_i = r_i * sum_d norm_weight[d] * query[d] * V_i[t, d]
//   p = softmax_i(s),   out[t] = sum_i p_i V_i[t]
// norm_weight is the mix's RMSNorm weight and query its [1, dim] projection (the layer's learned
// pseudo-query), both [dim] and frozen; scores, softmax and the weighted sum in fp32 (f64 on the
// CPU in double). probs [rows, m] (accum) is saved for the backward. out must not alias a value.
struct AttnResArgs {
  TensorView out;                  // [rows, dim]
  TensorView probs;                // [rows, m] accum
  std::vector<TensorView> values;  // m >= 1 (at most kMaxAttnResValues), each [rows, dim]
  TensorView norm_weight;          // [dim]
  TensorView query;                // [dim]
  double eps = 1e-5;
};
// dvalues[i] += dL/dV_i, with g_i = dout . V_i and ds_i = p_i (g_i - sum_j p_j g_j):
//   dV_i[d] += p_i dout[d] + ds_i r_i (norm_weight[d] query[d] - s_i r_i V_i[t, d] / dim)
// Each dvalues[i] is [rows, dim] in the activation or the accumulation dtype (the model keeps the
// block summaries' gradients in the latter: they gather one term from every later layer).
struct AttnResBackwardArgs {
  std::vector<TensorView> dvalues;
  TensorView dout;
  std::vector<TensorView> values;
  TensorView norm_weight;
  TensorView query;
  TensorView probs;
  double eps = 1e-5;
};
// The most values one mix may take (K3: 93 layers in blocks of 12 = 8 summaries + the partial sum).
constexpr int64_t kMaxAttnResValues = 32;

// ---------------------------------------------------------------------------------------------

// What running ops costs besides the kernels, for moetrain-bench and the training log. A backend
// without a device of its own (the CPU) reports zeros.
struct BackendStats {
  int64_t host_waits = 0;          // times the host waited for the device queue so far (synchronize,
                                   // copies to or from host memory, read-backs inside ops)
  int64_t device_allocations = 0;  // calls to the device's own allocator (cudaMalloc) so far
  size_t allocated_bytes = 0;      // tensor memory in use now
  size_t peak_bytes = 0;           // its peak since reset_peak_memory()
  size_t device_used_bytes = 0;    // what the device reports in use (contexts and libraries too)
  size_t device_total_bytes = 0;   // the device's memory
  double peak_bf16_flops = 0.0;    // datasheet dense BF16 FLOP/s of the device (MFU); 0: unknown
};

// A point in a backend's queue of work (a CUDA event on its stream). wait() returns once the work
// queued before the point is done: a host wait (BackendStats::host_waits) only when it is not done
// yet. On the CPU, whose ops complete before they return, it never waits.
class QueueEvent {
 public:
  virtual ~QueueEvent() = default;
  virtual void wait() = 0;
};
// The event of a backend whose ops complete before they return.
class DoneEvent final : public QueueEvent {
 public:
  void wait() override {}
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const char* name() const = 0;
  virtual Allocator& allocator() = 0;
  // Work is done when this returns (a no-op on the CPU).
  virtual void synchronize() = 0;
  // The device queue the ops run on, in order (a cudaStream_t on CUDA; null on the CPU, whose
  // ops complete before they return): communicators order their collectives against it.
  virtual void* stream() { return nullptr; }
  virtual BackendStats stats() { return {}; }
  virtual void reset_peak_memory() {}

  // Memory. copy: same dtype and element count, any devices. convert: dtype conversion
  // (e.g. bf16 weights to f32 compute), same device, same element count.
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  // Copies the host does not wait for, so that it can queue a whole step ahead of the device:
  // host memory taking part must come from pinned_allocator() (page-locked on CUDA), and the
  // host must not write a source or read a destination in it until an event recorded after the
  // copy (record_event()) has been waited for. On the CPU these are copy() and host memory, and
  // the copy is done when it returns.
  virtual Allocator& pinned_allocator() { return host_allocator(); }
  virtual void copy_async(const TensorView& dst, const TensorView& src) { copy(dst, src); }
  // An event after the work queued so far.
  virtual std::unique_ptr<QueueEvent> record_event() { return std::make_unique<DoneEvent>(); }
  // A second queue beside the ops' own, for copies that overlap the ops (the layer checkpoints'
  // offload to host, core/model/layer_checkpoints.h). side_copy_async is copy_async queued there
  // (the same rules on host memory); side_wait makes that queue wait for an event of the ops'
  // queue (record_event), record_side_event is an event after the side queue's copies, and
  // ops_wait makes the ops' queue wait for such an event. None of them waits on the host. Memory
  // the side queue touches is the caller's to keep alive until its event is waited for: the
  // allocators order reuse against the ops' queue only. On the CPU the copy is done on return
  // and the waits have nothing to wait for.
  virtual void side_copy_async(const TensorView& dst, const TensorView& src) { copy_async(dst, src); }
  virtual void side_wait(QueueEvent& ops_event) { ops_event.wait(); }
  virtual std::unique_ptr<QueueEvent> record_side_event() { return std::make_unique<DoneEvent>(); }
  virtual void ops_wait(QueueEvent& side_event) { side_event.wait(); }
  virtual void convert(const TensorView& dst, const TensorView& src) = 0;
  virtual void fill(const TensorView& dst, double value) = 0;
  // Random frozen MXFP4 weights, made where they live (RandomMxfp4Args).
  virtual void random_mxfp4(const RandomMxfp4Args& args) = 0;

  // Elementwise: y = alpha * x + beta * y (same shapes).
  virtual void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) = 0;
  // Sum of squares of every element, accumulated in double in a fixed order (grad norms).
  virtual double sum_squares(const TensorView& x) = 0;
  virtual void copy_columns(const CopyColumnsArgs& args) = 0;
  virtual void copy_block(const CopyBlockArgs& args) = 0;
  // dst[t, :] = sum_h src[t, h, :]  (the backward of broadcasting over heads)
  virtual void sum_over_heads(const TensorView& dst, const TensorView& src) = 0;

  virtual void gemm(const GemmArgs& args) = 0;
  virtual void gemm_fp8(const GemmFp8Args& args) = 0;
  virtual void grouped_gemm(const GroupedGemmArgs& args) = 0;

  // out[t, :] = table[ids[t], :]; ids int32 [tokens], checked against the table's rows.
  virtual void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) = 0;
  // The same for ids the caller has already checked against the table's rows on the host (the
  // model checks every batch before uploading it): a backend may skip its own check, which on
  // CUDA reads the ids back and waits for the device. The CPU backend checks anyway.
  virtual void embedding_forward_checked_ids(const TensorView& out, const TensorView& table, const TensorView& ids) {
    embedding_forward(out, table, ids);
  }
  // dtable[ids[t], :] += dout[t, :], in token order (deterministic).
  virtual void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) = 0;

  virtual void rmsnorm_forward(const RmsNormArgs& args) = 0;
  virtual void rmsnorm_backward(const RmsNormBackwardArgs& args) = 0;

  virtual void rope(const RopeArgs& args) = 0;

  virtual void attention_forward(const AttentionArgs& args) = 0;
  virtual void attention_backward(const AttentionBackwardArgs& args) = 0;
  virtual void attention_merge(const AttentionMergeArgs& args) = 0;

  // h [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:]
  virtual void swiglu_forward(const TensorView& h, const TensorView& gate_up) = 0;
  virtual void swiglu_backward(const SwigluBackwardArgs& args) = 0;
  // SiTU (SituArgs above): the same [rows, 2 * width] -> [rows, width] layout as SwiGLU.
  virtual void situ_forward(const SituArgs& args) = 0;
  virtual void situ_backward(const SituBackwardArgs& args) = 0;

  virtual void router_forward(const RouterArgs& args) = 0;
  virtual void router_backward(const RouterBackwardArgs& args) = 0;
  virtual void aux_loss(const AuxLossArgs& args) = 0;

  virtual void moe_permutation(const MoePermutationArgs& args) = 0;
  // out[p, :] = x[sorted_pair[p] / top_k, :]   (gather tokens into expert order)
  virtual void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                           int64_t top_k) = 0;
  // dx[t, :] (+)= sum_j drows[pair_row[t * top_k + j], :]   (the permute's backward, in fixed order)
  virtual void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row,
                                 int64_t top_k, bool accumulate) = 0;
  virtual void moe_combine(const MoeCombineArgs& args) = 0;
  virtual void moe_combine_backward(const MoeCombineBackwardArgs& args) = 0;

  virtual void cross_entropy(const CrossEntropyArgs& args) = 0;
  virtual void adamw(const AdamWArgs& args) = 0;

  // KDA (the structs above say what each computes).
  virtual void short_conv_forward(const ShortConvArgs& args) = 0;
  virtual void short_conv_backward(const ShortConvBackwardArgs& args) = 0;
  virtual void l2norm_forward(const L2NormArgs& args) = 0;
  virtual void l2norm_backward(const L2NormBackwardArgs& args) = 0;
  virtual void kda_gate_forward(const KdaGateArgs& args) = 0;
  virtual void kda_gate_backward(const KdaGateBackwardArgs& args) = 0;
  virtual void kda_forward(const KdaArgs& args) = 0;
  virtual void kda_backward(const KdaBackwardArgs& args) = 0;
  virtual void gated_rmsnorm_forward(const GatedRmsNormArgs& args) = 0;
  virtual void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) = 0;
  // y = sigmoid(x) elementwise (KDA's beta); backward dx = dy * y * (1 - y). dx may alias dy.
  virtual void sigmoid_forward(const TensorView& y, const TensorView& x) = 0;
  virtual void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) = 0;

  // DSA and the attention output gate (the structs above say what each computes).
  virtual void layernorm_forward(const LayerNormArgs& args) = 0;
  virtual void dsa_indexer_topk(const DsaIndexerArgs& args) = 0;
  virtual void sparse_attention_forward(const SparseAttentionArgs& args) = 0;
  virtual void sparse_attention_backward(const SparseAttentionBackwardArgs& args) = 0;
  virtual void attention_gate_forward(const AttentionGateArgs& args) = 0;
  virtual void attention_gate_backward(const AttentionGateBackwardArgs& args) = 0;

  // Block Attention Residuals' depth mix (AttnResArgs above).
  virtual void attn_res_forward(const AttnResArgs& args) = 0;
  virtual void attn_res_backward(const AttnResBackwardArgs& args) = 0;

  // The vision tower and projector (kernels/vision_ops.h says what each computes).
  virtual void gelu_forward(const GeluArgs& args) = 0;
  virtual void gelu_backward(const GeluBackwardArgs& args) = 0;
  virtual void vision_pos_embed(const VisionPosEmbedArgs& args) = 0;
  virtual void patch_merge(const PatchMergeArgs& args) = 0;
};

// The CPU reference backend (always built).
std::unique_ptr<Backend> make_cpu_backend();

// The CUDA backend on the current device (only in builds with MOETRAIN_HAVE_CUDA; callers
// guard with it). Work is queued on the backend's own stream; copies to or from host tensors
// synchronize it (copy_async ones do not).
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace moetrain::kernels
