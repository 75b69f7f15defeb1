// The m-grouped GEMM with an MXFP4 b (kernels/ops.h GroupedGemmArgs::b_scale; the format in
// kernels/cpu/mxfp4.h): Kimi K3's frozen routed experts, kept packed on the GPU and dequantized
// inside the GEMM's mainloop (the H200 has no FP4 tensor cores), a quarter of the bf16 weight bytes.
//
//   transpose_b (forward, x W^T):  b [G, n, k / 2] U8, b_scale [G, n, k / 32] U8
//   otherwise   (input grad, dy W): b [G, k, n / 2] U8, b_scale [G, k, n / 32] U8
//
// Two kernels (grouped_gemm_mxfp4.cu):
//   - sm_90a, on a 9.0 device with a, b and c 16-byte aligned and k, n multiples of 8: the
//     decoding mainloop of grouped_gemm_decode_sm90.cuh, whose weight is wgmma's register operand
//     (c^T = W . a^T). The consumer warpgroups decode its packed bytes from shared memory straight
//     into the A fragments while the previous K step's wgmmas run; the activations are the
//     shared-memory B operand (TMA) with N = a group's rows rounded up to 32, so a K3 expert (~146
//     rows) is one tile of N = 160. Producer warps issue the TMA copies and convert the scales to
//     BF16.
//   - a plain one-thread-per-output kernel for everything else.
// The sum is that of the dequantized weight in BF16 (exact short of overflow; scale bytes 0 and 1
// give subnormal weights, which the tensor cores may flush), F32 accumulation.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/gemm/grouped_gemm.h"

namespace moetrain::kernels::cuda_ops {

// `p` as for launch_grouped_gemm (kMGrouped, a BF16), with p.b the packed bytes; b_scale the
// E8M0 bytes, on the device.
GroupedGemmPath grouped_gemm_mxfp4_path(const GroupedGemmProblem& p, const void* b_scale);

void launch_grouped_gemm_mxfp4(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
