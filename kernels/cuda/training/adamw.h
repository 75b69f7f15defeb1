// AdamW on the CUDA backend: param, grad, exp_avg, exp_avg_sq all F32, updated in place with
// the CPU reference's formula (per-step scalars computed on the host in double).
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void adamw(const AdamWArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
