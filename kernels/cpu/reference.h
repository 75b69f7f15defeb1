// The CPU reference: one function per op of kernels/ops.h, the spec the CUDA kernels are tested
// against. cpu::<op><T> computes the op in the element type T (float or double) on contiguous host
// tensors; the backend's entry points (cpu_backend.cpp) have checked shapes and dtypes. Each op
// family's file, kernels/cpu/<family>.cpp, opens with its formulas and says what every function
// overwrites or accumulates.
#pragma once

#include <cstdint>

#include "kernels/op_list.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// template <typename T> void <op>(const <Args>& args) for every op that takes an argument struct
// (kernels/op_list.h). T is unused by random_mxfp4 (bytes) and moe_permutation (int32 indices).
#define MOETRAIN_DECLARE_REFERENCE(op, Args) \
  template <typename T>                      \
  void op(const Args& args);
MOETRAIN_STRUCT_OPS(MOETRAIN_DECLARE_REFERENCE)
#undef MOETRAIN_DECLARE_REFERENCE

// The ops with plain parameters.
template <typename T>
void axpby(const TensorView& y, const TensorView& x, double alpha, double beta);
template <typename T>
double sum_squares(const TensorView& x);
template <typename T>
void sum_over_heads(const TensorView& dst, const TensorView& src);
template <typename T>
void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids);
template <typename T>
void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids);
template <typename T>
void swiglu_forward(const TensorView& h, const TensorView& gate_up);
template <typename T>
void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k);
template <typename T>
void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                       bool accumulate);
template <typename T>
void sigmoid_forward(const TensorView& y, const TensorView& x);
template <typename T>
void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y);

// Memory, any dtype (dense.cpp).
void fill(const TensorView& dst, double value);
void copy(const TensorView& dst, const TensorView& src);
void convert(const TensorView& dst, const TensorView& src);

}  // namespace moetrain::kernels::cpu

// Instantiates a reference op template for both element types; the arguments after the name are
// the op's parameter types, none of which depend on T.
#define MOETRAIN_CPU_INSTANTIATE(op, ...)   \
  template void op<float>(__VA_ARGS__);     \
  template void op<double>(__VA_ARGS__);
