// The ops' argument contracts (kernels/op_contracts.h). Operands are checked first, in the CPU
// reference's order (the CPU computes in the dtype of the first floating operand it meets, so the
// order decides which operand a dtype mismatch names), then shapes, then memory sharing.
#include "kernels/op_contracts.h"

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kernels/arg_checks.h"

namespace moetrain::kernels {

void OperandRules::placed(const char* op, const char* name, const TensorView& t) const {
  expect_on(op, name, t, device_);
}

void OperandRules::fixed_dtype(const char* op, const char* name, const TensorView& t, DType dtype) const {
  placed(op, name, t);
  expect_dtype_is(op, name, t, dtype);
}

namespace {

using Named = std::pair<const char*, const TensorView*>;

void activations(OperandRules& rules, const char* op, std::initializer_list<Named> operands) {
  for (const auto& [name, t] : operands) rules.activation(op, name, *t);
}
void accumulations(OperandRules& rules, const char* op, std::initializer_list<Named> operands) {
  for (const auto& [name, t] : operands) rules.accumulation(op, name, *t);
}

// An in-place call (the same memory for an output and an input) needs one dtype for both; ops.h
// lets activations differ in dtype otherwise.
void expect_alias_same_dtype(const char* op, const char* out_name, const TensorView& out, const char* in_name,
                             const TensorView& in) {
  expect(out.data != in.data || out.data == nullptr || out.dtype == in.dtype, op,
         describe(out_name, out) + " aliases " + describe(in_name, in) + " with another dtype");
}

void expect_distinct(const char* op, const TensorView& dst, const TensorView& src) {
  expect(dst.data != src.data || dst.data == nullptr, op, "dst and src are the same memory");
}

// The rows and the width that x, y, and the per-row statistic `stat_name` of a norm share.
void expect_norm_rows(const char* op, const TensorView& x, const char* y_name, const TensorView& y,
                      const char* stat_name, const TensorView& stat) {
  expect_shape(op, y_name, y, x.shape);
  expect_numel(op, stat_name, stat, rows_of(x));
}

// topk_index [tokens, *] of a router's tokens, its entries naming experts.
void expect_topk_rows(OperandRules& rules, const char* op, const TensorView& topk_index, int64_t tokens) {
  rules.fixed_dtype(op, "topk_index", topk_index, DType::kI32);
  expect_ndim(op, "topk_index", topk_index, 2);
  expect(topk_index.size(0) == tokens, op,
         describe("topk_index", topk_index) + " for " + std::to_string(tokens) + " tokens");
}

void expect_top_k(const char* op, int64_t top_k) { expect(top_k >= 1, op, "top_k " + std::to_string(top_k)); }

void check_combine(OperandRules& rules, const char* op, const TensorView& out, const TensorView& rows,
                   const TensorView& weight, const TensorView& pair_row) {
  rules.fixed_dtype(op, "pair_row", pair_row, DType::kI32);
  expect_combine_shapes(op, out, rows, weight, pair_row);
  rules.indices_below(op, "pair_row", pair_row, rows.size(0));
}

// SwiGLU and SiTU backward: dgate_up (which may overwrite gate_up) from dh and gate_up.
void check_gated_unit_backward(OperandRules& rules, const char* op, const TensorView& dgate_up, const TensorView& dh,
                               const TensorView& gate_up) {
  activations(rules, op, {{"dgate_up", &dgate_up}, {"dh", &dh}, {"gate_up", &gate_up}});
  expect_swiglu_shapes(op, dh, gate_up);
  expect_shape(op, "dgate_up", dgate_up, gate_up.shape);
  expect_alias_same_dtype(op, "dgate_up", dgate_up, "gate_up", gate_up);
}

// The operands both Attention Residuals passes read, `io` being out or dout.
void attn_res_operands(OperandRules& rules, const char* op, const char* io_name, const TensorView& io,
                       const TensorView& probs, const TensorView& norm_weight, const TensorView& query,
                       const std::vector<TensorView>& values) {
  rules.activation(op, io_name, io);
  rules.accumulation(op, "probs", probs);
  activations(rules, op, {{"norm_weight", &norm_weight}, {"query", &query}});
  for (const TensorView& v : values) rules.activation(op, "value", v);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Utilities

void check_convert(OperandRules& rules, const TensorView& dst, const TensorView& src) {
  const char* op = "convert";
  rules.placed(op, "dst", dst);
  rules.placed(op, "src", src);
  expect_numel(op, "src", src, dst.numel());
}

void check_fill(OperandRules& rules, const TensorView& dst) { rules.placed("fill", "dst", dst); }

void check_random_mxfp4(OperandRules& rules, const RandomMxfp4Args& args) {
  const char* op = "random_mxfp4";
  rules.placed(op, "codes", args.codes);
  rules.placed(op, "scales", args.scales);
  expect_random_mxfp4_shapes(op, args);
}

void check_axpby(OperandRules& rules, const TensorView& y, const TensorView& x) {
  const char* op = "axpby";
  activations(rules, op, {{"y", &y}, {"x", &x}});
  expect_numel(op, "x", x, y.numel());
  expect_alias_same_dtype(op, "y", y, "x", x);
}

void check_sum_squares(OperandRules& rules, const TensorView& x) { rules.activation("sum_squares", "x", x); }

void check_copy_columns(OperandRules& rules, const CopyColumnsArgs& args) {
  const char* op = "copy_columns";
  activations(rules, op, {{"dst", &args.dst}, {"src", &args.src}});
  expect_copy_columns_shapes(op, args);
  expect_distinct(op, args.dst, args.src);
}

void check_copy_block(OperandRules& rules, const CopyBlockArgs& args) {
  const char* op = "copy_block";
  activations(rules, op, {{"dst", &args.dst}, {"src", &args.src}});
  expect_copy_block_shapes(op, args);
  expect_distinct(op, args.dst, args.src);
}

void check_sum_over_heads(OperandRules& rules, const TensorView& dst, const TensorView& src) {
  const char* op = "sum_over_heads";
  activations(rules, op, {{"dst", &dst}, {"src", &src}});
  const int64_t dim = last_dim(op, "dst", dst);
  expect(last_dim(op, "src", src) == dim, op,
         describe("src", src) + " and " + describe("dst", dst) + " differ in the last dimension");
  const int64_t tokens = rows_of(dst);
  expect(tokens == 0 ? src.numel() == 0 : rows_of(src) % tokens == 0, op,
         describe("src", src) + " is not [tokens, heads, dim] for " + describe("dst", dst));
}

void check_gemm(OperandRules& rules, const GemmArgs& args) {
  const char* op = "gemm";
  activations(rules, op, {{"c", &args.c}, {"a", &args.a}, {"b", &args.b}});
  expect_gemm_shapes(op, args);
}

void check_gemm_fp8(OperandRules& rules, const GemmFp8Args& args) {
  const char* op = "gemm_fp8";
  const GemmArgs& p = args.product;
  activations(rules, op, {{"c", &p.c}, {"a", &p.a}});
  rules.fixed_dtype(op, "b", p.b, DType::kU8);
  rules.fixed_dtype(op, "b_scale", args.b_scale, DType::kF32);
  expect_gemm_shapes(op, p);
  expect_fp8_scale_shape(op, p.b, args.b_scale);
}

void check_grouped_gemm(OperandRules& rules, const GroupedGemmArgs& args) {
  const char* op = "grouped_gemm";
  activations(rules, op, {{"c", &args.c}, {"a", &args.a}});
  if (given(args.b_scale)) {  // an MXFP4 b (b_scale U8) or an FP8 one (F32; ops.h)
    rules.fixed_dtype(op, "b", args.b, DType::kU8);
    rules.fixed_dtype(op, "b_scale", args.b_scale, args.b_scale.dtype == DType::kF32 ? DType::kF32 : DType::kU8);
  } else {
    rules.activation(op, "b", args.b);
  }
  if (given(args.a2)) rules.activation(op, "a2", args.a2);
  if (given(args.b2)) rules.activation(op, "b2", args.b2);
  expect_ndim(op, "a", args.a, 2);
  rules.offsets(op, "group_offsets", args.group_offsets, args.a.size(0), "groups");
  expect_grouped_gemm_shapes(op, args, args.group_offsets.numel() - 1);
  if (args.host_group_offsets != nullptr) {
    rules.host_offsets(op, "group_offsets", args.host_group_offsets, args.group_offsets, args.a.size(0));
  }
}

// ---------------------------------------------------------------------------------------------
// Dense layers

void check_embedding_forward(OperandRules& rules, const char* op, const TensorView& out, const TensorView& table,
                             const TensorView& ids) {
  activations(rules, op, {{"out", &out}, {"table", &table}});
  rules.fixed_dtype(op, "ids", ids, DType::kI32);
  expect_embedding_shapes(op, out, table, ids);
}

void check_embedding_backward(OperandRules& rules, const TensorView& dtable, const TensorView& dout,
                              const TensorView& ids) {
  const char* op = "embedding_backward";
  activations(rules, op, {{"dtable", &dtable}, {"dout", &dout}});
  rules.fixed_dtype(op, "ids", ids, DType::kI32);
  expect_embedding_shapes(op, dout, dtable, ids);
}

void check_rmsnorm_forward(OperandRules& rules, const RmsNormArgs& args) {
  const char* op = "rmsnorm_forward";
  rules.activation(op, "y", args.y);
  rules.accumulation(op, "rstd", args.rstd);
  activations(rules, op, {{"x", &args.x}, {"weight", &args.weight}});
  expect_numel(op, "weight", args.weight, last_dim(op, "x", args.x));
  expect_norm_rows(op, args.x, "y", args.y, "rstd", args.rstd);
  expect_alias_same_dtype(op, "y", args.y, "x", args.x);
}

void check_rmsnorm_backward(OperandRules& rules, const RmsNormBackwardArgs& args) {
  const char* op = "rmsnorm_backward";
  activations(rules, op, {{"dx", &args.dx}, {"dy", &args.dy}, {"x", &args.x}, {"weight", &args.weight}});
  rules.accumulation(op, "rstd", args.rstd);
  const int64_t dim = last_dim(op, "x", args.x);
  expect_numel(op, "weight", args.weight, dim);
  expect_shape(op, "dx", args.dx, args.x.shape);
  expect_norm_rows(op, args.x, "dy", args.dy, "rstd", args.rstd);
  expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
  if (given(args.dweight)) {
    rules.accumulation(op, "dweight", args.dweight);
    expect_numel(op, "dweight", args.dweight, dim);
    // dweight is summed after dx is written, from dy and x (no rows: nothing to overwrite).
    expect((args.dx.data != args.dy.data && args.dx.data != args.x.data) || args.x.numel() == 0, op,
           "dx must not overwrite dy or x when dweight is wanted");
  }
}

void check_rope(OperandRules& rules, const RopeArgs& args, int64_t max_rope_dim) {
  const char* op = "rope";
  activations(rules, op, {{"out", &args.out}, {"x", &args.x}});
  accumulations(rules, op, {{"cos", &args.cos}, {"sin", &args.sin}});
  rules.fixed_dtype(op, "positions", args.positions, DType::kI32);
  expect_shape(op, "out", args.out, args.x.shape);
  expect_alias_same_dtype(op, "out", args.out, "x", args.x);
  const int64_t width = last_dim(op, "x", args.x);
  const bool capped = max_rope_dim > 0;
  expect(args.rope_dim > 0 && args.rope_dim % 2 == 0 && (!capped || args.rope_dim <= max_rope_dim), op,
         "rope_dim " + std::to_string(args.rope_dim) +
             (capped ? " must be positive, even and at most " + std::to_string(max_rope_dim)
                     : std::string(" must be positive and even")));
  expect_rope_shapes(op, args, width);
}

void check_rope(OperandRules& rules, const RopeArgs& args) { check_rope(rules, args, /*max_rope_dim=*/0); }

namespace {

// Keys with segments of their own (AttentionArgs::cu_seqlens_k): offsets over k's tokens, as many
// segments as the queries have.
void expect_key_segments(OperandRules& rules, const char* op, const TensorView& cu_seqlens,
                         const TensorView& cu_seqlens_k, const TensorView& k) {
  if (!given(cu_seqlens_k)) return;
  rules.offsets(op, "cu_seqlens_k", cu_seqlens_k, k.size(0), "key sequences");
  expect(cu_seqlens_k.numel() == cu_seqlens.numel(), op,
         describe("cu_seqlens_k", cu_seqlens_k) + " should have as many segments as " +
             describe("cu_seqlens", cu_seqlens));
}

}  // namespace

// key_shift moves the keys a query sees within its key segment, so it needs key segments.
void expect_key_shift(const char* op, const TensorView& cu_seqlens_k, int64_t key_shift) {
  expect(key_shift == kShiftFromSegments || given(cu_seqlens_k), op,
         "key_shift " + std::to_string(key_shift) + " is given without cu_seqlens_k (the keys' own segments)");
}

void check_attention_forward(OperandRules& rules, const AttentionArgs& args) {
  const char* op = "attention_forward";
  rules.activation(op, "out", args.out);
  rules.accumulation(op, "lse", args.lse);
  activations(rules, op, {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}});
  expect_attention_shapes(op, args.q, args.k, args.v, args.out, args.lse, given(args.cu_seqlens_k));
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0), "sequences");
  expect_key_segments(rules, op, args.cu_seqlens, args.cu_seqlens_k, args.k);
  expect(args.causal || !given(args.cu_seqlens_k), op, "a non-causal call takes no cu_seqlens_k");
  expect_key_shift(op, args.cu_seqlens_k, args.key_shift);
}

