// Cross-entropy over a chunk of rows, CPU reference (contract: kernels/ops.h, CrossEntropyArgs).
//   loss[r] = lse(logits[r]) - logits[r, label],  lse computed after subtracting the row max
//   dlogits[r] = (softmax(logits[r]) - onehot(label)) * grad_scale
// Rows with label < 0: loss 0, gradient 0. dlogits may alias logits; an empty dlogits view
// (no data) computes the loss only.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void cross_entropy(const CrossEntropyArgs& args);

}  // namespace moetrain::kernels::cpu
