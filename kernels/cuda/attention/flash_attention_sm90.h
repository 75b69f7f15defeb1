// Hopper (sm_90a) flash attention: the causal segment attention of kernels/ops.h (AttentionArgs /
// AttentionBackwardArgs; the CPU reference is the spec) on wgmma + TMA with warp-specialised
// producer and consumer warpgroups (flash_attention_forward_sm90.cu, _backward.cu say how).
// attention.cu calls these when the *_supported predicates say so, after its own shape checks;
// other shapes and dtypes keep the mma.sync (attention_sm80.cu) and SIMT paths.
//
// The switch: MOETRAIN_ATTENTION=mma (or simt) in the environment, read on every call, makes both
// predicates false.
//
// Persistent passes: a CTA per multiprocessor takes (block, head) works one after another
// (flash_attention_common_sm90.cuh, WorkRing).
// Timings against PyTorch SDPA are in docs/PERF.md (moetrain-bench ops).
// The backward recomputes S and dP in its dQ pass (7 matmuls where an atomic dQ would need 5), so
// that it stays deterministic with no atomic adds. A fused 5-matmul backward that adds dQ
// partials in a fixed order through L2 measured slower, and not because of the adds
// (docs/PERF.md): the two-kernel backward stays.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// True on a compute capability 9.0 device with this build's sm_90a code, when q, k, v, out are
// BF16 with 16-byte aligned bases, (qk_dim, v_dim) is (64, 64), (128, 128) or (192, 128), the scale
// is positive, and MOETRAIN_ATTENTION is neither "mma" nor "simt".
bool flash_attention_forward_sm90_supported(const AttentionArgs& args);
// The same, with dq, dk, dv, dout BF16 and aligned too.
bool flash_attention_backward_sm90_supported(const AttentionBackwardArgs& args);

// Preconditions: the predicate is true and attention.cu's shape checks passed.
void flash_attention_forward_sm90(const AttentionArgs& args, cudaStream_t stream);
void flash_attention_backward_sm90(const AttentionBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
