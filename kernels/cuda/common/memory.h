// Device-side dtype conversion and fill for the CUDA backend (copies are plain cudaMemcpyAsync
// calls in cuda_backend.cpp). Arguments are checked by CudaBackend.
#pragma once

#include <cuda_runtime.h>

#include "core/base/tensor.h"

namespace moetrain::kernels::cuda_ops {

// Same element count, both on the device. Floating <-> floating among F32, F64, BF16, F16
// (rounded to nearest even, through double, so F64 -> BF16 rounds once); I32 <-> I64.
void convert(const TensorView& dst, const TensorView& src, cudaStream_t stream);

// Every element of dst set to the element whose bytes are `pattern` (dtype_size(dst.dtype)
// bytes, little-endian in the low bytes of the integer): the caller encodes the value.
void fill_pattern(const TensorView& dst, uint64_t pattern, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
