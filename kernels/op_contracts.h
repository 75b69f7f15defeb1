// Every op's argument contract, written once for all backends: the ranks, shapes and sizes its
// arguments must have relative to each other, the memory they may or must not share, and the role
// of each operand. A backend's entry point calls check_<op>(rules, args) with its OperandRules,
// which decide what differs per backend: the device an operand must live on, the dtypes it
// computes in, and whether index tensors are read back to check their values. Checks that only
// one backend needs (a kernel's size limit, a read-back of token ids) stay in that backend.
// A failed check throws Error(kInternal) "kernel argument: <op>: ..." (kernels/arg_checks.h).
#pragma once

#include <cstdint>

#include "core/base/tensor.h"
#include "kernels/op_list.h"
#include "kernels/ops.h"

namespace moetrain::kernels {

// What a backend accepts for an operand. The operand classes are those of ops.h's "Compute
// dtype" convention.
class OperandRules {
 public:
  explicit OperandRules(Device device) : device_(device) {}
  virtual ~OperandRules() = default;

  // An activation, a frozen weight or a gradient of either.
  virtual void activation(const char* op, const char* name, const TensorView& t) = 0;
  // An accumulation operand: saved statistics, losses, router scores, parameter gradients,
  // optimizer state, cos/sin tables.
  virtual void accumulation(const char* op, const char* name, const TensorView& t) = 0;
  // int32 prefix sums [count + 1] over `total` rows; `count_name` ("sequences", "groups") is
  // what the entries delimit, for messages.
  virtual void offsets(const char* op, const char* name, const TensorView& t, int64_t total,
                       const char* count_name) = 0;
  // Every entry of the int32 `t` in [0, bound), on a backend that reads index tensors.
  virtual void indices_below(const char* op, const char* name, const TensorView& t, int64_t bound) = 0;
  // A sparse attention's topk_index rows are causal selections (ops.h: query t's keys are rows
  // <= t + key_offset), on a backend that reads index tensors.
  virtual void selection(const char* op, const TensorView& topk_index, int64_t key_offset) = 0;
  // The caller's host copy `host` of the offsets `device` (checked by offsets() already): equal to
  // the device values on a backend that reads them, prefix sums over `total` rows on one that
  // does not.
  virtual void host_offsets(const char* op, const char* name, const int32_t* host, const TensorView& device,
                            int64_t total) = 0;

  // On the backend's device, with memory unless it has no elements.
  void placed(const char* op, const char* name, const TensorView& t) const;
  // Placed, of a dtype no backend chooses (int32 indices, uint8 MXFP4 codes).
  void fixed_dtype(const char* op, const char* name, const TensorView& t, DType dtype) const;

 private:
  Device device_;
};

// check_<op>(rules, args) for every op that takes an argument struct (kernels/op_list.h).
#define MOETRAIN_DECLARE_CHECK(op, Args) void check_##op(OperandRules& rules, const Args& args);
MOETRAIN_STRUCT_OPS(MOETRAIN_DECLARE_CHECK)
#undef MOETRAIN_DECLARE_CHECK
// rope with the largest rope_dim the backend's kernel takes, 0 for no limit (the two-argument
// form above has none).
void check_rope(OperandRules& rules, const RopeArgs& args, int64_t max_rope_dim);

// The ops with plain parameters, given those the contract is about. `op` names the entry point of
// embedding_forward (it or a variant of it).
void check_convert(OperandRules& rules, const TensorView& dst, const TensorView& src);
void check_fill(OperandRules& rules, const TensorView& dst);
void check_axpby(OperandRules& rules, const TensorView& y, const TensorView& x);
void check_sum_squares(OperandRules& rules, const TensorView& x);
void check_sum_over_heads(OperandRules& rules, const TensorView& dst, const TensorView& src);
void check_embedding_forward(OperandRules& rules, const char* op, const TensorView& out, const TensorView& table,
                             const TensorView& ids);
void check_embedding_backward(OperandRules& rules, const TensorView& dtable, const TensorView& dout,
                              const TensorView& ids);
void check_swiglu_forward(OperandRules& rules, const TensorView& h, const TensorView& gate_up);
void check_moe_permute(OperandRules& rules, const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                       int64_t top_k);
void check_moe_unpermute_sum(OperandRules& rules, const TensorView& dx, const TensorView& drows,
                             const TensorView& pair_row, int64_t top_k);
void check_sigmoid_forward(OperandRules& rules, const TensorView& y, const TensorView& x);
void check_sigmoid_backward(OperandRules& rules, const TensorView& dx, const TensorView& dy, const TensorView& y);

}  // namespace moetrain::kernels
