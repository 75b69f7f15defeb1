// The CPU reference backend: the public entry of every op. Each method checks its arguments
// against the op's contract (kernels/op_contracts.h) under the CPU's rules (HostRules: host
// tensors, one compute dtype, index values read and range-checked), then dispatches on the
// compute dtype (F32 -> float, F64 -> double) to the templated functions in
// kernels/cpu/<family>.h, which hold the arithmetic. A failed check is a bug in the caller:
// Error(kInternal) naming the op, the argument and both shapes. (Bad token ids are the one
// user-data error here: embedding_forward throws kBadData.)
#include <optional>
#include <string>

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
#include "kernels/op_contracts.h"
#include "kernels/ops.h"

namespace moetrain::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks: each op's contract is kernels/op_contracts.h; these are the CPU's rules.

// Host operands; every floating operand of a call in the dtype of the first one the contract
// names (ops.h), which is the call's compute dtype. Index tensors are read and checked, since a
// bad index would read or write out of bounds.
class HostRules final : public OperandRules {
 public:
  HostRules() : OperandRules(Device::kCPU) {}

  void activation(const char* op, const char* name, const TensorView& t) override {
    if (!dtype_) dtype_ = t.dtype;
    fixed_dtype(op, name, t, *dtype_);
  }
  void accumulation(const char* op, const char* name, const TensorView& t) override { activation(op, name, t); }

  void offsets(const char* op, const char* name, const TensorView& t, int64_t total, const char*) override {
    fixed_dtype(op, name, t, DType::kI32);
    expect(t.ndim() == 1, op, describe(name, t) + " should be [count + 1]");
    expect_offsets(op, name, t.ptr<int32_t>(), t.numel(), total);
  }