void check_attention_backward(OperandRules& rules, const AttentionBackwardArgs& args) {
  const char* op = "attention_backward";
  activations(rules, op,
              {{"dq", &args.dq}, {"dk", &args.dk}, {"dv", &args.dv}, {"dout", &args.dout}, {"q", &args.q},
               {"k", &args.k}, {"v", &args.v}, {"out", &args.out}});
  rules.accumulation(op, "lse", args.lse);
  expect_attention_shapes(op, args.q, args.k, args.v, args.out, args.lse, given(args.cu_seqlens_k));
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0), "sequences");
  expect_key_segments(rules, op, args.cu_seqlens, args.cu_seqlens_k, args.k);
  expect_shape(op, "dq", args.dq, args.q.shape);
  expect_shape(op, "dk", args.dk, args.k.shape);
  expect_shape(op, "dv", args.dv, args.v.shape);
  expect_shape(op, "dout", args.dout, args.out.shape);
  expect(args.causal || !given(args.cu_seqlens_k), op, "a non-causal call takes no cu_seqlens_k");
  expect_key_shift(op, args.cu_seqlens_k, args.key_shift);
}

void check_attention_merge(OperandRules& rules, const AttentionMergeArgs& args) {
  const char* op = "attention_merge";
  activations(rules, op, {{"out", &args.out}, {"chunk_out", &args.chunk_out}});
  accumulations(rules, op, {{"lse", &args.lse}, {"chunk_lse", &args.chunk_lse}});
  expect(args.out.ndim() == 3, op, describe("out", args.out) + " should be [tokens, heads, v_dim]");
  expect_shape(op, "chunk_out", args.chunk_out, args.out.shape);
  expect_shape(op, "lse", args.lse, Shape({args.out.size(0), args.out.size(1)}));
  expect_shape(op, "chunk_lse", args.chunk_lse, args.lse.shape);
}

