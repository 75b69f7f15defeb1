// The attention output gate, CPU reference (contract: kernels/ops.h, AttentionGateArgs):
//   y = x * s,  s = sigmoid(gate)   per element, or per (token, head) when headwise
//   dx = dy * s,  dgate = dy * x * s * (1 - s)   (summed over the head's columns when headwise)
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void attention_gate_forward(const AttentionGateArgs& args);

// dx and dgate overwritten; dx may alias dy (each (token, head) reads dy before writing dx).
template <typename T>
void attention_gate_backward(const AttentionGateBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
