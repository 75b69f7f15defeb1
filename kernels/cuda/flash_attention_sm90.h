// Hopper (sm_90a) flash attention: the causal segment attention of kernels/ops.h (AttentionArgs /
// AttentionBackwardArgs; the CPU reference is the spec) on wgmma + TMA with warp-specialised
// producer and consumer warpgroups (flash_attention_sm90_forward.cu, _backward.cu say how).
// attention.cu calls these when the *_supported predicates say so, after its own shape checks;
// other shapes and dtypes keep the mma.sync (attention_tensor_core.cu) and SIMT paths.
//
// The switch: MOETRAIN_ATTENTION=mma (or simt) in the environment, read on every call, makes both
// predicates false.
//
// Persistent passes: a CTA per multiprocessor takes (block, head) works one after another
// (flash_attention_sm90_common.cuh, WorkRing).
// Measured on one H200 (moetrain-bench ops, CUDA-event timing, causal, 32 heads, BF16, medians;
// tenth session, 2026-12-02, docs/PERF.md; PyTorch SDPA on torch 2.11 in the same runs):
//   T 8192, 128/128: forward 0.97-1.02 ms (SDPA 0.93-0.98), forward + backward 4.04-4.22 ms (SDPA
//     3.60-3.65; the mma.sync path 2.9 / 11.5 ms)
//   T 8192, 192/128: forward + backward 5.09-5.47 ms (1.24-1.30x the 128/128 time); 64/64: 2.52-2.71
//     ms (SDPA 2.42)
//   T 32768, 128/128: forward + backward 60.3-62.1 ms (forward 14.7-15.1 ms; SDPA 55.5-55.9)
//   8 packed documents of 1024 tokens: forward + backward 0.88-0.94 ms, 0.54-0.88x eight separate
//     calls
// The backward recomputes S and dP in its dQ pass (7 matmuls where an atomic dQ would need 5); by
// ncu (with 64-query dK/dV steps, before the 96) its dK/dV pass kept the tensor pipe 67-71% busy,
// its dQ pass 82-87%. A fused 5-matmul
// backward (dQ partials added in a fixed order through L2) ran slower in an earlier session (4.48
// against 4.14 ms forward + backward at T 8192; 4.42 with its adds left out, so not for the adds):
// the two-kernel backward stays.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// True on a compute capability 9.0 device with this build's sm_90a code, when q, k, v, out are
// BF16 with 16-byte aligned bases, (qk_dim, v_dim) is (64, 64), (128, 128) or (192, 128), the scale
// is positive, and MOETRAIN_ATTENTION is neither "mma" nor "simt".
bool flash_attention_sm90_forward_supported(const AttentionArgs& args);
// The same, with dq, dk, dv, dout BF16 and aligned too.
bool flash_attention_sm90_backward_supported(const AttentionBackwardArgs& args);

// Preconditions: the predicate is true and attention.cu's shape checks passed.
void flash_attention_sm90_forward(const AttentionArgs& args, cudaStream_t stream);
void flash_attention_sm90_backward(const AttentionBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