void check_swiglu_forward(OperandRules& rules, const TensorView& h, const TensorView& gate_up) {
  const char* op = "swiglu_forward";
  activations(rules, op, {{"h", &h}, {"gate_up", &gate_up}});
  expect_swiglu_shapes(op, h, gate_up);
}

void check_swiglu_backward(OperandRules& rules, const SwigluBackwardArgs& args) {
  check_gated_unit_backward(rules, "swiglu_backward", args.dgate_up, args.dh, args.gate_up);
}

void check_attn_res_forward(OperandRules& rules, const AttnResArgs& args) {
  const char* op = "attn_res_forward";
  attn_res_operands(rules, op, "out", args.out, args.probs, args.norm_weight, args.query, args.values);
  expect_attn_res_shapes(op, "out", args.out, args.values, nullptr, args.probs, args.norm_weight, args.query);
}

void check_attn_res_backward(OperandRules& rules, const AttnResBackwardArgs& args) {
  const char* op = "attn_res_backward";
  attn_res_operands(rules, op, "dout", args.dout, args.probs, args.norm_weight, args.query, args.values);
  for (const TensorView& g : args.dvalues) rules.activation(op, "dvalue", g);
  expect_attn_res_shapes(op, "dout", args.dout, args.values, &args.dvalues, args.probs, args.norm_weight,
                         args.query);
}

