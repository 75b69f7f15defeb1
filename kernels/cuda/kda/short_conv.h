// The causal depthwise short convolution of KDA (kernels/ops.h, ShortConvArgs) on the CUDA
// backend: x, y, dx, dy and weight BF16 or F32; dweight F32. Forward and backward in short_conv.cu.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// The widest kernel the CUDA short convolution takes (Kimi's is 4).
constexpr int kShortConvMaxWidth = 8;

void short_conv_forward(const ShortConvArgs& args, cudaStream_t stream);
// dx must not share memory with dy or x (tiles read their neighbours' tokens). dweight, when
// given, is summed per tile of tokens and then over the tiles in order (deterministic).
void short_conv_backward(const ShortConvBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
