// KDA's gates, CPU reference (contract: kernels/ops.h, KdaGateArgs and sigmoid_forward).
// Forget gate (log decay) per token, head h and channel c, x = f + dt_bias[h, c], A = exp(a_log[h]):
//   lower_bound == 0: g = -A * softplus(x),          dg/df = -A * sigmoid(x)
//   lower_bound <  0: g = lb * sigmoid(A * x),       dg/df = lb * A * s * (1 - s), s = sigmoid(A * x)
// softplus as torch's F.softplus (the models' reference): x itself above 20, log1p(exp(x)) below,
// whose derivative is 1 above 20, sigmoid(x) below.
// Beta: y = sigmoid(x), dx = dy * y * (1 - y).
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void kda_gate_forward(const KdaGateArgs& args);

template <typename T>
void kda_gate_backward(const KdaGateBackwardArgs& args);

template <typename T>
void sigmoid_forward(const TensorView& y, const TensorView& x);

// dx may alias dy (elementwise).
template <typename T>
void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y);

}  // namespace moetrain::kernels::cpu