void check_situ_forward(OperandRules& rules, const SituArgs& args) {
  const char* op = "situ_forward";
  activations(rules, op, {{"h", &args.h}, {"gate_up", &args.gate_up}});
  expect_swiglu_shapes(op, args.h, args.gate_up);
  expect_situ_betas(op, args.beta, args.linear_beta);
}

void check_situ_backward(OperandRules& rules, const SituBackwardArgs& args) {
  const char* op = "situ_backward";
  check_gated_unit_backward(rules, op, args.dgate_up, args.dh, args.gate_up);
  expect_situ_betas(op, args.beta, args.linear_beta);
}

// ---------------------------------------------------------------------------------------------
// MoE, loss, optimizer

void check_router_forward(OperandRules& rules, const RouterArgs& args) {
  const char* op = "router_forward";
  accumulations(rules, op, {{"scores", &args.scores}, {"topk_weight", &args.topk_weight}, {"logits", &args.logits}});
  expect_ndim(op, "logits", args.logits, 2);
  const int64_t tokens = args.logits.size(0), experts = args.logits.size(1);
  expect_shape(op, "scores", args.scores, args.logits.shape);
  rules.fixed_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_shape(op, "topk_index", args.topk_index, Shape{tokens, args.top_k});
  expect_shape(op, "topk_weight", args.topk_weight, Shape{tokens, args.top_k});
  if (given(args.bias)) {
    rules.activation(op, "bias", args.bias);
    expect_numel(op, "bias", args.bias, experts);
  }
  if (given(args.noise)) {
    rules.activation(op, "noise", args.noise);
    expect_shape(op, "noise", args.noise, args.logits.shape);
  }
  expect_router_groups(op, args, experts);
}

void check_router_backward(OperandRules& rules, const RouterBackwardArgs& args) {
  const char* op = "router_backward";
  accumulations(rules, op,
                {{"dlogits", &args.dlogits}, {"dtopk_weight", &args.dtopk_weight}, {"scores", &args.scores}});
  expect_ndim(op, "scores", args.scores, 2);
  const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
  expect_shape(op, "dlogits", args.dlogits, args.scores.shape);
  expect_topk_rows(rules, op, args.topk_index, tokens);
  expect_shape(op, "dtopk_weight", args.dtopk_weight, args.topk_index.shape);
  rules.indices_below(op, "topk_index", args.topk_index, experts);
  if (given(args.dscores_extra)) {
    rules.accumulation(op, "dscores_extra", args.dscores_extra);
    expect_shape(op, "dscores_extra", args.dscores_extra, args.scores.shape);
  }
}

