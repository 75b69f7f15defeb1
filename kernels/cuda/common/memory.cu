#include "kernels/cuda/common/memory.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double load_as_double(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return 0.0;
  }
}

__device__ __forceinline__ void store_from_double(void* p, DType dtype, int64_t i, double value) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(value); break;
    case DType::kF64: static_cast<double*>(p)[i] = value; break;
    case DType::kBF16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(value); break;
    case DType::kF16: static_cast<__half*>(p)[i] = __double2half(value); break;
    default: break;
  }
}

__global__ void convert_floating_kernel(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_from_double(dst, dst_dtype, i, load_as_double(src, src_dtype, i));
}

__global__ void convert_integer_kernel(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = src_dtype == DType::kI64 ? static_cast<const int64_t*>(src)[i]
                                               : static_cast<int64_t>(static_cast<const int32_t*>(src)[i]);
    if (dst_dtype == DType::kI64)
      static_cast<int64_t*>(dst)[i] = v;
    else
      static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
  }
}

template <typename Word>
__global__ void fill_kernel(Word* dst, Word value, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}

bool is_integer(DType dtype) { return dtype == DType::kI32 || dtype == DType::kI64; }

}  // namespace

void convert(const TensorView& dst, const TensorView& src, cudaStream_t stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype == src.dtype) {
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (is_integer(dst.dtype)) {
    convert_integer_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst.data, dst.dtype, src.data, src.dtype, n);
  } else {
    convert_floating_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst.data, dst.dtype, src.data, src.dtype, n);
  }
  CUDA_CHECK_LAUNCH();
}

void fill_pattern(const TensorView& dst, uint64_t pattern, cudaStream_t stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const unsigned int blocks = grid_for(n, kThreads);
  switch (dtype_size(dst.dtype)) {
    case 1: CUDA_CHECK(cudaMemsetAsync(dst.data, static_cast<int>(pattern & 0xffu), static_cast<size_t>(n), stream)); return;
    case 2: fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint16_t*>(dst.data), static_cast<uint16_t>(pattern), n); break;
    case 4: fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint32_t*>(dst.data), static_cast<uint32_t>(pattern), n); break;
    case 8: fill_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint64_t*>(dst.data), pattern, n); break;
    default: MOETRAIN_CHECK(false, ExitCode::kInternal, "cuda fill: unsupported element size");
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
