// MoE token dispatch on CUDA (see MoePermutationArgs, MoeCombineArgs and the moe_* methods of
// Backend in kernels/ops.h; kernels/cpu/moe.* is the spec): the stable sort of (token, slot)
// pairs by expert, gathering token rows into expert order and its backward, and the weighted
// combine of expert outputs and its backward. Every sum runs in slot order 0, 1, ... of a token,
// in F32: results are deterministic and nothing uses float atomics.
//
// Operands: row tensors (x, out, rows, drows, dx, dout) BF16 or F32 each; weight, dweight F32;
// indices int32. A row is everything after the first dimension. Index contents are not
// validated on the device (that would need a sync): an out-of-range expert is left out of the
// sort (its pair_row entry becomes -1) and an out-of-range row index is skipped (moe_permute
// writes a zero row for it), never read or written through.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void moe_permutation(const MoePermutationArgs& args, cudaStream_t stream);
// out[p, :] = x[sorted_pair[p] / top_k, :]
void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k,
                 cudaStream_t stream);
// dx[t, :] (+)= sum_j drows[pair_row[t * top_k + j], :]
void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                       bool accumulate, cudaStream_t stream);
void moe_combine(const MoeCombineArgs& args, cudaStream_t stream);
void moe_combine_backward(const MoeCombineBackwardArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
