// MoE routing on the CPU (see RouterArgs, RouterBackwardArgs and AuxLossArgs in kernels/ops.h):
// scores, group-limited top-k selection with the score-correction bias, normalised and scaled
// weights, their backward, and the auxiliary load-balancing loss.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// scores, topk_index and topk_weight are overwritten.
template <typename T>
void router_forward(const RouterArgs& args);

// dlogits is overwritten. The selection (topk_index) is a constant.
template <typename T>
void router_backward(const RouterBackwardArgs& args);

// loss [1] and dscores [tokens, experts] are overwritten.
template <typename T>
void aux_loss(const AuxLossArgs& args);

}  // namespace moetrain::kernels::cpu
