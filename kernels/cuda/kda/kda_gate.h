// KDA's gate activations on the CUDA backend (kernels/ops.h): the forget gate (KdaGateArgs; f BF16
// or F32, g, dg, a_log, dt_bias F32) and the elementwise sigmoid of beta (any mix of BF16 and F32).
// Forward and backward side by side in kda_gate.cu.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void kda_gate_forward(const KdaGateArgs& args, cudaStream_t stream);
void kda_gate_backward(const KdaGateBackwardArgs& args, cudaStream_t stream);

void sigmoid_forward(const TensorView& y, const TensorView& x, cudaStream_t stream);
// dx may share memory with dy (elementwise).
void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
