// MoE token dispatch on the CPU (see MoePermutationArgs, MoeCombineArgs and the moe_* methods of
// Backend in kernels/ops.h): the stable sort of (token, slot) pairs by expert, gathering tokens
// into expert order and its backward, and the weighted combine of expert outputs and its backward.
// Every sum runs in a fixed order (slot 0, 1, ... of a token), so results are deterministic.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// T is unused (all operands are int32); a template only so the backend dispatches uniformly.
// An expert index outside [0, num_experts) throws Error(kInternal) naming the token and slot.
template <typename T>
void moe_permutation(const MoePermutationArgs& args);

// out[p, :] = x[sorted_pair[p] / top_k, :]
template <typename T>
void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k);

// dx[t, :] (+)= sum_j drows[pair_row[t * top_k + j], :]
template <typename T>
void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                       bool accumulate);

// out[t, :] = sum_j weight[t, j] * rows[pair_row[t * top_k + j], :]   (out overwritten)
template <typename T>
void moe_combine(const MoeCombineArgs& args);

// drows[pair_row[t * top_k + j], :] = weight[t, j] * dout[t, :];  dweight[t, j] = dout[t, :] . rows[...]
// (both overwritten; rows no pair maps to are zeroed).
template <typename T>
void moe_combine_backward(const MoeCombineBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