void check_aux_loss(OperandRules& rules, const AuxLossArgs& args) {
  const char* op = "aux_loss";
  accumulations(rules, op, {{"loss", &args.loss}, {"dscores", &args.dscores}, {"scores", &args.scores}});
  expect_ndim(op, "scores", args.scores, 2);
  const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
  expect_numel(op, "loss", args.loss, 1);
  expect_shape(op, "dscores", args.dscores, args.scores.shape);
  expect_topk_rows(rules, op, args.topk_index, tokens);
  rules.indices_below(op, "topk_index", args.topk_index, experts);
  expect(args.tokens_per_segment >= 1 && tokens % args.tokens_per_segment == 0, op,
         std::to_string(tokens) + " tokens do not split into segments of " + std::to_string(args.tokens_per_segment));
}

void check_moe_permutation(OperandRules& rules, const MoePermutationArgs& args) {
  const char* op = "moe_permutation";
  rules.fixed_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_ndim(op, "topk_index", args.topk_index, 2);
  const int64_t pairs = args.topk_index.numel();
  expect(args.num_experts >= 1, op, "num_experts " + std::to_string(args.num_experts));
  rules.fixed_dtype(op, "expert_offsets", args.expert_offsets, DType::kI32);
  expect_numel(op, "expert_offsets", args.expert_offsets, args.num_experts + 1);
  rules.fixed_dtype(op, "sorted_pair", args.sorted_pair, DType::kI32);
  expect_numel(op, "sorted_pair", args.sorted_pair, pairs);
  rules.fixed_dtype(op, "pair_row", args.pair_row, DType::kI32);
  expect_numel(op, "pair_row", args.pair_row, pairs);
}

void check_moe_permute(OperandRules& rules, const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                       int64_t top_k) {
  const char* op = "moe_permute";
  activations(rules, op, {{"out", &out}, {"x", &x}});
  expect_top_k(op, top_k);
  rules.fixed_dtype(op, "sorted_pair", sorted_pair, DType::kI32);
  expect(out.ndim() >= 1 && x.ndim() >= 1, op, describe("out", out) + " and " + describe("x", x) + " need rows");
  expect_numel(op, "sorted_pair", sorted_pair, out.size(0));
  expect(out.numel() == sorted_pair.numel() * (x.size(0) == 0 ? 0 : x.numel() / x.size(0)), op,
         describe("out", out) + " should have one row of " + describe("x", x) + " per sorted pair");
  rules.indices_below(op, "sorted_pair", sorted_pair, x.size(0) * top_k);
}

void check_moe_unpermute_sum(OperandRules& rules, const TensorView& dx, const TensorView& drows,
                             const TensorView& pair_row, int64_t top_k) {
  const char* op = "moe_unpermute_sum";
  activations(rules, op, {{"dx", &dx}, {"drows", &drows}});
  expect_top_k(op, top_k);
  expect(dx.ndim() >= 1 && drows.ndim() >= 1, op,
         describe("dx", dx) + " and " + describe("drows", drows) + " need rows");
  rules.fixed_dtype(op, "pair_row", pair_row, DType::kI32);
  expect_numel(op, "pair_row", pair_row, dx.size(0) * top_k);
  expect(drows.numel() * dx.size(0) == dx.numel() * drows.size(0), op,
         describe("drows", drows) + " and " + describe("dx", dx) + " differ in row width");
  rules.indices_below(op, "pair_row", pair_row, drows.size(0));
}

void check_moe_combine(OperandRules& rules, const MoeCombineArgs& args) {
  const char* op = "moe_combine";
  activations(rules, op, {{"out", &args.out}, {"rows", &args.rows}, {"weight", &args.weight}});
  check_combine(rules, op, args.out, args.rows, args.weight, args.pair_row);
}

void check_moe_combine_backward(OperandRules& rules, const MoeCombineBackwardArgs& args) {
  const char* op = "moe_combine_backward";
  activations(rules, op,
              {{"drows", &args.drows}, {"dweight", &args.dweight}, {"dout", &args.dout}, {"rows", &args.rows},
               {"weight", &args.weight}});
  check_combine(rules, op, args.dout, args.rows, args.weight, args.pair_row);
  expect_shape(op, "drows", args.drows, args.rows.shape);
  expect_shape(op, "dweight", args.dweight, args.weight.shape);
}

