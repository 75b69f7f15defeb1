// SwiGLU, CPU reference (contract: kernels/ops.h).
//   h = silu(g) * u,  silu(g) = g * sigmoid(g),  gate_up = [g | u] per row
//   dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du = dh * silu(g)
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void swiglu_forward(const TensorView& h, const TensorView& gate_up);

template <typename T>
void swiglu_backward(const SwigluBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
