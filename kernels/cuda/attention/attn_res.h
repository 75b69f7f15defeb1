// Block Attention Residuals' depth mix on the CUDA backend (contract: kernels/ops.h AttnResArgs).
// One thread block per row: a first pass reduces each value's sum of squares and scores (and,
// backward, its dot product with dout) in a fixed order, then the block writes the mix (or adds
// each value's gradient). Values, out and dout BF16 or F32; norm_weight and query BF16 or F32;
// probs F32; each dvalue BF16 or F32. Deterministic.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void attn_res_forward(const AttnResArgs& args, cudaStream_t stream);
void attn_res_backward(const AttnResBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
