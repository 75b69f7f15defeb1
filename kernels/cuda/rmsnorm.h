// RMSNorm on the CUDA backend: one block per row, F32 math; x, y, weight, dx, dy each BF16 or
// F32; rstd and dweight F32. Forward and backward side by side in rmsnorm.cu.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void rmsnorm_forward(const RmsNormArgs& args, cudaStream_t stream);
// dweight (when given) is a deterministic two-stage column sum: per-chunk partials of a fixed
// number of rows into scratch, then the chunks in order.
void rmsnorm_backward(const RmsNormBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
