// SiTU, CPU reference (contract: kernels/ops.h, SituArgs). With t = tanh(g / beta),
// s = sigmoid(g), a = beta * t * s and v = linear_beta * tanh(u / linear_beta) (or u):
//   h  = a * v
//   dg = dh * v * ((1 - t^2) * s + beta * t * s * (1 - s))
//   du = dh * a * (1 - tanh(u / linear_beta)^2)   (dh * a when linear_beta is 0)
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void situ_forward(const SituArgs& args);

template <typename T>
void situ_backward(const SituBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
