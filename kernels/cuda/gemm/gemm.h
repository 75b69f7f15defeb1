// The GEMM launchers of the CUDA backend: GEMM through cuBLASLt, the grouped GEMM's entry
// (grouped_gemm.h), and the small memory-bound helpers around them (axpby, sum of squares,
// column copies, sum over heads).
// Launchers follow the backend convention (see cuda_backend.cpp): the op's arguments, then
// what the op needs of the backend (cuBLAS handles, scratch), then the stream. Arguments are
// checked by CudaBackend before they get here.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/gemm/grouped_gemm.h"
#include "kernels/cuda/common/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// cuBLASLt's descriptors and the heuristic's algorithm for each GEMM shape seen (dimensions,
// transposes, output dtype, pointer alignments), built on the shape's first call: a repeated
// shape creates no descriptor and asks no heuristic. One per backend (one stream, one thread).
class GemmPlanCache {
 public:
  GemmPlanCache();
  ~GemmPlanCache();
  GemmPlanCache(const GemmPlanCache&) = delete;
  GemmPlanCache& operator=(const GemmPlanCache&) = delete;

  struct Plans;  // gemm.cu

  Plans& plans() { return *plans_; }

 private:
  std::unique_ptr<Plans> plans_;
};

// What a GEMM needs of the backend: the cuBLASLt handle and its workspace, a plain cuBLAS
// handle for shapes cuBLASLt's heuristic offers no algorithm for, scratch space for BF16
// copies of F32 operands, and the per-shape cuBLASLt plans.
struct BlasContext {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DeviceScratch* scratch = nullptr;
  GemmPlanCache* plans = nullptr;
};

// c = alpha * op(a) . op(b) + beta * c; a, b, c each BF16 or F32 (F32 a/b rounded to BF16 first),
// F32 accumulation; c is not read when beta == 0.
void gemm(const GemmArgs& args, const BlasContext& blas, cudaStream_t stream);

// gemm with an FP8 b (ops.h GemmFp8Args): b decoded inside the mainloop of the FP8 kernel
// (grouped_gemm_fp8.h, one group of all rows) where it takes the shape, else decoded to BF16 in
// scratch (fp8_decode.h), then gemm.
void gemm_fp8(const GemmFp8Args& args, const BlasContext& blas, cudaStream_t stream);

// How an FP8-weight GEMM runs (tests and the benchmark report it): kMainloop, the kernel that
// decodes inside its mainloop; kScratch, the decode into BF16 scratch and the BF16 GEMM, for
// shapes, layouts (a transposed) or devices the first refuses.
enum class Fp8GemmPath { kMainloop, kScratch };
Fp8GemmPath fp8_gemm_path(const GemmFp8Args& args);
Fp8GemmPath fp8_gemm_path(const GroupedGemmArgs& args);  // b_scale F32

// The grouped GEMM of ops.h in one launch (grouped_gemm.h), group offsets read on the device;
// F32 a or b rounded to BF16 into scratch first; an FP8 b (b_scale F32) as for gemm_fp8.
void grouped_gemm(const GroupedGemmArgs& args, const BlasContext& blas, cudaStream_t stream);

// The kernel grouped_gemm runs for these arguments (tests and the benchmark report it); for an FP8
// b, kSm90 is also the FP8 kernel (fp8_gemm_path tells which).
GroupedGemmPath grouped_gemm_path(const GroupedGemmArgs& args);

// y = alpha * x + beta * y (y not read when beta == 0); x, y each BF16 or F32.
void axpby(const TensorView& y, const TensorView& x, double alpha, double beta, cudaStream_t stream);

// sum of x^2 over every element in double, in a fixed order (a function of the element count
// only): two passes, no atomics. Waits for the stream (the result goes to the host).
double sum_squares(const TensorView& x, DeviceScratch& scratch, cudaStream_t stream);

void copy_columns(const CopyColumnsArgs& args, cudaStream_t stream);
void copy_block(const CopyBlockArgs& args, cudaStream_t stream);
void sum_over_heads(const TensorView& dst, const TensorView& src, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
