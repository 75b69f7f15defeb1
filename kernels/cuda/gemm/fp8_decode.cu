// FP8 block-scaled weights to BF16 (see fp8_decode.h). Memory-bound: each thread decodes 8
// consecutive codes of a row (one 8-byte load) when cols is a multiple of 8, else one code.
#include "kernels/cuda/gemm/fp8_decode.h"

#include <cuda_bf16.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/fp8_format.h"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

// The code's value times its block's scale, exact in double, rounded once to BF16.
__device__ __forceinline__ __nv_bfloat16 decode(uint8_t code, float scale) {
  return __double2bfloat16(static_cast<double>(fp8_e4m3_value(code)) * static_cast<double>(scale));
}

// Elements [e, e + kChunk) of the flattened weight, all in one row (cols % kChunk == 0).
template <int kChunk>
__global__ void sm80_fp8_decode_bf16_kernel(__nv_bfloat16* __restrict__ out, const uint8_t* __restrict__ codes,
                                            const float* __restrict__ scales, int64_t rows, int64_t cols,
                                            int64_t chunks) {
  const int64_t block_cols = fp8_blocks(cols);
  const int64_t scales_per_matrix = fp8_blocks(rows) * block_cols;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = c * kChunk;
    const int64_t matrix = e / (rows * cols), within = e % (rows * cols);
    const int64_t row = within / cols, col = within % cols;
    const float* scale_row = scales + matrix * scales_per_matrix + (row / kFp8BlockSize) * block_cols;
    uint8_t code[kChunk];
    if constexpr (kChunk == 8) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(codes + e);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        code[i] = static_cast<uint8_t>(bytes.x >> (8 * i));
        code[4 + i] = static_cast<uint8_t>(bytes.y >> (8 * i));
      }
    } else {
      code[0] = codes[e];
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[e + i] = decode(code[i], scale_row[(col + i) / kFp8BlockSize]);
  }
}

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

}  // namespace

void launch_fp8_decode_bf16(void* out, const void* codes, const float* scales, int64_t matrices, int64_t rows,
                            int64_t cols, cudaStream_t stream) {
  const int64_t n = matrices * rows * cols;
  if (n == 0) return;
  auto* dst = static_cast<__nv_bfloat16*>(out);
  const auto* src = static_cast<const uint8_t*>(codes);
  // 8 codes a row never straddle a 128-column block, nor a row, when cols % 8 == 0.
  if (cols % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % 8 == 0) {
    sm80_fp8_decode_bf16_kernel<8><<<grid_for(n / 8), kThreads, 0, stream>>>(dst, src, scales, rows, cols, n / 8);
  } else {
    sm80_fp8_decode_bf16_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(dst, src, scales, rows, cols, n);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
