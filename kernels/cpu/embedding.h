// Token embedding lookup and its backward, CPU reference (contract: kernels/ops.h).
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// out [tokens, dim] = table [rows, dim] at ids (int32 [tokens]). An id outside [0, rows) is bad
// training data: Error(kBadData) naming the token position and the id.
template <typename T>
void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids);

// dtable[ids[t], :] += dout[t, :] in token order: it accumulates (several tokens share a row).
template <typename T>
void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids);

}  // namespace moetrain::kernels::cpu
