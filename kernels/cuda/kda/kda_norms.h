// The row norms of the KDA layer (kernels/ops.h, L2NormArgs and GatedRmsNormArgs) on the CUDA
// backend: one warp per row, F32 math; activations (x, y, gate, weight and their gradients) BF16
// or F32, inv_norm / rstd / dweight F32. Forward and backward side by side in kda_norms.cu.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void l2norm_forward(const L2NormArgs& args, cudaStream_t stream);
// dx may share memory with dy (each lane rewrites only the elements it read).
void l2norm_backward(const L2NormBackwardArgs& args, cudaStream_t stream);

void gated_rmsnorm_forward(const GatedRmsNormArgs& args, cudaStream_t stream);
// dweight (when given) is a deterministic two-stage column sum over chunks of rows; it reads dy
// after dx is written, so dx must not share memory with dy or x then.
void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
