// RMSNorm forward and backward, CPU reference (contract: kernels/ops.h, RmsNormArgs).
//   y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
//   dx_k = rstd * w_k * dy_k - x_k * rstd^3 / dim * sum_j dy_j * w_j * x_j
//   dw_j = sum_rows dy_j * x_j * rstd
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void rmsnorm_forward(const RmsNormArgs& args);

// dx is overwritten, or added to with `accumulate`. dweight (when given) is always overwritten
// with this call's sum over rows.
template <typename T>
void rmsnorm_backward(const RmsNormBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