  void indices_below(const char* op, const char* name, const TensorView& t, int64_t bound) override {
    const int32_t* p = t.ptr<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i)
      expect(p[i] >= 0 && p[i] < bound, op,
             std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) + " is outside [0, " +
                 std::to_string(bound) + ")");
  }

  // Each row t: keys in [0, t], strictly ascending, then only -1s.
  void selection(const char* op, const TensorView& topk_index) override {
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

  // The compute dtype, once the contract has checked the floating operands (an op whose contract
  // names none has no compute dtype: asking is a bug here).
  DType dtype() const {
    MOETRAIN_ASSERT(dtype_.has_value(), "the op's contract named no floating operand");
    return *dtype_;
  }

 private:
  std::optional<DType> dtype_;
};

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

  // A host-to-host copy of one dtype (the CUDA backend's copy also moves between devices).
  void copy(const TensorView& dst, const TensorView& src) override {
    const char* op = "copy";
    HostRules rules;
    rules.placed(op, "dst", dst);
    rules.fixed_dtype(op, "src", src, dst.dtype);
    expect_numel(op, "src", src, dst.numel());
    cpu::copy(dst, src);
  }

  void convert(const TensorView& dst, const TensorView& src) override {
    HostRules rules;
    check_convert(rules, dst, src);
    cpu::convert(dst, src);
  }

  void fill(const TensorView& dst, double value) override {
    HostRules rules;
    check_fill(rules, dst);
    cpu::fill(dst, value);
  }

  void random_mxfp4(const RandomMxfp4Args& args) override {
    HostRules rules;
    check_random_mxfp4(rules, args);
    cpu::random_mxfp4(args);
  }

  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override {
    HostRules rules;
    check_axpby(rules, y, x);
    dispatch("axpby", rules.dtype(), [&](auto t) { cpu::axpby<decltype(t)>(y, x, alpha, beta); });
  }

  double sum_squares(const TensorView& x) override {
    HostRules rules;
    check_sum_squares(rules, x);
    return dispatch("sum_squares", rules.dtype(), [&](auto t) { return cpu::sum_squares<decltype(t)>(x); });
  }

  void copy_columns(const CopyColumnsArgs& args) override {
    HostRules rules;
    check_copy_columns(rules, args);
    dispatch("copy_columns", rules.dtype(), [&](auto t) { cpu::copy_columns<decltype(t)>(args); });
  }

  void copy_block(const CopyBlockArgs& args) override {
    HostRules rules;
    check_copy_block(rules, args);
    dispatch("copy_block", rules.dtype(), [&](auto t) { cpu::copy_block<decltype(t)>(args); });
  }

  void sum_over_heads(const TensorView& dst, const TensorView& src) override {
    HostRules rules;
    check_sum_over_heads(rules, dst, src);
    dispatch("sum_over_heads", rules.dtype(), [&](auto t) { cpu::sum_over_heads<decltype(t)>(dst, src); });
  }

  void gemm(const GemmArgs& args) override {
    HostRules rules;
    check_gemm(rules, args);
    dispatch("gemm", rules.dtype(), [&](auto t) { cpu::gemm<decltype(t)>(args); });
  }

  void grouped_gemm(const GroupedGemmArgs& args) override {
    const char* op = "grouped_gemm";
    HostRules rules;
    check_grouped_gemm(rules, args);
    // The offsets the kernel reads were checked above; the caller's host copy must equal them.
    if (args.host_group_offsets != nullptr) {
      const int32_t* device = args.group_offsets.ptr<int32_t>();
      for (int64_t i = 0; i < args.group_offsets.numel(); ++i) {
        expect(args.host_group_offsets[i] == device[i], op,
               "host_group_offsets[" + std::to_string(i) + "] = " + std::to_string(args.host_group_offsets[i]) +
                   " but group_offsets holds " + std::to_string(device[i]));
      }
    }
    dispatch(op, rules.dtype(), [&](auto t) {
      if (given(args.b_scale)) {  // b packed (ops.h): dequantized, then the plain GEMM
        cpu::grouped_gemm_mxfp4<decltype(t)>(args);
      } else {
        cpu::grouped_gemm<decltype(t)>(args);
      }
    });
  }

  void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    const char* op = "embedding_forward";
    HostRules rules;
    check_embedding_forward(rules, op, out, table, ids);
    dispatch(op, rules.dtype(), [&](auto t) { cpu::embedding_forward<decltype(t)>(out, table, ids); });
  }

  void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) override {
    HostRules rules;
    check_embedding_backward(rules, dtable, dout, ids);
    dispatch("embedding_backward", rules.dtype(), [&](auto t) {
      cpu::embedding_backward<decltype(t)>(dtable, dout, ids);
    });
  }

  void rmsnorm_forward(const RmsNormArgs& args) override {
    HostRules rules;
    check_rmsnorm_forward(rules, args);
    dispatch("rmsnorm_forward", rules.dtype(), [&](auto t) { cpu::rmsnorm_forward<decltype(t)>(args); });
  }

  void rmsnorm_backward(const RmsNormBackwardArgs& args) override {
    HostRules rules;
    check_rmsnorm_backward(rules, args);
    dispatch("rmsnorm_backward", rules.dtype(), [&](auto t) { cpu::rmsnorm_backward<decltype(t)>(args); });
  }

  void rope(const RopeArgs& args) override {
    HostRules rules;
    check_rope(rules, args, /*max_rope_dim=*/0);
    dispatch("rope", rules.dtype(), [&](auto t) { cpu::rope<decltype(t)>(args); });
  }

  void attention_forward(const AttentionArgs& args) override {
    HostRules rules;
    check_attention_forward(rules, args);
    dispatch("attention_forward", rules.dtype(), [&](auto t) { cpu::attention_forward<decltype(t)>(args); });
  }

  void attention_backward(const AttentionBackwardArgs& args) override {
    HostRules rules;
    check_attention_backward(rules, args);
    dispatch("attention_backward", rules.dtype(), [&](auto t) { cpu::attention_backward<decltype(t)>(args); });
  }

  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    HostRules rules;
    check_swiglu_forward(rules, h, gate_up);
    dispatch("swiglu_forward", rules.dtype(), [&](auto t) { cpu::swiglu_forward<decltype(t)>(h, gate_up); });
  }

  void swiglu_backward(const SwigluBackwardArgs& args) override {
    HostRules rules;
    check_swiglu_backward(rules, args);
    dispatch("swiglu_backward", rules.dtype(), [&](auto t) { cpu::swiglu_backward<decltype(t)>(args); });
  }

  void attn_res_forward(const AttnResArgs& args) override {
    HostRules rules;
    check_attn_res_forward(rules, args);
    dispatch("attn_res_forward", rules.dtype(), [&](auto t) { cpu::attn_res_forward<decltype(t)>(args); });
  }

  void attn_res_backward(const AttnResBackwardArgs& args) override {
    HostRules rules;
    check_attn_res_backward(rules, args);
    dispatch("attn_res_backward", rules.dtype(), [&](auto t) { cpu::attn_res_backward<decltype(t)>(args); });
  }

  void situ_forward(const SituArgs& args) override {
    HostRules rules;
    check_situ_forward(rules, args);
    dispatch("situ_forward", rules.dtype(), [&](auto t) { cpu::situ_forward<decltype(t)>(args); });
  }

  void situ_backward(const SituBackwardArgs& args) override {
    HostRules rules;
    check_situ_backward(rules, args);
    dispatch("situ_backward", rules.dtype(), [&](auto t) { cpu::situ_backward<decltype(t)>(args); });
  }

  void router_forward(const RouterArgs& args) override {
    HostRules rules;
    check_router_forward(rules, args);
    dispatch("router_forward", rules.dtype(), [&](auto t) { cpu::router_forward<decltype(t)>(args); });
  }

  void router_backward(const RouterBackwardArgs& args) override {
    HostRules rules;
    check_router_backward(rules, args);
    dispatch("router_backward", rules.dtype(), [&](auto t) { cpu::router_backward<decltype(t)>(args); });
  }

  void aux_loss(const AuxLossArgs& args) override {
    HostRules rules;
    check_aux_loss(rules, args);
    dispatch("aux_loss", rules.dtype(), [&](auto t) { cpu::aux_loss<decltype(t)>(args); });
  }

  void moe_permutation(const MoePermutationArgs& args) override {
    HostRules rules;
    check_moe_permutation(rules, args);
    cpu::moe_permutation<float>(args);  // integers only: the element type is irrelevant
  }

  void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                   int64_t top_k) override {
    HostRules rules;
    check_moe_permute(rules, out, x, sorted_pair, top_k);
    dispatch("moe_permute", rules.dtype(), [&](auto t) { cpu::moe_permute<decltype(t)>(out, x, sorted_pair, top_k); });
  }

  void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                         bool accumulate) override {
    HostRules rules;
    check_moe_unpermute_sum(rules, dx, drows, pair_row, top_k);
    dispatch("moe_unpermute_sum", rules.dtype(), [&](auto t) {
      cpu::moe_unpermute_sum<decltype(t)>(dx, drows, pair_row, top_k, accumulate);
    });
  }

  void moe_combine(const MoeCombineArgs& args) override {
    HostRules rules;
    check_moe_combine(rules, args);
    dispatch("moe_combine", rules.dtype(), [&](auto t) { cpu::moe_combine<decltype(t)>(args); });
  }

  void moe_combine_backward(const MoeCombineBackwardArgs& args) override {
    HostRules rules;
    check_moe_combine_backward(rules, args);
    dispatch("moe_combine_backward", rules.dtype(), [&](auto t) { cpu::moe_combine_backward<decltype(t)>(args); });
  }

  void cross_entropy(const CrossEntropyArgs& args) override {
    HostRules rules;
    check_cross_entropy(rules, args);
    dispatch("cross_entropy", rules.dtype(), [&](auto t) { cpu::cross_entropy<decltype(t)>(args); });
  }

  void adamw(const AdamWArgs& args) override {
    HostRules rules;
    check_adamw(rules, args);
    dispatch("adamw", rules.dtype(), [&](auto t) { cpu::adamw<decltype(t)>(args); });
  }

  void short_conv_forward(const ShortConvArgs& args) override {
    HostRules rules;
    check_short_conv_forward(rules, args);
    dispatch("short_conv_forward", rules.dtype(), [&](auto t) { cpu::short_conv_forward<decltype(t)>(args); });
  }

  void short_conv_backward(const ShortConvBackwardArgs& args) override {
    HostRules rules;
    check_short_conv_backward(rules, args);
    dispatch("short_conv_backward", rules.dtype(), [&](auto t) { cpu::short_conv_backward<decltype(t)>(args); });
  }

  void l2norm_forward(const L2NormArgs& args) override {
    HostRules rules;
    check_l2norm_forward(rules, args);
    dispatch("l2norm_forward", rules.dtype(), [&](auto t) { cpu::l2norm_forward<decltype(t)>(args); });
  }

  void l2norm_backward(const L2NormBackwardArgs& args) override {
    HostRules rules;
    check_l2norm_backward(rules, args);
    dispatch("l2norm_backward", rules.dtype(), [&](auto t) { cpu::l2norm_backward<decltype(t)>(args); });
  }

  void kda_gate_forward(const KdaGateArgs& args) override {
    HostRules rules;
    check_kda_gate_forward(rules, args);
    dispatch("kda_gate_forward", rules.dtype(), [&](auto t) { cpu::kda_gate_forward<decltype(t)>(args); });
  }

  void kda_gate_backward(const KdaGateBackwardArgs& args) override {
    HostRules rules;
    check_kda_gate_backward(rules, args);
    dispatch("kda_gate_backward", rules.dtype(), [&](auto t) { cpu::kda_gate_backward<decltype(t)>(args); });
  }

  void kda_forward(const KdaArgs& args) override {
    HostRules rules;
    check_kda_forward(rules, args);
    dispatch("kda_forward", rules.dtype(), [&](auto t) { cpu::kda_chunked_forward<decltype(t)>(args); });
  }

  void kda_backward(const KdaBackwardArgs& args) override {
    HostRules rules;
    check_kda_backward(rules, args);
    dispatch("kda_backward", rules.dtype(), [&](auto t) { cpu::kda_chunked_backward<decltype(t)>(args); });
  }

  void gated_rmsnorm_forward(const GatedRmsNormArgs& args) override {
    HostRules rules;
    check_gated_rmsnorm_forward(rules, args);
    dispatch("gated_rmsnorm_forward", rules.dtype(), [&](auto t) { cpu::gated_rmsnorm_forward<decltype(t)>(args); });
  }

  void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) override {
    HostRules rules;
    check_gated_rmsnorm_backward(rules, args);
    dispatch("gated_rmsnorm_backward", rules.dtype(), [&](auto t) { cpu::gated_rmsnorm_backward<decltype(t)>(args); });
  }

  void sigmoid_forward(const TensorView& y, const TensorView& x) override {
    HostRules rules;
    check_sigmoid_forward(rules, y, x);
    dispatch("sigmoid_forward", rules.dtype(), [&](auto t) { cpu::sigmoid_forward<decltype(t)>(y, x); });
  }

  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override {
    HostRules rules;
    check_sigmoid_backward(rules, dx, dy, y);
    dispatch("sigmoid_backward", rules.dtype(), [&](auto t) { cpu::sigmoid_backward<decltype(t)>(dx, dy, y); });
  }

  void layernorm_forward(const LayerNormArgs& args) override {
    HostRules rules;
    check_layernorm_forward(rules, args);
    dispatch("layernorm_forward", rules.dtype(), [&](auto t) { cpu::layernorm_forward<decltype(t)>(args); });
  }

  void dsa_indexer_topk(const DsaIndexerArgs& args) override {
    HostRules rules;
    check_dsa_indexer_topk(rules, args);
    dispatch("dsa_indexer_topk", rules.dtype(), [&](auto t) { cpu::dsa_indexer_topk<decltype(t)>(args); });
  }

  void sparse_attention_forward(const SparseAttentionArgs& args) override {
    HostRules rules;
    check_sparse_attention_forward(rules, args);
    dispatch("sparse_attention_forward", rules.dtype(), [&](auto t) {
      cpu::sparse_attention_forward<decltype(t)>(args);
    });
  }

  void sparse_attention_backward(const SparseAttentionBackwardArgs& args) override {
    HostRules rules;
    check_sparse_attention_backward(rules, args);
    dispatch("sparse_attention_backward", rules.dtype(), [&](auto t) {
      cpu::sparse_attention_backward<decltype(t)>(args);
    });
  }

  void attention_gate_forward(const AttentionGateArgs& args) override {
    HostRules rules;
    check_attention_gate_forward(rules, args);
    dispatch("attention_gate_forward", rules.dtype(), [&](auto t) { cpu::attention_gate_forward<decltype(t)>(args); });
  }

  void attention_gate_backward(const AttentionGateBackwardArgs& args) override {
    HostRules rules;
    check_attention_gate_backward(rules, args);
    dispatch("attention_gate_backward", rules.dtype(), [&](auto t) {
      cpu::attention_gate_backward<decltype(t)>(args);
    });
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace moetrain::kernels
