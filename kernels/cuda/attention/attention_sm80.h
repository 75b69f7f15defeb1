// BF16 tensor-core (mma.sync m16n8k16) path of the causal segment attention in attention.cu:
// same contract (AttentionArgs / AttentionBackwardArgs in kernels/ops.h, the CPU reference is the
// spec), used by attention.cu's launchers when the *_supported predicates say so, after they have
// checked shapes, devices and dtypes.
//
// The switch: MOETRAIN_ATTENTION=simt in the environment (read on every call) makes both
// predicates false, so the SIMT kernels run instead. (MOETRAIN_ATTENTION=mma keeps this path for
// the shapes that the Hopper flash attention, flash_attention_sm90.h, would otherwise take.)
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// True when every operand is BF16 with a 16-byte-aligned base, qk_dim and v_dim are multiples of
// 16 in [16, 256], and MOETRAIN_ATTENTION is not "simt".
bool attention_forward_sm80_supported(const AttentionArgs& args);
// The same for dq, dk, dv, dout too, with qk_dim <= 192 and v_dim <= 128 (the dk/dv register
// budget; a 256/256 backward stays on SIMT).
bool attention_backward_sm80_supported(const AttentionBackwardArgs& args);

// Preconditions: the predicate above is true and attention.cu's shape checks passed.
void attention_forward_sm80(const AttentionArgs& args, cudaStream_t stream);
// delta [tokens, heads] F32 = sum over v_dim of dout * out, already computed on `stream`.
void attention_backward_sm80(const AttentionBackwardArgs& args, const float* delta, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