void check_cross_entropy(OperandRules& rules, const CrossEntropyArgs& args) {
  const char* op = "cross_entropy";
  rules.accumulation(op, "loss", args.loss);
  rules.activation(op, "logits", args.logits);
  expect_ndim(op, "logits", args.logits, 2);
  const int64_t rows = args.logits.size(0);
  expect(args.logits.size(1) >= 1, op, describe("logits", args.logits) + " has no vocabulary");
  rules.fixed_dtype(op, "labels", args.labels, DType::kI32);
  expect_numel(op, "labels", args.labels, rows);
  expect_numel(op, "loss", args.loss, rows);
  if (given(args.dlogits)) {  // may be BF16 next to F32 logits on CUDA: the head's GEMM takes it as is
    rules.activation(op, "dlogits", args.dlogits);
    expect_alias_same_dtype(op, "dlogits", args.dlogits, "logits", args.logits);
    expect_shape(op, "dlogits", args.dlogits, args.logits.shape);
  }
}

void check_adamw(OperandRules& rules, const AdamWArgs& args) {
  const char* op = "adamw";
  accumulations(rules, op,
                {{"param", &args.param}, {"grad", &args.grad}, {"exp_avg", &args.exp_avg},
                 {"exp_avg_sq", &args.exp_avg_sq}});
  expect_numel(op, "grad", args.grad, args.param.numel());
  expect_numel(op, "exp_avg", args.exp_avg, args.param.numel());
  expect_numel(op, "exp_avg_sq", args.exp_avg_sq, args.param.numel());
  expect(args.step >= 1, op, "step " + std::to_string(args.step) + " (steps are 1-based)");
}

// ---------------------------------------------------------------------------------------------
// KDA family

void check_short_conv_forward(OperandRules& rules, const ShortConvArgs& args) {
  const char* op = "short_conv_forward";
  activations(rules, op, {{"y", &args.y}, {"x", &args.x}, {"weight", &args.weight}});
  expect_short_conv_shapes(op, "y", args.y, args.x, args.weight);
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.x.size(0), "sequences");
  // A token's output reads the inputs of the tokens before it.
  expect(args.y.data != args.x.data || args.x.numel() == 0, op, "y must not share memory with x");
}

void check_short_conv_backward(OperandRules& rules, const ShortConvBackwardArgs& args) {
  const char* op = "short_conv_backward";
  activations(rules, op, {{"dx", &args.dx}, {"dy", &args.dy}, {"x", &args.x}, {"weight", &args.weight}});
  expect_short_conv_shapes(op, "dy", args.dy, args.x, args.weight);
  expect_shape(op, "dx", args.dx, args.x.shape);
  if (given(args.dweight)) {
    rules.accumulation(op, "dweight", args.dweight);
    expect_shape(op, "dweight", args.dweight, args.weight.shape);
  }
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.x.size(0), "sequences");
  expect((args.dx.data != args.dy.data && args.dx.data != args.x.data) || args.x.numel() == 0, op,
         "dx must not share memory with dy or x");
}

void check_l2norm_forward(OperandRules& rules, const L2NormArgs& args) {
  const char* op = "l2norm_forward";
  rules.activation(op, "y", args.y);
  rules.accumulation(op, "inv_norm", args.inv_norm);
  rules.activation(op, "x", args.x);
  last_dim(op, "x", args.x);
  expect_norm_rows(op, args.x, "y", args.y, "inv_norm", args.inv_norm);
  expect_alias_same_dtype(op, "y", args.y, "x", args.x);
}

void check_l2norm_backward(OperandRules& rules, const L2NormBackwardArgs& args) {
  const char* op = "l2norm_backward";
  activations(rules, op, {{"dx", &args.dx}, {"dy", &args.dy}, {"x", &args.x}});
  rules.accumulation(op, "inv_norm", args.inv_norm);
  last_dim(op, "x", args.x);
  expect_shape(op, "dx", args.dx, args.x.shape);
  expect_norm_rows(op, args.x, "dy", args.dy, "inv_norm", args.inv_norm);
  expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
}

void check_kda_gate_forward(OperandRules& rules, const KdaGateArgs& args) {
  const char* op = "kda_gate_forward";
  rules.accumulation(op, "g", args.g);
  rules.activation(op, "f", args.f);
  accumulations(rules, op, {{"a_log", &args.a_log}, {"dt_bias", &args.dt_bias}});
  expect_kda_gate_shapes(op, "g", args.g, args.f, args.a_log, args.dt_bias, args.lower_bound);
}

void check_kda_gate_backward(OperandRules& rules, const KdaGateBackwardArgs& args) {
  const char* op = "kda_gate_backward";
  rules.activation(op, "df", args.df);
  rules.accumulation(op, "dg", args.dg);
  rules.activation(op, "f", args.f);
  accumulations(rules, op, {{"a_log", &args.a_log}, {"dt_bias", &args.dt_bias}});
  expect_kda_gate_shapes(op, "dg", args.dg, args.f, args.a_log, args.dt_bias, args.lower_bound);
  expect_shape(op, "df", args.df, args.f.shape);
}

