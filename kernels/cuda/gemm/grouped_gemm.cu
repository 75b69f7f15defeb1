// The grouped GEMM's entry and its plain fallback (see grouped_gemm.h); the Hopper kernel is
// grouped_gemm_sm90.cu. The fallback computes one output element per thread, F32 sums in order,
// from global memory: any shape and alignment, one launch.
#include "kernels/cuda/gemm/grouped_gemm.h"

#include <cuda_bf16.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;

// ---------------------------------------------------------------------------------------------
// The fallback: one thread per output element, F32 sums in order, from global memory.

struct FallbackParams {
  void* c;
  int c_f32;
  const bf16* a;
  const bf16* b;
  const int32_t* offsets;
  int64_t groups, rows;
  int64_t n, k;          // m-grouped
  const bf16* a2;         // m-grouped, optional: a2 [rows, k2] . op(b2)
  const bf16* b2;
  int64_t k2;
  int64_t n_out, n_in;   // k-grouped
  int transpose_b;
  float alpha, beta;
};

__global__ void m_grouped_fallback_kernel(const FallbackParams p) {
  const int64_t total = p.rows * p.n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.n, j = i % p.n;
    // The group holding row r: offsets[g] <= r < offsets[g + 1]; a row in none is left alone.
    if (r < p.offsets[0] || r >= p.offsets[p.groups]) continue;
    int64_t lo = 0, hi = p.groups;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.offsets[mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (!(p.offsets[lo] <= r && r < p.offsets[lo + 1])) continue;  // offsets out of order
    const bf16* a = p.a + r * p.k;
    float sum = 0.0f;
    if (p.transpose_b) {
      const bf16* b = p.b + (lo * p.n + j) * p.k;
      for (int64_t q = 0; q < p.k; ++q) sum += __bfloat162float(a[q]) * __bfloat162float(b[q]);
    } else {
      const bf16* b = p.b + lo * p.k * p.n + j;
      for (int64_t q = 0; q < p.k; ++q) sum += __bfloat162float(a[q]) * __bfloat162float(b[q * p.n]);
    }
    if (p.k2 > 0) {
      const bf16* a2 = p.a2 + r * p.k2;
      const bf16* b2 = p.b2 + lo * p.n * p.k2;
      for (int64_t q = 0; q < p.k2; ++q) {
        const bf16 w = p.transpose_b ? b2[j * p.k2 + q] : b2[q * p.n + j];
        sum += __bfloat162float(a2[q]) * __bfloat162float(w);
      }
    }
    grouped::store_output(p, i, sum);
  }
}

__global__ void k_grouped_fallback_kernel(const FallbackParams p) {
  const int64_t per_group = p.n_out * p.n_in, total = p.groups * per_group;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = i / per_group, row = i % per_group / p.n_in, column = i % p.n_in;
    const int64_t begin = min(max(static_cast<int64_t>(p.offsets[g]), int64_t{0}), p.rows);
    const int64_t end = min(max(static_cast<int64_t>(p.offsets[g + 1]), begin), p.rows);
    float sum = 0.0f;
    for (int64_t r = begin; r < end; ++r)
      sum += __bfloat162float(p.a[r * p.n_out + row]) * __bfloat162float(p.b[r * p.n_in + column]);
    grouped::store_output(p, i, sum);
  }
}

void launch_fallback(const GroupedGemmProblem& p, cudaStream_t stream) {
  FallbackParams params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.a = static_cast<const bf16*>(p.a);
  params.b = static_cast<const bf16*>(p.b);
  params.offsets = p.group_offsets;
  params.groups = p.groups;
  params.rows = p.rows;
  params.n = p.n;
  params.k = p.k;
  params.a2 = static_cast<const bf16*>(p.a2);
  params.b2 = static_cast<const bf16*>(p.b2);
  params.k2 = p.k2;
  params.n_out = p.n_out;
  params.n_in = p.n_in;
  params.transpose_b = p.transpose_b ? 1 : 0;
  params.alpha = p.alpha;
  params.beta = p.beta;
  constexpr int kFallbackThreads = 256;
  if (p.kind == GroupedGemmKind::kMGrouped) {
    m_grouped_fallback_kernel<<<grid_for(p.rows * p.n, kFallbackThreads), kFallbackThreads, 0, stream>>>(params);
  } else {
    k_grouped_fallback_kernel<<<grid_for(p.groups * p.n_out * p.n_in, kFallbackThreads), kFallbackThreads, 0,
                                stream>>>(params);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_grouped_gemm(const GroupedGemmProblem& p, cudaStream_t stream) {
  const bool m_grouped = p.kind == GroupedGemmKind::kMGrouped;
  if (p.groups == 0) return;
  if (m_grouped ? p.rows == 0 || p.n == 0 : p.n_out == 0 || p.n_in == 0) return;
  if (grouped_gemm_path(p) == GroupedGemmPath::kFallback) {
    launch_fallback(p, stream);  // also the empty sums (k == 0, no rows): beta * c
    return;
  }
  launch_grouped_gemm_sm90(p, stream);
}

}  // namespace moetrain::kernels::cuda_ops
