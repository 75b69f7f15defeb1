// Causal softmax attention within cu_seqlens segments, forward and backward (see AttentionArgs
// in kernels/ops.h). The CPU reference: one query row at a time, never a [T, T] matrix.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// out and lse are overwritten. lse[t, h] = log sum_s exp(scale * q[t, h] . k[s, h]) over the
// keys t attends to (natural log, the scale included), in T (the accumulation dtype on the CPU).
template <typename T>
void attention_forward(const AttentionArgs& args);

// dq, dk, dv are overwritten. P is recomputed from q, k and the saved lse;
// D[t] = dout[t] . out[t], dS = P * (dP - D), dq = scale * dS . k, dk = scale * dS^T . q, dv = P^T . dout.
template <typename T>
void attention_backward(const AttentionBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