namespace {

// The optional KDA states: each given one is accum [heads, k_dim, v_dim].
void expect_kda_states(OperandRules& rules, const char* op, const TensorView& q, const TensorView& v,
                       std::initializer_list<Named> states) {
  for (const auto& [name, t] : states) {
    if (!given(*t)) continue;
    rules.accumulation(op, name, *t);
    expect_shape(op, name, *t, Shape{q.size(1), q.size(2), v.size(2)});
  }
}

}  // namespace

void check_kda_forward(OperandRules& rules, const KdaArgs& args) {
  const char* op = "kda_forward";
  activations(rules, op, {{"out", &args.out}, {"q", &args.q}, {"k", &args.k}, {"v", &args.v}});
  accumulations(rules, op, {{"g", &args.g}, {"beta", &args.beta}});
  expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
  expect_shape(op, "out", args.out, args.v.shape);
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0), "sequences");
  expect_kda_states(rules, op, args.q, args.v, {{"initial_state", &args.initial_state}, {"final_state", &args.final_state}});
}

void check_kda_backward(OperandRules& rules, const KdaBackwardArgs& args) {
  const char* op = "kda_backward";
  activations(rules, op, {{"dq", &args.dq}, {"dk", &args.dk}, {"dv", &args.dv}});
  accumulations(rules, op, {{"dg", &args.dg}, {"dbeta", &args.dbeta}});
  activations(rules, op, {{"dout", &args.dout}, {"q", &args.q}, {"k", &args.k}, {"v", &args.v}});
  accumulations(rules, op, {{"g", &args.g}, {"beta", &args.beta}});
  expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
  expect_shape(op, "dq", args.dq, args.q.shape);
  expect_shape(op, "dk", args.dk, args.k.shape);
  expect_shape(op, "dv", args.dv, args.v.shape);
  expect_shape(op, "dg", args.dg, args.g.shape);
  expect_shape(op, "dbeta", args.dbeta, args.beta.shape);
  expect_shape(op, "dout", args.dout, args.v.shape);
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0), "sequences");
  expect_kda_states(rules, op, args.q, args.v,
                    {{"initial_state", &args.initial_state}, {"dfinal_state", &args.dfinal_state},
                     {"dinitial_state", &args.dinitial_state}});
}

void check_gated_rmsnorm_forward(OperandRules& rules, const GatedRmsNormArgs& args) {
  const char* op = "gated_rmsnorm_forward";
  rules.activation(op, "y", args.y);
  rules.accumulation(op, "rstd", args.rstd);
  activations(rules, op, {{"x", &args.x}, {"gate", &args.gate}, {"weight", &args.weight}});
  expect_gated_rmsnorm_shapes(op, "y", args.y, args.x, args.gate, args.weight, args.rstd);
  expect_alias_same_dtype(op, "y", args.y, "x", args.x);
  expect_alias_same_dtype(op, "y", args.y, "gate", args.gate);
}

void check_gated_rmsnorm_backward(OperandRules& rules, const GatedRmsNormBackwardArgs& args) {
  const char* op = "gated_rmsnorm_backward";
  activations(rules, op,
              {{"dx", &args.dx}, {"dgate", &args.dgate}, {"dy", &args.dy}, {"x", &args.x}, {"gate", &args.gate},
               {"weight", &args.weight}});
  rules.accumulation(op, "rstd", args.rstd);
  expect_gated_rmsnorm_shapes(op, "dy", args.dy, args.x, args.gate, args.weight, args.rstd);
  expect_shape(op, "dx", args.dx, args.x.shape);
  expect_shape(op, "dgate", args.dgate, args.x.shape);
  expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
  expect_alias_same_dtype(op, "dgate", args.dgate, "dy", args.dy);
  expect(args.dx.data != args.dgate.data || args.dx.data == nullptr, op, "dx and dgate are the same memory");
  if (given(args.dweight)) {
    rules.accumulation(op, "dweight", args.dweight);
    expect_numel(op, "dweight", args.dweight, args.weight.numel());
    // dweight is summed after dx and dgate are written, from dy, x and gate (no rows: nothing to
    // overwrite).
    for (const void* written : {args.dx.data, args.dgate.data})
      expect((written != args.dy.data && written != args.x.data && written != args.gate.data) || args.x.numel() == 0,
             op,
             "dx and dgate must not overwrite dy, x or gate when dweight is wanted");
  }
}

void check_sigmoid_forward(OperandRules& rules, const TensorView& y, const TensorView& x) {
  const char* op = "sigmoid_forward";
  activations(rules, op, {{"y", &y}, {"x", &x}});
  expect_numel(op, "y", y, x.numel());
  expect_alias_same_dtype(op, "y", y, "x", x);
}

