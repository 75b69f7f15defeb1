// Dense ops of the CUDA backend: GEMM and grouped GEMM through cuBLASLt, and the small
// memory-bound helpers around them (axpby, sum of squares, column copies, sum over heads).
// Launchers follow the backend convention (see cuda_backend.cpp): the op's arguments, then
// what the op needs of the backend (cuBLAS handles, scratch), then the stream. Arguments are
// checked by CudaBackend before they get here.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// What a GEMM needs of the backend: the cuBLASLt handle and its workspace, a plain cuBLAS
// handle for shapes cuBLASLt's heuristic offers no algorithm for, and scratch space for BF16
// copies of F32 operands.
struct BlasContext {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceScratch* scratch = nullptr;
};

// c = alpha * op(a) . op(b) + beta * c; a, b, c each BF16 or F32 (F32 a/b rounded to BF16 first),
// F32 accumulation; c is not read when beta == 0.
void gemm(const GemmArgs& args, const BlasContext& blas, cudaStream_t stream);

// The grouped GEMM of ops.h, one cuBLASLt call per non-empty group. `host_offsets` is
// args.group_offsets copied to the host (and validated) by the caller.
void grouped_gemm(const GroupedGemmArgs& args, const std::vector<int32_t>& host_offsets, const BlasContext& blas,
                  cudaStream_t stream);

// y = alpha * x + beta * y (y not read when beta == 0); x, y each BF16 or F32.
void axpby(const TensorView& y, const TensorView& x, double alpha, double beta, cudaStream_t stream);

// sum of x^2 over every element in double, in a fixed order (a function of the element count
// only): two passes, no atomics. Waits for the stream (the result goes to the host).
double sum_squares(const TensorView& x, DeviceScratch& scratch, cudaStream_t stream);

void copy_columns(const CopyColumnsArgs& args, cudaStream_t stream);
void sum_over_heads(const TensorView& dst, const TensorView& src, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
