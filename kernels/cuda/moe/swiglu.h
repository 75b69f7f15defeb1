// SwiGLU on the CUDA backend: h = silu(gate) * up with gate_up = [gate | up] per row. Every
// operand BF16 or F32, math in F32. The backward may write dgate_up over gate_up: each thread
// reads its elements before writing the same ones. SiTU (ops.h SituArgs) shares the layout and
// these rules.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void swiglu_forward(const TensorView& h, const TensorView& gate_up, cudaStream_t stream);
void swiglu_backward(const SwigluBackwardArgs& args, cudaStream_t stream);
void situ_forward(const SituArgs& args, cudaStream_t stream);
void situ_backward(const SituBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
