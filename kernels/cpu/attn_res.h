// Block Attention Residuals' depth mix, CPU reference (contract: kernels/ops.h, AttnResArgs).
// One row at a time: the m keys' scales and scores, their softmax, then the weighted sum; the
// backward recomputes the scales and scores from the values and the saved probabilities.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void attn_res_forward(const AttnResArgs& args);

template <typename T>
void attn_res_backward(const AttnResBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
