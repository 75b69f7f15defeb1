// Causal softmax attention within cu_seqlens segments on CUDA, forward and backward (see
// AttentionArgs / AttentionBackwardArgs in kernels/ops.h; kernels/cpu/attention.* is the spec).
//
// Operands: q, k, v, out, dout, dq, dk, dv each BF16 or F32 (independently); lse F32
// [tokens, heads]; cu_seqlens int32 [num_seqs + 1]. qk_dim and v_dim may differ (MLA: 192/128),
// each in [1, 256]. Every output is overwritten (`=`); nothing uses atomics.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void attention_forward(const AttentionArgs& args, cudaStream_t stream);
void attention_backward(const AttentionBackwardArgs& args, cudaStream_t stream);
// AttentionMergeArgs: out BF16 or F32, chunk_out either, both lse F32.
void attention_merge(const AttentionMergeArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
