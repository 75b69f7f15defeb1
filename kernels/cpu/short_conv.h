// The causal depthwise short convolution of KDA, CPU reference (contract: kernels/ops.h,
// ShortConvArgs). Per channel c and token t of a segment starting at s:
//   z[t, c] = sum_{i < W} w[c, i] * x[t - W + 1 + i, c]   (x before s read as zero)
//   y = silu(z) (or z without `silu`)
// Backward, with dz = dy * silu'(z), silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))):
//   dx[u, c] = sum_i w[c, i] * dz[u + W - 1 - i, c]   (only outputs of u's segment)
//   dw[c, i] = sum_t dz[t, c] * x[t - W + 1 + i, c]
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void short_conv_forward(const ShortConvArgs& args);

// dx overwritten; dweight (when given) overwritten with this call's sum over tokens.
template <typename T>
void short_conv_backward(const ShortConvBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
