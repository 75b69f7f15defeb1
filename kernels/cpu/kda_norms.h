// The two norms of a KDA layer, CPU reference (contract: kernels/ops.h, L2NormArgs and
// GatedRmsNormArgs), per row of length dim.
// L2 norm of q and k:  y = x * r,  r = 1 / sqrt(sum(x^2) + eps)
//   dx = r * dy - r^3 * x * (x . dy)
// Gated output norm:   y = n * w * s,  n = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps),  s = sigmoid(gate)
//   dn = dy * w * s,  dx = rstd * dn - rstd^3 / dim * x * (x . dn)
//   dgate = dy * n * w * s * (1 - s),  dw = sum_rows dy * n * s
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void l2norm_forward(const L2NormArgs& args);

template <typename T>
void l2norm_backward(const L2NormBackwardArgs& args);

template <typename T>
void gated_rmsnorm_forward(const GatedRmsNormArgs& args);

// dx, dgate overwritten; dweight (when given) overwritten with this call's sum over rows.
template <typename T>
void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
