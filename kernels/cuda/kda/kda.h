// KDA (Kimi Delta Attention, the gated delta rule: kernels/ops.h, KdaArgs) on the CUDA backend,
// chunked (64 tokens) on BF16 tensor cores with F32 state, cumulative decays and inverses.
// Forward: kda_intra.cu (chunk-local, parallel over chunks) -> kda_state.cu (the recurrence over
// the chunks of each segment, per 32 value columns). Backward: the same two recomputed (states
// kept), a reverse state sweep, then kda_backward.cu (parallel over chunks). Deterministic: no
// atomics; every gradient element is written once by one thread.
// Inputs q, k, v, dout BF16 or F32 (F32 is rounded to BF16 first, as autocast would); g, beta and
// their gradients F32; outputs in their own dtype. Head dims up to 128: the kernels take 64 or 128,
// smaller dims run zero-padded to those (through staged copies; kda_head_dims_supported).
// The optional states of KdaArgs / KdaBackwardArgs (F32) enter and leave the state sweeps, whose
// registers hold them in F32 (kda_state.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

bool kda_head_dims_supported(int64_t k_dim, int64_t v_dim);

// Scratch (BF16 copies, chunk-local intermediates, states; about 1.2 KB per token and head
// forward, 4 KB backward at head dims 128) comes from the device allocator for the call.
void kda_forward(const KdaArgs& args, cudaStream_t stream);
void kda_backward(const KdaBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
