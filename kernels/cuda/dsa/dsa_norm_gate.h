// The DSA indexer key's LayerNorm and the attention output gate on the CUDA backend (kernels/ops.h
// LayerNormArgs, AttentionGateArgs; spec in kernels/cpu/dsa.* and kernels/cpu/attention_gate.*),
// in dsa_norm_gate.cu: layernorm_forward one warp per row; the gate forward and backward
// elementwise, or one warp per (token, head) when headwise. Operands BF16 or F32 each; every
// output is overwritten, every sum runs in a fixed order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void layernorm_forward(const LayerNormArgs& args, cudaStream_t stream);
void attention_gate_forward(const AttentionGateArgs& args, cudaStream_t stream);
void attention_gate_backward(const AttentionGateBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
