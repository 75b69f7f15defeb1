// Dense linear algebra and memory ops of the CPU reference backend (see kernels/ops.h for the
// contract of each). Shapes and dtypes are checked by the backend's entry points
// (cpu_backend.cpp); these functions assume contiguous host tensors of element type T.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// c = alpha * op(a) . op(b) + beta * c, accumulated in T. beta == 0 never reads c (so stale
// NaNs in an output buffer do not leak into it), as in BLAS.
template <typename T>
void gemm(const GemmArgs& args);

// Both MoE layouts (see GroupedGemmArgs). Empty groups are normal: kMGrouped has nothing to do
// for them; kKGrouped sets c[g] = beta * c[g] (zero for beta == 0).
template <typename T>
void grouped_gemm(const GroupedGemmArgs& args);

// y = alpha * x + beta * y; beta == 0 never reads y.
template <typename T>
void axpby(const TensorView& y, const TensorView& x, double alpha, double beta);

// Sum of squares in double, in index order.
template <typename T>
double sum_squares(const TensorView& x);

// Rows are the tensor's elements grouped by its last dimension.
template <typename T>
void copy_columns(const CopyColumnsArgs& args);

// CopyBlockArgs (kernels/ops.h): dst and src of one dtype, the product alpha * src in T.
template <typename T>
void copy_block(const CopyBlockArgs& args);

// dst [tokens, dim] = sum over h of src [tokens, heads, dim] (src may be given as
// [tokens * heads, dim]: row r of src belongs to token r / heads).
template <typename T>
void sum_over_heads(const TensorView& dst, const TensorView& src);

// Any dtype: floating values are rounded to nearest (bf16/f16 nearest-even), integer ones
// truncated toward zero.
void fill(const TensorView& dst, double value);
// Byte copy of two host tensors of the same dtype and element count.
void copy(const TensorView& dst, const TensorView& src);
// Element conversion between F32, F64, BF16, F16, I32 and I64 (host tensors, same element
// count). To bf16/f16 rounds to nearest even (through float for F64: double rounding, which
// can differ from a direct F64 -> bf16 rounding in the last bit in rare halfway cases).
void convert(const TensorView& dst, const TensorView& src);

}  // namespace moetrain::kernels::cpu
