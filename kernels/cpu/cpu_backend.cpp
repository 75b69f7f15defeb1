// The CPU reference backend: the public entry of every op. Each method checks its arguments
// (host tensors, dtypes, shapes, index ranges that would otherwise read out of bounds), then
// dispatches on the compute dtype (F32 -> float, F64 -> double) to the templated functions in
// kernels/cpu/<family>.h, which hold the arithmetic. A failed check is a bug in the caller:
// Error(kInternal) naming the op, the argument and both shapes. (Bad token ids are the one
// user-data error here: embedding_forward throws kBadData.)
#include <string>
#include <utility>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_gate.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/dense.h"
#include "kernels/cpu/dsa.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/kda_gate.h"
#include "kernels/cpu/kda_norms.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/short_conv.h"
#include "kernels/cpu/attn_res.h"
#include "kernels/cpu/situ.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/arg_checks.h"
#include "kernels/ops.h"

namespace moetrain::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks

// On the host, with memory unless it has no elements.
void expect_host(const char* op, const char* name, const TensorView& t) { expect_on(op, name, t, Device::kCPU); }

void expect_dtype(const char* op, const char* name, const TensorView& t, DType dtype) {
  expect_host(op, name, t);
  expect_dtype_is(op, name, t, dtype);
}

// Every entry of an int32 index tensor in [0, bound).
void expect_indices_below(const char* op, const char* name, const TensorView& t, int64_t bound) {
  const int32_t* p = t.ptr<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    expect(p[i] >= 0 && p[i] < bound, op,
           std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) + " is outside [0, " +
               std::to_string(bound) + ")");
}

// int32 [count + 1] prefix sums: 0 first, non-decreasing, `total` last.
void expect_offsets(const char* op, const char* name, const TensorView& t, int64_t total) {
  expect_dtype(op, name, t, DType::kI32);
  expect(t.ndim() == 1, op, describe(name, t) + " should be [count + 1]");
  kernels::expect_offsets(op, name, t.ptr<int32_t>(), t.numel(), total);
}

// The compute dtype of a call: `first`'s, which every other floating operand must share.
DType compute_dtype(const char* op, std::initializer_list<std::pair<const char*, const TensorView*>> operands) {
  const DType dtype = operands.begin()->second->dtype;
  for (const auto& [name, t] : operands) expect_dtype(op, name, *t, dtype);
  return dtype;
}

// Calls f(T{}) with T the element type of `dtype`.
template <typename F>
auto dispatch(const char* op, DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(float{});
    case DType::kF64: return f(double{});
    default:
      fail(op, std::string("compute dtype ") + dtype_name(dtype) +
                   " is not supported by the CPU backend (F32 or F64; convert bf16/f16 weights first)");
  }
}

