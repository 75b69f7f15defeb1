// AdamW, in place, with PyTorch's torch.optim.AdamW semantics (decoupled weight decay, bias
// correction), CPU reference (contract: kernels/ops.h, AdamWArgs). Per element:
//   param *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void adamw(const AdamWArgs& args);

}  // namespace moetrain::kernels::cpu
