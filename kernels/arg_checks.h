// Argument checks: the pieces of the ops' contracts (kernels/op_contracts.cpp, which both
// backends' entry points call) and of the launchers' own checks. A failed check is a bug in the
// caller: Error(kInternal) naming the op, the argument and its shape. Where tensors live and which
// dtypes they have is each backend's OperandRules (kernels/op_contracts.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/base/tensor.h"
#include "kernels/ops.h"

namespace moetrain::kernels {

[[noreturn]] inline void fail(const char* op, const std::string& what) {
  throw Error(ExitCode::kInternal, std::string("kernel argument: ") + op + ": " + what);
}

inline void expect(bool condition, const char* op, const std::string& what) {
  if (!condition) fail(op, what);
}

// An optional operand is given when it has memory.
inline bool given(const TensorView& t) { return t.data != nullptr; }

inline std::string describe(const char* name, const TensorView& t) {
  return std::string(name) + " " + t.shape.str() + " " + dtype_name(t.dtype);
}

// On `device`, with memory unless it has no elements.
inline void expect_on(const char* op, const char* name, const TensorView& t, Device device) {
  expect(t.device == device, op,
         std::string(name) + " is on " + device_name(t.device) + ", not " + device_name(device));
  expect(t.data != nullptr || t.numel() == 0, op, std::string(name) + " " + t.shape.str() + " has no data");
}

inline void expect_dtype_is(const char* op, const char* name, const TensorView& t, DType dtype) {
  expect(t.dtype == dtype, op, std::string(name) + " is " + dtype_name(t.dtype) + ", expected " + dtype_name(dtype));
}

inline void expect_shape(const char* op, const char* name, const TensorView& t, const Shape& shape) {
  expect(t.shape == shape, op, describe(name, t) + ", expected shape " + shape.str());
}

inline void expect_numel(const char* op, const char* name, const TensorView& t, int64_t numel) {
  expect(t.numel() == numel, op,
         describe(name, t) + " has " + std::to_string(t.numel()) + " elements, expected " + std::to_string(numel));
}

inline void expect_ndim(const char* op, const char* name, const TensorView& t, int ndim) {
  expect(t.ndim() == ndim, op, describe(name, t) + " should have " + std::to_string(ndim) + " dimensions");
}

// Width and rows of a tensor read as [rows, last dim].
inline int64_t last_dim(const char* op, const char* name, const TensorView& t) {
  expect(t.ndim() >= 1, op, describe(name, t) + " needs at least one dimension");
  return t.size(-1);
}
inline int64_t rows_of(const TensorView& t) {
  const int64_t width = t.size(-1);
  return width == 0 ? 0 : t.numel() / width;
}

// int32 prefix sums on the host, p[0..count]: 0 first, non-decreasing, `total` last.
inline void expect_offsets(const char* op, const char* name, const int32_t* p, int64_t count, int64_t total) {
  expect(count >= 1, op, std::string(name) + " should be [groups + 1]");
  expect(p[0] == 0, op, std::string(name) + "[0] = " + std::to_string(p[0]) + ", expected 0");
  for (int64_t i = 1; i < count; ++i) {
    expect(p[i] >= p[i - 1], op, std::string(name) + " decreases at " + std::to_string(i));
  }
  expect(p[count - 1] == total, op,
         std::string(name) + " ends at " + std::to_string(p[count - 1]) + ", expected " + std::to_string(total));
}

// Shapes of the ops whose checks are the same on every backend (placement and dtypes are each
// backend's own).

// out/dout [tokens, dim] against table [rows, dim] and ids [tokens].
inline void expect_embedding_shapes(const char* op, const TensorView& rows_out, const TensorView& table,
                                    const TensorView& ids) {
  expect_ndim(op, "table", table, 2);
  expect(last_dim(op, "out", rows_out) == table.size(1) && rows_of(rows_out) == ids.numel(), op,
         describe("out", rows_out) + " should be [" + std::to_string(ids.numel()) + " tokens, " +
             std::to_string(table.size(1)) + "] for " + describe("table", table));
}

// q, k [tokens, heads, d_qk], v and out [tokens, heads, d_v], lse [tokens, heads].
// keys_own_tokens: k and v have tokens of their own (AttentionArgs::cu_seqlens_k).
inline void expect_attention_shapes(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& out, const TensorView& lse, bool keys_own_tokens = false) {
  expect_ndim(op, "q", q, 3);
  expect_ndim(op, "k", k, 3);
  expect_ndim(op, "v", v, 3);
  if (keys_own_tokens) {
    expect(k.size(1) == q.size(1) && k.size(2) == q.size(2), op,
           describe("k", k) + " and " + describe("q", q) + " differ in heads or head dim");
  } else {
    expect_shape(op, "k", k, q.shape);
  }
  expect(v.size(0) == k.size(0) && v.size(1) == q.size(1), op,
         describe("v", v) + " and " + describe("k", k) + " differ in tokens or heads");
  expect_shape(op, "out", out, Shape{q.size(0), q.size(1), v.size(2)});
  expect_numel(op, "lse", lse, q.size(0) * q.size(1));
}

// h [rows, width] against gate_up [rows, 2 * width].
inline void expect_swiglu_shapes(const char* op, const TensorView& h, const TensorView& gate_up) {
  const int64_t width = last_dim(op, "h", h);
  expect(last_dim(op, "gate_up", gate_up) == 2 * width && rows_of(gate_up) == rows_of(h), op,
         describe("gate_up", gate_up) + " should be [rows, 2 * width] for " + describe("h", h));
}

// SiTU's caps: beta > 0; linear_beta > 0, or 0 for an unbounded up branch.
inline void expect_situ_betas(const char* op, double beta, double linear_beta) {
  expect(beta > 0.0 && linear_beta >= 0.0, op,
         "beta " + std::to_string(beta) + " should be > 0 and linear_beta " + std::to_string(linear_beta) +
             " >= 0 (0: no cap)");
}

// Block Attention Residuals: `io` (out or dout) [rows, dim]; every value (and every gradient in
// `grads`, when given) [rows, dim]; probs [rows, m]; norm_weight and query [dim]. No value may be
// `io`'s memory (the forward writes out while it still reads the values).
inline void expect_attn_res_shapes(const char* op, const char* io_name, const TensorView& io,
                                   const std::vector<TensorView>& values, const std::vector<TensorView>* grads,
                                   const TensorView& probs, const TensorView& norm_weight, const TensorView& query) {
  const int64_t m = static_cast<int64_t>(values.size());
  expect(m >= 1 && m <= kMaxAttnResValues, op,
         std::to_string(m) + " values, expected 1.." + std::to_string(kMaxAttnResValues));
  expect(io.ndim() == 2, op, describe(io_name, io) + " should be [rows, dim]");
  const int64_t rows = io.size(0), dim = io.size(1);
  for (const TensorView& v : values) {
    expect_shape(op, "value", v, io.shape);
    expect(v.data != io.data || io.numel() == 0, op, std::string(io_name) + " is one of the values' memory");
  }
  if (grads != nullptr) {
    expect(grads->size() == values.size(), op,
           std::to_string(grads->size()) + " gradients for " + std::to_string(m) + " values");
    for (const TensorView& g : *grads) expect_shape(op, "dvalue", g, io.shape);
  }
  expect_shape(op, "probs", probs, Shape{rows, m});
  expect_shape(op, "norm_weight", norm_weight, Shape{dim});
  expect_shape(op, "query", query, Shape{dim});
}

// out [tokens, dim], rows [tokens * top_k, dim], weight [tokens, top_k], pair_row [tokens * top_k].
inline void expect_combine_shapes(const char* op, const TensorView& out, const TensorView& rows,
                                  const TensorView& weight, const TensorView& pair_row) {
  expect_ndim(op, "weight", weight, 2);
  const int64_t tokens = weight.size(0), top_k = weight.size(1);
  expect(out.ndim() >= 1 && out.size(0) == tokens, op, describe("out", out) + " for " + describe("weight", weight));
  expect(rows.ndim() >= 1 && rows.numel() * tokens == out.numel() * rows.size(0), op,
         describe("rows", rows) + " and " + describe("out", out) + " differ in row width");
  expect_numel(op, "pair_row", pair_row, tokens * top_k);
}

// MXFP4 b (GroupedGemmArgs::b_scale): M-grouped only; a [rows, k], c [rows, n], b and b_scale
// packed along b's input dimension (k with transpose_b, else n), a whole number of 32-groups.
inline void expect_random_mxfp4_shapes(const char* op, const RandomMxfp4Args& args) {
  expect_dtype_is(op, "codes", args.codes, DType::kU8);
  expect_dtype_is(op, "scales", args.scales, DType::kU8);
  const int64_t cols = 2 * last_dim(op, "codes", args.codes);
  expect(cols % 32 == 0, op, describe("codes", args.codes) + ": a row is not whole groups of 32 values");
  expect_numel(op, "scales", args.scales, args.codes.numel() * 2 / 32);
  expect(args.half_width >= 0.0, op, "half_width must not be negative");
}

inline void expect_grouped_gemm_mxfp4_shapes(const char* op, const GroupedGemmArgs& args, int64_t groups) {
  expect(args.kind == GroupedGemmKind::kMGrouped, op, "an MXFP4 b (b_scale given) is M-grouped only");
  expect_ndim(op, "a", args.a, 2);
  expect_ndim(op, "c", args.c, 2);
  const int64_t rows = args.a.size(0), k = args.a.size(1), n = args.c.size(1);
  expect(args.c.size(0) == rows, op, describe("c", args.c) + " and " + describe("a", args.a) + " differ in rows");
  const int64_t outer = args.transpose_b ? n : k, packed = args.transpose_b ? k : n;
  expect(packed % 32 == 0, op,
         std::string(args.transpose_b ? "k " : "n ") + std::to_string(packed) + " is not a multiple of 32 (MXFP4 groups)");
  expect_shape(op, "b", args.b, Shape{groups, outer, packed / 2});
  expect_shape(op, "b_scale", args.b_scale, Shape{groups, outer, packed / 32});
}

// FP8 b (GemmFp8Args, GroupedGemmArgs::b_scale F32): the codes have b's plain shape (checked
// with the op's other shapes), the scales one per 128 x 128 block of each matrix.
inline void expect_fp8_scale_shape(const char* op, const TensorView& b, const TensorView& b_scale) {
  Shape blocks = b.shape;
  const int64_t ndim = b.ndim();
  expect(ndim >= 2, op, describe("b", b) + ": an FP8 weight is a matrix (or one per group)");
  blocks[ndim - 2] = (b.shape[ndim - 2] + 127) / 128;
  blocks[ndim - 1] = (b.shape[ndim - 1] + 127) / 128;
  expect_shape(op, "b_scale", b_scale, blocks);
}

// a [rows, k]; M-grouped: b [groups, k, n] (or [groups, n, k] transposed), c [rows, n];
// K-grouped: b [rows, n], c [groups, k, n].
inline void expect_grouped_gemm_shapes(const char* op, const GroupedGemmArgs& args, int64_t groups) {
  expect(args.kind == GroupedGemmKind::kMGrouped || (!given(args.a2) && !given(args.b2)), op,
         "a second product (a2, b2) is for m-grouped GEMMs only");
  const bool fp8 = given(args.b_scale) && args.b_scale.dtype == DType::kF32;
  if (given(args.b_scale)) {
    expect(!given(args.a2) && !given(args.b2), op,
           std::string("a second product (a2, b2) next to an ") + (fp8 ? "FP8" : "MXFP4") + " b");
    if (!fp8) return expect_grouped_gemm_mxfp4_shapes(op, args, groups);
    expect(args.kind == GroupedGemmKind::kMGrouped, op, "an FP8 b (b_scale F32) is M-grouped only");
    expect_ndim(op, "b", args.b, 3);
    expect_fp8_scale_shape(op, args.b, args.b_scale);
  }
  expect_ndim(op, "a", args.a, 2);
  const int64_t rows = args.a.size(0);
  if (args.kind == GroupedGemmKind::kMGrouped) {
    expect_ndim(op, "b", args.b, 3);
    expect(args.b.size(0) == groups, op, describe("b", args.b) + " for " + std::to_string(groups) + " groups");
    const int64_t k = args.a.size(1);
    const int64_t k_b = args.transpose_b ? args.b.size(2) : args.b.size(1);
    const int64_t n = args.transpose_b ? args.b.size(1) : args.b.size(2);
    expect(k == k_b, op, describe("a", args.a) + " . " + describe("b", args.b) + ": inner dimensions differ");
    expect_shape(op, "c", args.c, Shape{rows, n});
    expect(given(args.a2) == given(args.b2), op, "a2 and b2 come together");
    if (given(args.a2)) {
      expect_ndim(op, "a2", args.a2, 2);
      const int64_t k2 = args.a2.size(1);
      const Shape b2_shape = args.transpose_b ? Shape{groups, n, k2} : Shape{groups, k2, n};
      expect(args.a2.size(0) == rows, op, describe("a2", args.a2) + " and " + describe("a", args.a) + " differ in rows");
      expect_shape(op, "b2", args.b2, b2_shape);
    }
  } else {
    expect_ndim(op, "b", args.b, 2);
    expect(args.b.size(0) == rows, op, describe("b", args.b) + " and " + describe("a", args.a) + " differ in rows");
    expect_shape(op, "c", args.c, Shape{groups, args.a.size(1), args.b.size(1)});
  }
}

// c [m, n] = op(a) [m, k] . op(b) [k, n].
inline void expect_gemm_shapes(const char* op, const GemmArgs& args) {
  expect_ndim(op, "c", args.c, 2);
  expect_ndim(op, "a", args.a, 2);
  expect_ndim(op, "b", args.b, 2);
  const int64_t m = args.transpose_a ? args.a.size(1) : args.a.size(0);
  const int64_t k = args.transpose_a ? args.a.size(0) : args.a.size(1);
  const int64_t k_b = args.transpose_b ? args.b.size(1) : args.b.size(0);
  const int64_t n = args.transpose_b ? args.b.size(0) : args.b.size(1);
  expect(k == k_b, op, describe("a", args.a) + (args.transpose_a ? "^T" : "") + " . " + describe("b", args.b) +
                           (args.transpose_b ? "^T" : "") + ": inner dimensions differ");
  expect_shape(op, "c", args.c, Shape{m, n});
}

// Column ranges inside both widths, and dst rows = src rows x src_row_repeat.
inline void expect_copy_columns_shapes(const char* op, const CopyColumnsArgs& args) {
  const int64_t dst_width = last_dim(op, "dst", args.dst), src_width = last_dim(op, "src", args.src);
  expect(args.cols >= 0 && args.dst_col >= 0 && args.src_col >= 0 && args.src_row_repeat >= 1, op,
         "negative cols/offsets or src_row_repeat < 1");
  expect(args.dst_col + args.cols <= dst_width, op,
         "dst columns [" + std::to_string(args.dst_col) + ", " + std::to_string(args.dst_col + args.cols) +
             ") exceed its width " + std::to_string(dst_width));
  expect(args.src_col + args.cols <= src_width, op,
         "src columns [" + std::to_string(args.src_col) + ", " + std::to_string(args.src_col + args.cols) +
             ") exceed its width " + std::to_string(src_width));
  expect(rows_of(args.dst) == rows_of(args.src) * args.src_row_repeat, op,
         describe("dst", args.dst) + " needs " + std::to_string(args.src_row_repeat) + " rows per row of " +
             describe("src", args.src));
}

// 3-D dst and src with one batch, the rectangle inside both.
inline void expect_copy_block_shapes(const char* op, const CopyBlockArgs& args) {
  expect_ndim(op, "dst", args.dst, 3);
  expect_ndim(op, "src", args.src, 3);
  expect(args.dst.size(0) == args.src.size(0), op,
         describe("dst", args.dst) + " and " + describe("src", args.src) + " differ in the batch dimension");
  expect(args.rows >= 0 && args.cols >= 0 && args.dst_row >= 0 && args.dst_col >= 0 && args.src_row >= 0 &&
             args.src_col >= 0,
         op, "negative rows/cols/offsets");
  auto inside = [&](const char* name, const TensorView& t, int64_t row, int64_t col) {
    expect(row + args.rows <= t.size(1) && col + args.cols <= t.size(2), op,
           std::string(name) + " block [" + std::to_string(row) + ", " + std::to_string(row + args.rows) + ") x [" +
               std::to_string(col) + ", " + std::to_string(col + args.cols) + ") exceeds " + describe(name, t));
  };
  inside("dst", args.dst, args.dst_row, args.dst_col);
  inside("src", args.src, args.src_row, args.src_col);
}

// The rotated columns inside x's width `width`, x [tokens * heads, width], cos = sin [positions, rope_dim / 2].
inline void expect_rope_shapes(const char* op, const RopeArgs& args, int64_t width) {
  expect(args.col_offset >= 0 && args.col_offset + args.rope_dim <= width, op,
         "columns [" + std::to_string(args.col_offset) + ", " + std::to_string(args.col_offset + args.rope_dim) +
             ") exceed " + describe("x", args.x));
  expect(args.heads >= 1 && rows_of(args.x) == args.positions.numel() * args.heads, op,
         describe("x", args.x) + " should have tokens * heads = " + std::to_string(args.positions.numel()) + " * " +
             std::to_string(args.heads) + " rows");
  expect_ndim(op, "cos", args.cos, 2);
  expect(args.cos.size(1) == args.rope_dim / 2, op, describe("cos", args.cos) + " should be [positions, rope_dim / 2]");
  expect_shape(op, "sin", args.sin, args.cos.shape);
}

// Group-limited top-k over `experts`: groups that divide them, top_k within the selected groups.
inline void expect_router_groups(const char* op, const RouterArgs& args, int64_t experts) {
  expect(args.num_groups >= 1 && experts % args.num_groups == 0, op,
         std::to_string(experts) + " experts do not split into " + std::to_string(args.num_groups) + " groups");
  expect(args.topk_groups >= 1 && args.topk_groups <= args.num_groups, op,
         "topk_groups " + std::to_string(args.topk_groups) + " not in [1, " + std::to_string(args.num_groups) + "]");
  expect(args.top_k >= 1 && args.top_k <= args.topk_groups * (experts / args.num_groups), op,
         "top_k " + std::to_string(args.top_k) + " exceeds the experts in the " + std::to_string(args.topk_groups) +
             " selected groups");
}

// KDA family (kernels/ops.h, the KDA section).

// x and `y_name` [tokens, channels], weight [channels, width >= 1].
inline void expect_short_conv_shapes(const char* op, const char* y_name, const TensorView& y, const TensorView& x,
                                     const TensorView& weight) {
  expect_ndim(op, "x", x, 2);
  expect_shape(op, y_name, y, x.shape);
  expect_ndim(op, "weight", weight, 2);
  expect(weight.size(0) == x.size(1) && weight.size(1) >= 1, op,
         describe("weight", weight) + " should be [channels, width >= 1] for " + describe("x", x));
}

// f [tokens, heads * dim], g [tokens, heads, dim], a_log [heads], dt_bias [heads * dim].
inline void expect_kda_gate_shapes(const char* op, const char* g_name, const TensorView& g, const TensorView& f,
                                   const TensorView& a_log, const TensorView& dt_bias, double lower_bound) {
  expect(lower_bound <= 0, op, "lower_bound " + std::to_string(lower_bound) + " must be <= 0 (0: no bound)");
  expect_ndim(op, g_name, g, 3);
  const int64_t tokens = g.size(0), heads = g.size(1), dim = g.size(2);
  expect_numel(op, "a_log", a_log, heads);
  expect_numel(op, "dt_bias", dt_bias, heads * dim);
  expect(last_dim(op, "f", f) == heads * dim && rows_of(f) == tokens, op,
         describe("f", f) + " should be [tokens, heads * dim] for " + describe(g_name, g));
}

// q, k, g [tokens, heads, k_dim]; v [tokens, heads, v_dim]; beta [tokens, heads].
inline void expect_kda_shapes(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& g, const TensorView& beta) {
  expect_ndim(op, "q", q, 3);
  expect_shape(op, "k", k, q.shape);
  expect_shape(op, "g", g, q.shape);
  expect_ndim(op, "v", v, 3);
  expect(v.size(0) == q.size(0) && v.size(1) == q.size(1), op,
         describe("v", v) + " and " + describe("q", q) + " differ in tokens or heads");
  expect_shape(op, "beta", beta, Shape{q.size(0), q.size(1)});
}

// x, gate and `y_name` [rows, dim]; weight [dim]; rstd [rows].
inline void expect_gated_rmsnorm_shapes(const char* op, const char* y_name, const TensorView& y, const TensorView& x,
                                        const TensorView& gate, const TensorView& weight, const TensorView& rstd) {
  const int64_t dim = last_dim(op, "x", x);
  expect_shape(op, "gate", gate, x.shape);
  expect_shape(op, y_name, y, x.shape);
  expect_numel(op, "weight", weight, dim);
  expect_numel(op, "rstd", rstd, rows_of(x));
}

// DSA family (kernels/ops.h, the DSA section).

// x and `y_name` [rows, dim]; weight and bias [dim].
inline void expect_layernorm_shapes(const char* op, const LayerNormArgs& args) {
  const int64_t dim = last_dim(op, "x", args.x);
  expect_shape(op, "y", args.y, args.x.shape);
  expect_numel(op, "weight", args.weight, dim);
  expect_numel(op, "bias", args.bias, dim);
}

// q [tokens, heads, dim], k [tokens, dim], weights [tokens, heads], topk_index [tokens, top_k].
inline void expect_dsa_indexer_shapes(const char* op, const DsaIndexerArgs& args) {
  expect_ndim(op, "q", args.q, 3);
  const int64_t tokens = args.q.size(0), heads = args.q.size(1), dim = args.q.size(2);
  const int64_t key_tokens = args.cu_seqlens_k.data != nullptr ? args.k.size(0) : tokens;
  expect_shape(op, "k", args.k, Shape{key_tokens, dim});
  expect_shape(op, "weights", args.weights, Shape{tokens, heads});
  expect(args.top_k >= 1, op, "top_k " + std::to_string(args.top_k) + " must be >= 1");
  expect_shape(op, "topk_index", args.topk_index, Shape{tokens, args.top_k});
}

// q [tokens, heads, qk_dim], kv [key_offset + tokens, qk_dim], `out_name` [tokens, heads,
// v_dim <= qk_dim], lse [tokens, heads], topk_index [tokens, top_k].
inline void expect_sparse_attention_shapes(const char* op, const TensorView& q, const TensorView& kv,
                                           const char* out_name, const TensorView& out, const TensorView& lse,
                                           const TensorView& topk_index, int64_t key_offset) {
  expect_ndim(op, "q", q, 3);
  const int64_t tokens = q.size(0), heads = q.size(1), qk_dim = q.size(2);
  expect(key_offset >= 0, op, "key_offset " + std::to_string(key_offset) + " must be >= 0");
  expect_shape(op, "kv", kv, Shape{key_offset + tokens, qk_dim});
  expect_ndim(op, out_name, out, 3);
  expect(out.size(0) == tokens && out.size(1) == heads && out.size(2) >= 1 && out.size(2) <= qk_dim, op,
         describe(out_name, out) + " should be [tokens, heads, v_dim <= qk_dim] for " + describe("q", q));
  expect_numel(op, "lse", lse, tokens * heads);
  expect_ndim(op, "topk_index", topk_index, 2);
  expect(topk_index.size(0) == tokens && topk_index.size(1) >= 1, op,
         describe("topk_index", topk_index) + " should be [tokens, top_k >= 1] for " + describe("q", q));
}

// x and `y_name` [tokens, heads, dim]; gate [tokens, heads] (headwise) or [tokens, heads * dim].
inline void expect_attention_gate_shapes(const char* op, const char* y_name, const TensorView& y, const TensorView& x,
                                         const TensorView& gate, bool headwise) {
  expect_ndim(op, "x", x, 3);
  expect_shape(op, y_name, y, x.shape);
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const Shape expected = headwise ? Shape{tokens, heads} : Shape{tokens, heads * dim};
  expect(gate.numel() == expected.numel() && rows_of(gate) == tokens, op,
         describe("gate", gate) + " should be " + expected.str() + (headwise ? " (headwise)" : " (elementwise)") +
             " for " + describe("x", x));
}

}  // namespace moetrain::kernels