void check_sigmoid_backward(OperandRules& rules, const TensorView& dx, const TensorView& dy, const TensorView& y) {
  const char* op = "sigmoid_backward";
  activations(rules, op, {{"dx", &dx}, {"dy", &dy}, {"y", &y}});
  expect_numel(op, "dx", dx, y.numel());
  expect_numel(op, "dy", dy, y.numel());
  expect_alias_same_dtype(op, "dx", dx, "dy", dy);
  expect_alias_same_dtype(op, "dx", dx, "y", y);
}

// ---------------------------------------------------------------------------------------------
// DSA family

void check_layernorm_forward(OperandRules& rules, const LayerNormArgs& args) {
  const char* op = "layernorm_forward";
  activations(rules, op, {{"y", &args.y}, {"x", &args.x}, {"weight", &args.weight}, {"bias", &args.bias}});
  expect_layernorm_shapes(op, args);
  expect_alias_same_dtype(op, "y", args.y, "x", args.x);
}

void check_dsa_indexer_topk(OperandRules& rules, const DsaIndexerArgs& args) {
  const char* op = "dsa_indexer_topk";
  activations(rules, op, {{"q", &args.q}, {"k", &args.k}});
  rules.accumulation(op, "weights", args.weights);
  rules.fixed_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_dsa_indexer_shapes(op, args);
  rules.offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0), "sequences");
  expect_key_segments(rules, op, args.cu_seqlens, args.cu_seqlens_k, args.k);
}

void check_sparse_attention_forward(OperandRules& rules, const SparseAttentionArgs& args) {
  const char* op = "sparse_attention_forward";
  rules.activation(op, "out", args.out);
  rules.accumulation(op, "lse", args.lse);
  activations(rules, op, {{"q", &args.q}, {"kv", &args.kv}});
  rules.fixed_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_sparse_attention_shapes(op, args.q, args.kv, "out", args.out, args.lse, args.topk_index, args.key_offset);
  rules.selection(op, args.topk_index, args.key_offset);
}

void check_sparse_attention_backward(OperandRules& rules, const SparseAttentionBackwardArgs& args) {
  const char* op = "sparse_attention_backward";
  activations(rules, op,
              {{"dq", &args.dq}, {"dkv", &args.dkv}, {"dout", &args.dout}, {"q", &args.q}, {"kv", &args.kv},
               {"out", &args.out}});
  rules.accumulation(op, "lse", args.lse);
  rules.fixed_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_sparse_attention_shapes(op, args.q, args.kv, "out", args.out, args.lse, args.topk_index, args.key_offset);
  expect_shape(op, "dout", args.dout, args.out.shape);
  expect_shape(op, "dq", args.dq, args.q.shape);
  expect_shape(op, "dkv", args.dkv, args.kv.shape);
  // dq is written while other queries still read their inputs, and dkv, summed over the queries
  // that select each key, is zeroed first: neither may share memory with an input.
  for (const TensorView* written : {&args.dq, &args.dkv})
    for (const TensorView* read : {&args.dout, &args.q, &args.kv, &args.out, &args.lse})
      expect(written->data == nullptr || written->data != read->data, op,
             "dq and dkv must not share memory with dout, q, kv, out or lse");
  rules.selection(op, args.topk_index, args.key_offset);
}

void check_attention_gate_forward(OperandRules& rules, const AttentionGateArgs& args) {
  const char* op = "attention_gate_forward";
  activations(rules, op, {{"y", &args.y}, {"x", &args.x}, {"gate", &args.gate}});
  expect_attention_gate_shapes(op, "y", args.y, args.x, args.gate, args.headwise);
  expect_alias_same_dtype(op, "y", args.y, "x", args.x);
  // A headwise gate is read by a whole row of y: y must not overwrite it.
  expect(args.y.data != args.gate.data || args.y.data == nullptr, op, "y and gate are the same memory");
}

void check_attention_gate_backward(OperandRules& rules, const AttentionGateBackwardArgs& args) {
  const char* op = "attention_gate_backward";
  activations(rules, op,
              {{"dx", &args.dx}, {"dgate", &args.dgate}, {"dy", &args.dy}, {"x", &args.x}, {"gate", &args.gate}});
  expect_attention_gate_shapes(op, "dy", args.dy, args.x, args.gate, args.headwise);
  expect_shape(op, "dx", args.dx, args.x.shape);
  expect_shape(op, "dgate", args.dgate, args.gate.shape);
  expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
  // dx may overwrite dy (each element is read before it is written), nothing else may alias.
  for (const void* input : {args.x.data, args.gate.data, args.dgate.data})
    expect(args.dx.data != input || args.dx.data == nullptr, op, "dx shares memory with x, gate or dgate");
  for (const void* input : {args.dy.data, args.x.data, args.gate.data})
    expect(args.dgate.data != input || args.dgate.data == nullptr, op, "dgate shares memory with dy, x or gate");
}

}  // namespace moetrain::kernels
