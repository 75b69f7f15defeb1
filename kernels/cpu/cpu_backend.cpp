// The CPU reference backend: the public entry of every op. Each method checks its arguments
// against the op's contract (kernels/op_contracts.h) under the CPU's rules (HostRules: host
// tensors, one compute dtype, index values read and range-checked), then dispatches on the
// compute dtype (F32 -> float, F64 -> double) to the templated functions of
// kernels/cpu/reference.h, which hold the arithmetic. A failed check is a bug in the caller:
// Error(kInternal) naming the op, the argument and both shapes. (Bad token ids are the one
// user-data error here: embedding_forward throws kBadData.)
//
// Every op that takes an argument struct has the same entry, written once from the op list
// (kernels/op_list.h): check_<op>(rules, args), then cpu::<op><T>(args). The ops with plain
// parameters are written out.
#include <optional>
#include <string>

#include "kernels/cpu/reference.h"
#include "kernels/arg_checks.h"
#include "kernels/op_contracts.h"
#include "kernels/op_list.h"
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

  // The kernel reads the device values, checked by offsets(): the host copy must equal them.
  void host_offsets(const char* op, const char* name, const int32_t* host, const TensorView& device,
                    int64_t) override {
    const int32_t* values = device.ptr<int32_t>();
    for (int64_t i = 0; i < device.numel(); ++i) {
      expect(host[i] == values[i], op,
             "host_" + std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(host[i]) + " but " +
                 name + " holds " + std::to_string(values[i]));
    }
  }

  // Each row t: keys in [0, t + key_offset], strictly ascending, then only -1s.
  void selection(const char* op, const TensorView& topk_index, int64_t key_offset) override {
    const int64_t top_k = topk_index.size(1);
    const int32_t* p = topk_index.ptr<int32_t>();
    for (int64_t t = 0; t < topk_index.size(0); ++t) {
      const int32_t* row = p + t * top_k;
      int64_t i = 0;
      for (; i < top_k && row[i] >= 0; ++i) {
        expect(row[i] <= t + key_offset && (i == 0 || row[i] > row[i - 1]), op,
               "topk_index[" + std::to_string(t) + ", " + std::to_string(i) + "] = " + std::to_string(row[i]) +
                   ": a query's keys must be rows <= the query's own (" + std::to_string(t + key_offset) +
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
  bool has_dtype() const { return dtype_.has_value(); }

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

// Calls f(T{}) with T the call's compute dtype. An op whose contract names no floating operand
// (random_mxfp4's codes, moe_permutation's indices) has none: its reference does not depend on T
// and runs as float.
template <typename F>
void dispatch(const char* op, const HostRules& rules, F&& f) {
  if (rules.has_dtype()) {
    dispatch(op, rules.dtype(), f);
  } else {
    f(float{});
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

  void sum_over_heads(const TensorView& dst, const TensorView& src) override {
    HostRules rules;
    check_sum_over_heads(rules, dst, src);
    dispatch("sum_over_heads", rules.dtype(), [&](auto t) { cpu::sum_over_heads<decltype(t)>(dst, src); });
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

  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    HostRules rules;
    check_swiglu_forward(rules, h, gate_up);
    dispatch("swiglu_forward", rules.dtype(), [&](auto t) { cpu::swiglu_forward<decltype(t)>(h, gate_up); });
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

  // The ops that take an argument struct.
#define MOETRAIN_CPU_OP(op, Args)                                                       \
  void op(const Args& args) override {                                                  \
    HostRules rules;                                                                    \
    check_##op(rules, args);                                                            \
    dispatch(#op, rules, [&](auto t) { cpu::op<decltype(t)>(args); });            \
  }
  MOETRAIN_STRUCT_OPS(MOETRAIN_CPU_OP)
#undef MOETRAIN_CPU_OP
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace moetrain::kernels
