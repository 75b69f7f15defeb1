// RMSNorm on the CUDA backend: F32 math; x, y, weight, dx, dy each BF16 or F32; rstd and dweight
// F32. Rows are held in registers and read once (rmsnorm.cu says when, and the fallbacks).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/common/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void rmsnorm_forward(const RmsNormArgs& args, cudaStream_t stream);
// dweight (when given) is a deterministic two-stage column sum: partial rows over fixed ranges of
// rows into scratch (fused into the dx kernel), then their total in a fixed tree.
void rmsnorm_backward(const RmsNormBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
