// The m-grouped GEMM with an FP8 b (ops.h GroupedGemmArgs with an F32 b_scale, GemmFp8Args; the
// format in kernels/fp8_format.h): frozen DeepSeek-V3 / Kimi K2 weights as shipped, E4M3 codes
// with one F32 scale per 128 x 128 block, decoded to BF16 inside the GEMM's mainloop, half the
// BF16 weight bytes and no BF16 copy of the weight.
//
//   transpose_b (forward, x W^T):  b [G, n, k] U8, b_scale [G, ceil(n / 128), ceil(k / 128)] F32
//   otherwise   (input grad, dy W): b [G, k, n] U8, b_scale [G, ceil(k / 128), ceil(n / 128)] F32
//
// The kernel (grouped_gemm_fp8.cu) is the decoding mainloop of grouped_gemm_decode_sm90.cuh: on a
// 9.0 device, a, b and c 16-byte aligned and k, n multiples of 16 (TMA's 16-byte rows of codes).
// A tile's 128 W rows and a K step's 64 lie in one scale block, so a stage carries one scale. Each
// weight value is the exact product code x scale rounded once to BF16, as fp8_decode.h's (the
// product is rounded toward zero in F32 with the inexact bit kept, round to odd, then to nearest
// BF16: the same as one rounding; short of products below 2^-126, F32's subnormals); the sum is
// F32. A dense GEMM is one group of all rows, with no offsets. Shapes the kernel refuses take the
// decode into BF16 scratch and the BF16 GEMM (kernels/cuda/gemm/gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/gemm/grouped_gemm.h"

namespace moetrain::kernels::cuda_ops {

// `p` as for launch_grouped_gemm (kMGrouped, a BF16, no a2), with p.b the E4M3 codes; p.group_offsets
// null for one group of all p.rows rows (p.groups 1). kSm90 when the kernel takes the problem;
// kFallback when the caller decodes to scratch instead.
GroupedGemmPath grouped_gemm_fp8_path(const GroupedGemmProblem& p);

// Runs the kernel (grouped_gemm_fp8_path(p) must be kSm90); b_scale the F32 block scales, on the
// device.
void launch_grouped_gemm_fp8(const GroupedGemmProblem& p, const float* b_scale, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