// ---------------------------------------------------------------------------------------------

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  const char* name() const override { return "cpu"; }
  Allocator& allocator() override { return host_allocator(); }
  void synchronize() override {}

  void copy(const TensorView& dst, const TensorView& src) override {
    const char* op = "copy";
    expect_host(op, "dst", dst);
    expect_dtype(op, "src", src, dst.dtype);
    expect_numel(op, "src", src, dst.numel());
    cpu::copy(dst, src);
  }

  void convert(const TensorView& dst, const TensorView& src) override {
    const char* op = "convert";
    expect_host(op, "dst", dst);
    expect_host(op, "src", src);
    expect_numel(op, "src", src, dst.numel());
    cpu::convert(dst, src);
  }

  void fill(const TensorView& dst, double value) override {
    expect_host("fill", "dst", dst);
    cpu::fill(dst, value);
  }

  void random_mxfp4(const RandomMxfp4Args& args) override {
    const char* op = "random_mxfp4";
    expect_host(op, "codes", args.codes);
    expect_host(op, "scales", args.scales);
    expect_random_mxfp4_shapes(op, args);
    cpu::random_mxfp4(args);
  }

  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override {
    const char* op = "axpby";
    const DType dtype = compute_dtype(op, {{"y", &y}, {"x", &x}});
    expect_numel(op, "x", x, y.numel());
    dispatch(op, dtype, [&](auto t) { cpu::axpby<decltype(t)>(y, x, alpha, beta); });
  }

  double sum_squares(const TensorView& x) override {
    const char* op = "sum_squares";
    expect_host(op, "x", x);
    return dispatch(op, x.dtype, [&](auto t) { return cpu::sum_squares<decltype(t)>(x); });
  }

  void copy_columns(const CopyColumnsArgs& args) override {
    const char* op = "copy_columns";
    const DType dtype = compute_dtype(op, {{"dst", &args.dst}, {"src", &args.src}});
    expect_copy_columns_shapes(op, args);
    dispatch(op, dtype, [&](auto t) { cpu::copy_columns<decltype(t)>(args); });
  }

  void copy_block(const CopyBlockArgs& args) override {
    const char* op = "copy_block";
    const DType dtype = compute_dtype(op, {{"dst", &args.dst}, {"src", &args.src}});
    expect_copy_block_shapes(op, args);
    expect(args.dst.data != args.src.data || args.dst.data == nullptr, op, "dst and src are the same memory");
    dispatch(op, dtype, [&](auto t) { cpu::copy_block<decltype(t)>(args); });
  }

  void sum_over_heads(const TensorView& dst, const TensorView& src) override {
    const char* op = "sum_over_heads";
    const DType dtype = compute_dtype(op, {{"dst", &dst}, {"src", &src}});
    const int64_t dim = last_dim(op, "dst", dst);
    expect(last_dim(op, "src", src) == dim, op, describe("src", src) + " and " + describe("dst", dst) +
                                                    " differ in the last dimension");
    const int64_t tokens = rows_of(dst);
    expect(tokens == 0 ? src.numel() == 0 : rows_of(src) % tokens == 0, op,
           describe("src", src) + " is not [tokens, heads, dim] for " + describe("dst", dst));
    dispatch(op, dtype, [&](auto t) { cpu::sum_over_heads<decltype(t)>(dst, src); });
  }

  void gemm(const GemmArgs& args) override {
    const char* op = "gemm";
    const DType dtype = compute_dtype(op, {{"c", &args.c}, {"a", &args.a}, {"b", &args.b}});
    expect_gemm_shapes(op, args);
    dispatch(op, dtype, [&](auto t) { cpu::gemm<decltype(t)>(args); });
  }

  void grouped_gemm(const GroupedGemmArgs& args) override {
    const char* op = "grouped_gemm";
    const bool mxfp4 = given(args.b_scale);  // b packed (ops.h): dequantized, then the plain GEMM
    const DType dtype = mxfp4 ? compute_dtype(op, {{"c", &args.c}, {"a", &args.a}})
                              : compute_dtype(op, {{"c", &args.c}, {"a", &args.a}, {"b", &args.b}});
    if (mxfp4) {
      expect_dtype(op, "b", args.b, DType::kU8);
      expect_dtype(op, "b_scale", args.b_scale, DType::kU8);
    }
    expect_ndim(op, "a", args.a, 2);
    expect_offsets(op, "group_offsets", args.group_offsets, args.a.size(0));
    expect_grouped_gemm_shapes(op, args, args.group_offsets.numel() - 1);
    if (given(args.a2)) {
      expect_dtype(op, "a2", args.a2, dtype);
      expect_dtype(op, "b2", args.b2, dtype);
    }
    if (args.host_group_offsets != nullptr) {
      const int32_t* device = args.group_offsets.ptr<int32_t>();
      for (int64_t i = 0; i < args.group_offsets.numel(); ++i) {
        expect(args.host_group_offsets[i] == device[i], op,
               "host_group_offsets[" + std::to_string(i) + "] = " + std::to_string(args.host_group_offsets[i]) +
                   " but group_offsets holds " + std::to_string(device[i]));
      }
    }
    dispatch(op, dtype, [&](auto t) {
      if (mxfp4) {
        cpu::grouped_gemm_mxfp4<decltype(t)>(args);
      } else {
        cpu::grouped_gemm<decltype(t)>(args);
      }
    });
  }

  void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    const char* op = "embedding_forward";
    const DType dtype = compute_dtype(op, {{"out", &out}, {"table", &table}});
    check_embedding(op, out, table, ids);
    dispatch(op, dtype, [&](auto t) { cpu::embedding_forward<decltype(t)>(out, table, ids); });
  }

  void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) override {
    const char* op = "embedding_backward";
    const DType dtype = compute_dtype(op, {{"dtable", &dtable}, {"dout", &dout}});
    check_embedding(op, dout, dtable, ids);
    dispatch(op, dtype, [&](auto t) { cpu::embedding_backward<decltype(t)>(dtable, dout, ids); });
  }

  void rmsnorm_forward(const RmsNormArgs& args) override {
    const char* op = "rmsnorm_forward";
    const DType dtype = compute_dtype(
        op, {{"y", &args.y}, {"rstd", &args.rstd}, {"x", &args.x}, {"weight", &args.weight}});
    const int64_t dim = last_dim(op, "x", args.x);
    expect_numel(op, "weight", args.weight, dim);
    expect_shape(op, "y", args.y, args.x.shape);
    expect_numel(op, "rstd", args.rstd, rows_of(args.x));
    dispatch(op, dtype, [&](auto t) { cpu::rmsnorm_forward<decltype(t)>(args); });
  }

  void rmsnorm_backward(const RmsNormBackwardArgs& args) override {
    const char* op = "rmsnorm_backward";
    const DType dtype = compute_dtype(op, {{"dx", &args.dx},
                                           {"dy", &args.dy},
                                           {"x", &args.x},
                                           {"weight", &args.weight},
                                           {"rstd", &args.rstd}});
    const int64_t dim = last_dim(op, "x", args.x);
    expect_numel(op, "weight", args.weight, dim);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dy", args.dy, args.x.shape);
    expect_numel(op, "rstd", args.rstd, rows_of(args.x));
    if (given(args.dweight)) {
      expect_dtype(op, "dweight", args.dweight, dtype);
      expect_numel(op, "dweight", args.dweight, dim);
    }
    dispatch(op, dtype, [&](auto t) { cpu::rmsnorm_backward<decltype(t)>(args); });
  }

  void rope(const RopeArgs& args) override {
    const char* op = "rope";
    const DType dtype =
        compute_dtype(op, {{"out", &args.out}, {"x", &args.x}, {"cos", &args.cos}, {"sin", &args.sin}});
    expect_dtype(op, "positions", args.positions, DType::kI32);
    expect_shape(op, "out", args.out, args.x.shape);
    const int64_t width = last_dim(op, "x", args.x);
    expect(args.rope_dim > 0 && args.rope_dim % 2 == 0, op,
           "rope_dim " + std::to_string(args.rope_dim) + " must be positive and even");
    expect_rope_shapes(op, args, width);
    dispatch(op, dtype, [&](auto t) { cpu::rope<decltype(t)>(args); });
  }

  void attention_forward(const AttentionArgs& args) override {
    const char* op = "attention_forward";
    const DType dtype = compute_dtype(
        op, {{"out", &args.out}, {"lse", &args.lse}, {"q", &args.q}, {"k", &args.k}, {"v", &args.v}});
    check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens);
    dispatch(op, dtype, [&](auto t) { cpu::attention_forward<decltype(t)>(args); });
  }

  void attention_backward(const AttentionBackwardArgs& args) override {
    const char* op = "attention_backward";
    const DType dtype = compute_dtype(op, {{"dq", &args.dq},
                                           {"dk", &args.dk},
                                           {"dv", &args.dv},
                                           {"dout", &args.dout},
                                           {"q", &args.q},
                                           {"k", &args.k},
                                           {"v", &args.v},
                                           {"out", &args.out},
                                           {"lse", &args.lse}});
    check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dk", args.dk, args.k.shape);
    expect_shape(op, "dv", args.dv, args.v.shape);
    expect_shape(op, "dout", args.dout, args.out.shape);
    dispatch(op, dtype, [&](auto t) { cpu::attention_backward<decltype(t)>(args); });
  }

  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    const char* op = "swiglu_forward";
    const DType dtype = compute_dtype(op, {{"h", &h}, {"gate_up", &gate_up}});
    expect_swiglu_shapes(op, h, gate_up);
    dispatch(op, dtype, [&](auto t) { cpu::swiglu_forward<decltype(t)>(h, gate_up); });
  }

  void swiglu_backward(const SwigluBackwardArgs& args) override {
    const char* op = "swiglu_backward";
    const DType dtype =
        compute_dtype(op, {{"dgate_up", &args.dgate_up}, {"dh", &args.dh}, {"gate_up", &args.gate_up}});
    expect_swiglu_shapes(op, args.dh, args.gate_up);
    expect_shape(op, "dgate_up", args.dgate_up, args.gate_up.shape);
    dispatch(op, dtype, [&](auto t) { cpu::swiglu_backward<decltype(t)>(args); });
  }

  void attn_res_forward(const AttnResArgs& args) override {
    const char* op = "attn_res_forward";
    const DType dtype = compute_dtype(op, {{"out", &args.out}, {"probs", &args.probs},
                                           {"norm_weight", &args.norm_weight}, {"query", &args.query}});
    expect_attn_res_shapes(op, "out", args.out, args.values, nullptr, args.probs, args.norm_weight, args.query);
    for (const TensorView& v : args.values) expect_dtype(op, "value", v, dtype);
    dispatch(op, dtype, [&](auto t) { cpu::attn_res_forward<decltype(t)>(args); });
  }

  void attn_res_backward(const AttnResBackwardArgs& args) override {
    const char* op = "attn_res_backward";
    const DType dtype = compute_dtype(op, {{"dout", &args.dout}, {"probs", &args.probs},
                                           {"norm_weight", &args.norm_weight}, {"query", &args.query}});
    expect_attn_res_shapes(op, "dout", args.dout, args.values, &args.dvalues, args.probs, args.norm_weight,
                           args.query);
    for (const TensorView& v : args.values) expect_dtype(op, "value", v, dtype);
    for (const TensorView& g : args.dvalues) expect_dtype(op, "dvalue", g, dtype);
    dispatch(op, dtype, [&](auto t) { cpu::attn_res_backward<decltype(t)>(args); });
  }

  void situ_forward(const SituArgs& args) override {
    const char* op = "situ_forward";
    const DType dtype = compute_dtype(op, {{"h", &args.h}, {"gate_up", &args.gate_up}});
    expect_swiglu_shapes(op, args.h, args.gate_up);
    expect_situ_betas(op, args.beta, args.linear_beta);
    dispatch(op, dtype, [&](auto t) { cpu::situ_forward<decltype(t)>(args); });
  }

  void situ_backward(const SituBackwardArgs& args) override {
    const char* op = "situ_backward";
    const DType dtype =
        compute_dtype(op, {{"dgate_up", &args.dgate_up}, {"dh", &args.dh}, {"gate_up", &args.gate_up}});
    expect_swiglu_shapes(op, args.dh, args.gate_up);
    expect_shape(op, "dgate_up", args.dgate_up, args.gate_up.shape);
    expect_situ_betas(op, args.beta, args.linear_beta);
    dispatch(op, dtype, [&](auto t) { cpu::situ_backward<decltype(t)>(args); });
  }

  void router_forward(const RouterArgs& args) override {
    const char* op = "router_forward";
    const DType dtype = compute_dtype(
        op, {{"scores", &args.scores}, {"topk_weight", &args.topk_weight}, {"logits", &args.logits}});
    expect_ndim(op, "logits", args.logits, 2);
    const int64_t tokens = args.logits.size(0), experts = args.logits.size(1);
    expect_shape(op, "scores", args.scores, args.logits.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_shape(op, "topk_index", args.topk_index, Shape{tokens, args.top_k});
    expect_shape(op, "topk_weight", args.topk_weight, Shape{tokens, args.top_k});
    if (given(args.bias)) {
      expect_dtype(op, "bias", args.bias, dtype);
      expect_numel(op, "bias", args.bias, experts);
    }
    if (given(args.noise)) {
      expect_dtype(op, "noise", args.noise, dtype);
      expect_shape(op, "noise", args.noise, args.logits.shape);
    }
    expect_router_groups(op, args, experts);
    dispatch(op, dtype, [&](auto t) { cpu::router_forward<decltype(t)>(args); });
  }

  void router_backward(const RouterBackwardArgs& args) override {
    const char* op = "router_backward";
    const DType dtype = compute_dtype(
        op, {{"dlogits", &args.dlogits}, {"dtopk_weight", &args.dtopk_weight}, {"scores", &args.scores}});
    expect_ndim(op, "scores", args.scores, 2);
    const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
    expect_shape(op, "dlogits", args.dlogits, args.scores.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    expect(args.topk_index.size(0) == tokens, op, describe("topk_index", args.topk_index) + " for " +
                                                      std::to_string(tokens) + " tokens");
    expect_shape(op, "dtopk_weight", args.dtopk_weight, args.topk_index.shape);
    expect_indices_below(op, "topk_index", args.topk_index, experts);
    if (given(args.dscores_extra)) {
      expect_dtype(op, "dscores_extra", args.dscores_extra, dtype);
      expect_shape(op, "dscores_extra", args.dscores_extra, args.scores.shape);
    }
    dispatch(op, dtype, [&](auto t) { cpu::router_backward<decltype(t)>(args); });
  }

  void aux_loss(const AuxLossArgs& args) override {
    const char* op = "aux_loss";
    const DType dtype =
        compute_dtype(op, {{"loss", &args.loss}, {"dscores", &args.dscores}, {"scores", &args.scores}});
    expect_ndim(op, "scores", args.scores, 2);
    const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
    expect_numel(op, "loss", args.loss, 1);
    expect_shape(op, "dscores", args.dscores, args.scores.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    expect(args.topk_index.size(0) == tokens, op, describe("topk_index", args.topk_index) + " for " +
                                                      std::to_string(tokens) + " tokens");
    expect_indices_below(op, "topk_index", args.topk_index, experts);
    expect(args.tokens_per_segment >= 1 && tokens % args.tokens_per_segment == 0, op,
           std::to_string(tokens) + " tokens do not split into segments of " +
               std::to_string(args.tokens_per_segment));
    dispatch(op, dtype, [&](auto t) { cpu::aux_loss<decltype(t)>(args); });
  }

  void moe_permutation(const MoePermutationArgs& args) override {
    const char* op = "moe_permutation";
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    const int64_t pairs = args.topk_index.numel();
    expect(args.num_experts >= 1, op, "num_experts " + std::to_string(args.num_experts));
    expect_dtype(op, "expert_offsets", args.expert_offsets, DType::kI32);
    expect_numel(op, "expert_offsets", args.expert_offsets, args.num_experts + 1);
    expect_dtype(op, "sorted_pair", args.sorted_pair, DType::kI32);
    expect_numel(op, "sorted_pair", args.sorted_pair, pairs);
    expect_dtype(op, "pair_row", args.pair_row, DType::kI32);
    expect_numel(op, "pair_row", args.pair_row, pairs);
    cpu::moe_permutation<float>(args);  // integers only: the element type is irrelevant
  }

  void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                   int64_t top_k) override {
    const char* op = "moe_permute";
    const DType dtype = compute_dtype(op, {{"out", &out}, {"x", &x}});
    expect(top_k >= 1, op, "top_k " + std::to_string(top_k));
    expect_dtype(op, "sorted_pair", sorted_pair, DType::kI32);
    expect(out.ndim() >= 1 && x.ndim() >= 1, op, describe("out", out) + " and " + describe("x", x) + " need rows");
    expect_numel(op, "sorted_pair", sorted_pair, out.size(0));
    expect(out.numel() == sorted_pair.numel() * (x.size(0) == 0 ? 0 : x.numel() / x.size(0)), op,
           describe("out", out) + " should have one row of " + describe("x", x) + " per sorted pair");
    expect_indices_below(op, "sorted_pair", sorted_pair, x.size(0) * top_k);
    dispatch(op, dtype, [&](auto t) { cpu::moe_permute<decltype(t)>(out, x, sorted_pair, top_k); });
  }

  void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                         bool accumulate) override {
    const char* op = "moe_unpermute_sum";
    const DType dtype = compute_dtype(op, {{"dx", &dx}, {"drows", &drows}});
    expect(top_k >= 1, op, "top_k " + std::to_string(top_k));
    expect(dx.ndim() >= 1 && drows.ndim() >= 1, op, describe("dx", dx) + " and " + describe("drows", drows) + " need rows");
    expect_dtype(op, "pair_row", pair_row, DType::kI32);
    expect_numel(op, "pair_row", pair_row, dx.size(0) * top_k);
    expect(drows.numel() * dx.size(0) == dx.numel() * drows.size(0), op,
           describe("drows", drows) + " and " + describe("dx", dx) + " differ in row width");
    expect_indices_below(op, "pair_row", pair_row, drows.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::moe_unpermute_sum<decltype(t)>(dx, drows, pair_row, top_k, accumulate); });
  }

  void moe_combine(const MoeCombineArgs& args) override {
    const char* op = "moe_combine";
    const DType dtype = compute_dtype(op, {{"out", &args.out}, {"rows", &args.rows}, {"weight", &args.weight}});
    check_combine(op, args.out, args.rows, args.weight, args.pair_row);
    dispatch(op, dtype, [&](auto t) { cpu::moe_combine<decltype(t)>(args); });
  }

  void moe_combine_backward(const MoeCombineBackwardArgs& args) override {
    const char* op = "moe_combine_backward";
    const DType dtype = compute_dtype(op, {{"drows", &args.drows},
                                           {"dweight", &args.dweight},
                                           {"dout", &args.dout},
                                           {"rows", &args.rows},
                                           {"weight", &args.weight}});
    check_combine(op, args.dout, args.rows, args.weight, args.pair_row);
    expect_shape(op, "drows", args.drows, args.rows.shape);
    expect_shape(op, "dweight", args.dweight, args.weight.shape);
    dispatch(op, dtype, [&](auto t) { cpu::moe_combine_backward<decltype(t)>(args); });
  }

  void cross_entropy(const CrossEntropyArgs& args) override {
    const char* op = "cross_entropy";
    const DType dtype = compute_dtype(op, {{"loss", &args.loss}, {"logits", &args.logits}});
    expect_ndim(op, "logits", args.logits, 2);
    const int64_t rows = args.logits.size(0);
    expect(args.logits.size(1) >= 1, op, describe("logits", args.logits) + " has no vocabulary");
    expect_dtype(op, "labels", args.labels, DType::kI32);
    expect_numel(op, "labels", args.labels, rows);
    expect_numel(op, "loss", args.loss, rows);
    if (given(args.dlogits)) {
      expect_dtype(op, "dlogits", args.dlogits, dtype);
      expect_shape(op, "dlogits", args.dlogits, args.logits.shape);
    }
    dispatch(op, dtype, [&](auto t) { cpu::cross_entropy<decltype(t)>(args); });
  }

  void adamw(const AdamWArgs& args) override {
    const char* op = "adamw";
    const DType dtype = compute_dtype(op, {{"param", &args.param},
                                           {"grad", &args.grad},
                                           {"exp_avg", &args.exp_avg},
                                           {"exp_avg_sq", &args.exp_avg_sq}});
    expect_numel(op, "grad", args.grad, args.param.numel());
    expect_numel(op, "exp_avg", args.exp_avg, args.param.numel());
    expect_numel(op, "exp_avg_sq", args.exp_avg_sq, args.param.numel());
    expect(args.step >= 1, op, "step " + std::to_string(args.step) + " (steps are 1-based)");
    dispatch(op, dtype, [&](auto t) { cpu::adamw<decltype(t)>(args); });
  }

  void short_conv_forward(const ShortConvArgs& args) override {
    const char* op = "short_conv_forward";
    const DType dtype = compute_dtype(op, {{"y", &args.y}, {"x", &args.x}, {"weight", &args.weight}});
    expect_short_conv_shapes(op, "y", args.y, args.x, args.weight);
    expect_offsets(op, "cu_seqlens", args.cu_seqlens, args.x.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::short_conv_forward<decltype(t)>(args); });
  }

  void short_conv_backward(const ShortConvBackwardArgs& args) override {
    const char* op = "short_conv_backward";
    const DType dtype =
        compute_dtype(op, {{"dx", &args.dx}, {"dy", &args.dy}, {"x", &args.x}, {"weight", &args.weight}});
    expect_short_conv_shapes(op, "dy", args.dy, args.x, args.weight);
    expect_shape(op, "dx", args.dx, args.x.shape);
    if (given(args.dweight)) {
      expect_dtype(op, "dweight", args.dweight, dtype);
      expect_shape(op, "dweight", args.dweight, args.weight.shape);
    }
    expect_offsets(op, "cu_seqlens", args.cu_seqlens, args.x.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::short_conv_backward<decltype(t)>(args); });
  }

  void l2norm_forward(const L2NormArgs& args) override {
    const char* op = "l2norm_forward";
    const DType dtype = compute_dtype(op, {{"y", &args.y}, {"inv_norm", &args.inv_norm}, {"x", &args.x}});
    last_dim(op, "x", args.x);
    expect_shape(op, "y", args.y, args.x.shape);
    expect_numel(op, "inv_norm", args.inv_norm, rows_of(args.x));
    dispatch(op, dtype, [&](auto t) { cpu::l2norm_forward<decltype(t)>(args); });
  }

  void l2norm_backward(const L2NormBackwardArgs& args) override {
    const char* op = "l2norm_backward";
    const DType dtype = compute_dtype(
        op, {{"dx", &args.dx}, {"dy", &args.dy}, {"x", &args.x}, {"inv_norm", &args.inv_norm}});
    last_dim(op, "x", args.x);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dy", args.dy, args.x.shape);
    expect_numel(op, "inv_norm", args.inv_norm, rows_of(args.x));
    dispatch(op, dtype, [&](auto t) { cpu::l2norm_backward<decltype(t)>(args); });
  }

  void kda_gate_forward(const KdaGateArgs& args) override {
    const char* op = "kda_gate_forward";
    const DType dtype = compute_dtype(
        op, {{"g", &args.g}, {"f", &args.f}, {"a_log", &args.a_log}, {"dt_bias", &args.dt_bias}});
    expect_kda_gate_shapes(op, "g", args.g, args.f, args.a_log, args.dt_bias, args.lower_bound);
    dispatch(op, dtype, [&](auto t) { cpu::kda_gate_forward<decltype(t)>(args); });
  }

  void kda_gate_backward(const KdaGateBackwardArgs& args) override {
    const char* op = "kda_gate_backward";
    const DType dtype = compute_dtype(op, {{"df", &args.df},
                                           {"dg", &args.dg},
                                           {"f", &args.f},
                                           {"a_log", &args.a_log},
                                           {"dt_bias", &args.dt_bias}});
    expect_kda_gate_shapes(op, "dg", args.dg, args.f, args.a_log, args.dt_bias, args.lower_bound);
    expect_shape(op, "df", args.df, args.f.shape);
    dispatch(op, dtype, [&](auto t) { cpu::kda_gate_backward<decltype(t)>(args); });
  }

  void kda_forward(const KdaArgs& args) override {
    const char* op = "kda_forward";
    const DType dtype = compute_dtype(op, {{"out", &args.out},
                                           {"q", &args.q},
                                           {"k", &args.k},
                                           {"v", &args.v},
                                           {"g", &args.g},
                                           {"beta", &args.beta}});
    expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
    expect_shape(op, "out", args.out, args.v.shape);
    expect_offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::kda_chunked_forward<decltype(t)>(args); });
  }

  void kda_backward(const KdaBackwardArgs& args) override {
    const char* op = "kda_backward";
    const DType dtype = compute_dtype(op, {{"dq", &args.dq},
                                           {"dk", &args.dk},
                                           {"dv", &args.dv},
                                           {"dg", &args.dg},
                                           {"dbeta", &args.dbeta},
                                           {"dout", &args.dout},
                                           {"q", &args.q},
                                           {"k", &args.k},
                                           {"v", &args.v},
                                           {"g", &args.g},
                                           {"beta", &args.beta}});
    expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dk", args.dk, args.k.shape);
    expect_shape(op, "dv", args.dv, args.v.shape);
    expect_shape(op, "dg", args.dg, args.g.shape);
    expect_shape(op, "dbeta", args.dbeta, args.beta.shape);
    expect_shape(op, "dout", args.dout, args.v.shape);
    expect_offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::kda_chunked_backward<decltype(t)>(args); });
  }

  void gated_rmsnorm_forward(const GatedRmsNormArgs& args) override {
    const char* op = "gated_rmsnorm_forward";
    const DType dtype = compute_dtype(op, {{"y", &args.y},
                                           {"rstd", &args.rstd},
                                           {"x", &args.x},
                                           {"gate", &args.gate},
                                           {"weight", &args.weight}});
    expect_gated_rmsnorm_shapes(op, "y", args.y, args.x, args.gate, args.weight, args.rstd);
    dispatch(op, dtype, [&](auto t) { cpu::gated_rmsnorm_forward<decltype(t)>(args); });
  }

  void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) override {
    const char* op = "gated_rmsnorm_backward";
    const DType dtype = compute_dtype(op, {{"dx", &args.dx},
                                           {"dgate", &args.dgate},
                                           {"dy", &args.dy},
                                           {"x", &args.x},
                                           {"gate", &args.gate},
                                           {"weight", &args.weight},
                                           {"rstd", &args.rstd}});
    expect_gated_rmsnorm_shapes(op, "dy", args.dy, args.x, args.gate, args.weight, args.rstd);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dgate", args.dgate, args.x.shape);
    if (given(args.dweight)) {
      expect_dtype(op, "dweight", args.dweight, dtype);
      expect_numel(op, "dweight", args.dweight, args.weight.numel());
    }
    dispatch(op, dtype, [&](auto t) { cpu::gated_rmsnorm_backward<decltype(t)>(args); });
  }

  void sigmoid_forward(const TensorView& y, const TensorView& x) override {
    const char* op = "sigmoid_forward";
    const DType dtype = compute_dtype(op, {{"y", &y}, {"x", &x}});
    expect_numel(op, "y", y, x.numel());
    dispatch(op, dtype, [&](auto t) { cpu::sigmoid_forward<decltype(t)>(y, x); });
  }

  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override {
    const char* op = "sigmoid_backward";
    const DType dtype = compute_dtype(op, {{"dx", &dx}, {"dy", &dy}, {"y", &y}});
    expect_numel(op, "dx", dx, y.numel());
    expect_numel(op, "dy", dy, y.numel());
    dispatch(op, dtype, [&](auto t) { cpu::sigmoid_backward<decltype(t)>(dx, dy, y); });
  }

  void layernorm_forward(const LayerNormArgs& args) override {
    const char* op = "layernorm_forward";
    const DType dtype = compute_dtype(
        op, {{"y", &args.y}, {"x", &args.x}, {"weight", &args.weight}, {"bias", &args.bias}});
    expect_layernorm_shapes(op, args);
    dispatch(op, dtype, [&](auto t) { cpu::layernorm_forward<decltype(t)>(args); });
  }

  void dsa_indexer_topk(const DsaIndexerArgs& args) override {
    const char* op = "dsa_indexer_topk";
    const DType dtype = compute_dtype(op, {{"q", &args.q}, {"k", &args.k}, {"weights", &args.weights}});
    expect_dsa_indexer_shapes(op, args);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_offsets(op, "cu_seqlens", args.cu_seqlens, args.q.size(0));
    dispatch(op, dtype, [&](auto t) { cpu::dsa_indexer_topk<decltype(t)>(args); });
  }

  void sparse_attention_forward(const SparseAttentionArgs& args) override {
    const char* op = "sparse_attention_forward";
    const DType dtype = compute_dtype(op, {{"out", &args.out}, {"lse", &args.lse}, {"q", &args.q}, {"kv", &args.kv}});
    expect_sparse_attention_shapes(op, args.q, args.kv, "out", args.out, args.lse, args.topk_index);
    check_selection(op, args.topk_index);
    dispatch(op, dtype, [&](auto t) { cpu::sparse_attention_forward<decltype(t)>(args); });
  }

  void sparse_attention_backward(const SparseAttentionBackwardArgs& args) override {
    const char* op = "sparse_attention_backward";
    const DType dtype = compute_dtype(op, {{"dq", &args.dq},
                                           {"dkv", &args.dkv},
                                           {"dout", &args.dout},
                                           {"q", &args.q},
                                           {"kv", &args.kv},
                                           {"out", &args.out},
                                           {"lse", &args.lse}});
    expect_sparse_attention_shapes(op, args.q, args.kv, "out", args.out, args.lse, args.topk_index);
    expect_shape(op, "dout", args.dout, args.out.shape);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dkv", args.dkv, args.kv.shape);
    check_selection(op, args.topk_index);
    dispatch(op, dtype, [&](auto t) { cpu::sparse_attention_backward<decltype(t)>(args); });
  }

  void attention_gate_forward(const AttentionGateArgs& args) override {
    const char* op = "attention_gate_forward";
    const DType dtype = compute_dtype(op, {{"y", &args.y}, {"x", &args.x}, {"gate", &args.gate}});
    expect_attention_gate_shapes(op, "y", args.y, args.x, args.gate, args.headwise);
    dispatch(op, dtype, [&](auto t) { cpu::attention_gate_forward<decltype(t)>(args); });
  }

  void attention_gate_backward(const AttentionGateBackwardArgs& args) override {
    const char* op = "attention_gate_backward";
    const DType dtype = compute_dtype(
        op, {{"dx", &args.dx}, {"dgate", &args.dgate}, {"dy", &args.dy}, {"x", &args.x}, {"gate", &args.gate}});
    expect_attention_gate_shapes(op, "dy", args.dy, args.x, args.gate, args.headwise);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dgate", args.dgate, args.gate.shape);
    dispatch(op, dtype, [&](auto t) { cpu::attention_gate_backward<decltype(t)>(args); });
  }

 private:
  static void check_embedding(const char* op, const TensorView& rows_out, const TensorView& table,
                              const TensorView& ids) {
    expect_dtype(op, "ids", ids, DType::kI32);
    expect_embedding_shapes(op, rows_out, table, ids);
  }

  static void check_attention(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& lse, const TensorView& cu_seqlens) {
    expect_attention_shapes(op, q, k, v, out, lse);
    expect_offsets(op, "cu_seqlens", cu_seqlens, q.size(0));
  }

  // Each row t of a sparse attention's topk_index: keys in [0, t], strictly ascending, then only -1s.
  static void check_selection(const char* op, const TensorView& topk_index) {
    expect_dtype(op, "topk_index", topk_index, DType::kI32);
    const int64_t top_k = topk_index.size(1);
    const int32_t* p = topk_index.ptr<int32_t>();
    for (int64_t t = 0; t < topk_index.size(0); ++t) {
      const int32_t* row = p + t * top_k;
      int64_t i = 0;
      for (; i < top_k && row[i] >= 0; ++i) {
        expect(row[i] <= t && (i == 0 || row[i] > row[i - 1]), op,
               "topk_index[" + std::to_string(t) + ", " + std::to_string(i) + "] = " + std::to_string(row[i]) +
                   ": a query's keys must be rows <= the query's own (" + std::to_string(t) +
                   "), in strictly ascending order");
      }
      for (; i < top_k; ++i) {
        expect(row[i] == -1, op,
               "topk_index[" + std::to_string(t) + ", " + std::to_string(i) + "] = " + std::to_string(row[i]) +
                   ": after the first -1 a row holds only -1 (padding)");
      }
    }
  }

  static void check_combine(const char* op, const TensorView& out, const TensorView& rows, const TensorView& weight,
                            const TensorView& pair_row) {
    expect_dtype(op, "pair_row", pair_row, DType::kI32);
    expect_combine_shapes(op, out, rows, weight, pair_row);
    expect_indices_below(op, "pair_row", pair_row, rows.size(0));
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace moetrain::kernels
