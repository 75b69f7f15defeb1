// Cross-entropy over a chunk of rows on the CUDA backend: one block per row, an online
// max/sum-of-exp pass over the vocabulary in F32, then (if dlogits is given) a pass writing
// (softmax - onehot) * grad_scale. logits BF16 or F32; dlogits the same dtype as logits (it may
// alias them); loss F32. Labels < 0: loss 0, gradient 0. A label >= vocab (a bug upstream; the
// labels stay on the device) gives a NaN loss and NaN gradient row instead of a host check.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void cross_entropy(const CrossEntropyArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
