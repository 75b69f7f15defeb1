// The FP8 grouped GEMM (see grouped_gemm_fp8.h): the E4M3 format of the decoding mainloop
// (grouped_gemm_decode_sm90.cuh).
//
// The format's stages: the W tile of codes (8 KB: the forward's b [G, n, k] as [G * n, k] bytes,
// 128 rows x 64 bytes, 64-byte swizzle; the input gradient's b [G, k, n] as 3-D, 64 k rows x 128
// bytes, 128-byte swizzle) and one scale word: the tile's 128 W rows (n0 a multiple of 128) and
// the step's 64 k (a multiple of 64) lie in one 128 x 128 block. Converter 0 loads that F32 scale
// two K steps ahead and writes it; the other converters only arrive.
//   The consumers decode:
//     - forward: a fragment row is a W row, its k pairs two adjacent bytes of the row: per k16 and
//       row, the two 4-byte words holding them (words c / 2 and 2 + c / 2 of the k16's 16 bytes;
//       the 64-byte swizzle puts a warp's 16 distinct words in distinct banks) and a byte permute.
//     - input gradient: a fragment row is a W column. ldmatrix.x4.trans in 16-bit units (2
//       columns) gives a thread columns 2g, 2g + 1 of its warp's 16-column chunk at k rows 2c,
//       2c + 1 of each 8-row matrix: wgmma's k pairs, column 2g as fragment row g and 2g + 1 as
//       g + 8 (so fragment rows g, g + 8 are adjacent columns of c). A byte permute per register
//       pair separates the columns.
//     decode4: cvt.rn.f16x2.e4m3x2 (exact), to F32, the product with the scale rounded to odd
//     (grouped_gemm_fp8.h), then cvt.rn.bf16x2.f32.
#include "kernels/cuda/gemm/grouped_gemm_fp8.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"
#include "kernels/cuda/gemm/grouped_gemm_decode_sm90.cuh"
#include "kernels/fp8_format.h"

namespace moetrain::kernels::cuda_ops {
namespace {

namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;
namespace decode = ::moetrain::kernels::cuda_ops::decode_sm90;
using decode::byte_permute;
using decode::kWeightRows;
using decode::Params;
using decode::Tile;
using grouped::kBK;

static_assert(kFp8BlockSize % kWeightRows == 0 && kFp8BlockSize % kBK == 0,
              "a tile's W rows and a K step lie in one scale block");

// v x scale rounded toward zero with the inexact bit kept (round to odd): rounded once more, to
// BF16's 8 bits (fewer than F32's 24 - 1), it is the exact product rounded once. The remainder is
// exact (an E4M3 value has 4 significant bits, so the product has at most 28), short of underflow.
__device__ __forceinline__ float product_to_odd(float v, float scale) {
  const float p = __fmul_rz(v, scale);
  const float remainder = __fmaf_rn(v, scale, -p);
  return __uint_as_float(__float_as_uint(p) | (remainder != 0.0f ? 1u : 0u));
}

// Two E4M3 codes (the low 16 bits, the first in the low byte) x scale as a BF16 pair.
__device__ __forceinline__ uint32_t decode2(uint32_t codes, float scale) {
  const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xFFFFu), __NV_E4M3);
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&halves));
  const __nv_bfloat162 pair = __floats2bfloat162_rn(product_to_odd(v.x, scale), product_to_odd(v.y, scale));
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Four codes (bytes 0 .. 3) x scale: (v0, v1) and (v2, v3).
__device__ __forceinline__ void decode4(uint32_t codes, float scale, uint32_t& v01, uint32_t& v23) {
  v01 = decode2(codes, scale);
  v23 = decode2(codes >> 16, scale);
}

struct Fp8Scale {
  float value;
};

struct Fp8Format {
  static constexpr const char* kOp = "grouped_gemm_fp8";
  static constexpr int kCodesPerByte = 1;
  static constexpr int kWBytes = kWeightRows * kBK;
  static constexpr int kSBytes = 1024;  // one word used: the stages stay on 1024-byte boundaries
  static constexpr int raw_bytes(bool) { return 0; }

  // The scale of K step s: block (n0 / 128, s / 2) of the forward's [G, n / 128, k / 128], block
  // (s / 2, n0 / 128) of the input gradient's [G, k / 128, n / 128] (both extents rounded up).
  template <bool kInputGrad>
  __device__ __forceinline__ static Fp8Scale load_scales(const Params& p, const Tile& tile, int s, int i) {
    (void)i;  // every converter loads the one word (a broadcast), converter 0 stores it
    const int64_t n_blocks = fp8_blocks(p.n), k_blocks = fp8_blocks(p.k);
    const int64_t n_block = tile.n0 / kFp8BlockSize, k_block = s * kBK / kFp8BlockSize;
    const int64_t at = kInputGrad ? (tile.group * k_blocks + k_block) * n_blocks + n_block
                                  : (tile.group * n_blocks + n_block) * k_blocks + k_block;
    return {__ldg(static_cast<const float*>(p.scales) + at)};
  }

  template <bool kInputGrad>
  __device__ __forceinline__ static void store_scales(uint32_t* words, const Fp8Scale& in, int i) {
    if (i == 0) words[0] = __float_as_uint(in.value);
  }

  template <bool kInputGrad>
  struct Decoder {
    int row;       // forward: the thread's W row in the tile (fragment row g; g + 8 is row + 8)
    int column0;   // the column of c of fragment row g, from the tile's first
    int high;      // forward: the k pairs are in words 1 and 3 of a k16's 16 bytes, not 0 and 2
    int swizzle;   // forward: the row's 64-byte swizzle, unit u at u ^ swizzle
    uint32_t selector;
    uint32_t ldmatrix_offset;

    __device__ __forceinline__ Decoder(int warpgroup, int warp_in_group, int lane) {
      const int g = lane / 4, c = lane % 4;
      row = warpgroup * 64 + warp_in_group * 16 + g;
      const int chunk = warpgroup * 4 + warp_in_group;  // input gradient: 16 of the tile's 128 columns
      column0 = kInputGrad ? chunk * 16 + 2 * g : row;
      // Forward: k 2c, 2c + 1 are bytes 2c, 2c + 1 of the k16's 16, k 2c + 8, 2c + 9 eight further.
      high = c / 2;
      swizzle = (row / 2) % 4;  // row + 8 has the same
      selector = c % 2 ? 0x7632u : 0x5410u;
      // Input gradient: the ldmatrix row of this lane, k row 32 q + lane; 128-byte swizzle: unit u
      // of row r at u ^ (r % 8).
      ldmatrix_offset = lane * 128 + ((chunk ^ (lane % 8)) << 4);
    }

    __device__ __forceinline__ void operator()(uint32_t (&f)[16], const unsigned char* w_stage,
                                               const unsigned char* scales) const {
      const float scale = *reinterpret_cast<const float*>(scales);
      if constexpr (kInputGrad) {
        uint32_t x[2][4];
        const uint32_t w_base = sm90::smem_address(w_stage) + ldmatrix_offset;
        decode::ldmatrix_x4_trans(x[0], w_base);
        decode::ldmatrix_x4_trans(x[1], w_base + 32 * 128);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // k rows 16 kk + 2c (+ 1) and 16 kk + 8 + 2c (+ 1); per register, the bytes are (k even:
          // column 2g, 2g + 1; k odd: 2g, 2g + 1).
          const uint32_t lo = x[kk / 2][(kk % 2) * 2], hi = x[kk / 2][(kk % 2) * 2 + 1];
          decode4(byte_permute(lo, hi, 0x6420u), scale, f[4 * kk], f[4 * kk + 2]);
          decode4(byte_permute(lo, hi, 0x7531u), scale, f[4 * kk + 1], f[4 * kk + 3]);
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned char* w = w_stage + (row + 8 * h) * 64 + 4 * high;
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk) {
            const unsigned char* unit = w + ((kk ^ swizzle) << 4);
            const uint32_t codes = byte_permute(*reinterpret_cast<const uint32_t*>(unit),
                                                *reinterpret_cast<const uint32_t*>(unit + 8), selector);
            decode4(codes, scale, f[4 * kk + h], f[4 * kk + 2 + h]);
          }
        }
      }
    }
  };

  // W's tensor map: forward boxes of 128 rows x 64 bytes, input gradient 64 k rows x 128 bytes,
  // each with the swizzle of its row length (the decoder's loads are conflict-free).
  static CUtensorMap w_map(const GroupedGemmProblem& p) {
    const bool input_grad = !p.transpose_b;
    return decode::w_tensor_map(kOp, p, input_grad ? p.n : p.k, input_grad ? kWeightRows : kBK,
                                input_grad ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
  }

  static bool scale_map(const GroupedGemmProblem&, const void*, CUtensorMap*) { return false; }
};

}  // namespace

GroupedGemmPath grouped_gemm_fp8_path(const GroupedGemmProblem& p) {
  const bool shapes = p.k % 16 == 0 && p.n % 16 == 0 && p.k2 == 0;
  if (shapes && decode::decode_sm90_fits(p) &&
      grouped::have_sm90a_code<decode::grouped_gemm_sm90_decode_kernel<Fp8Format, false>>())
    return GroupedGemmPath::kSm90;
  return GroupedGemmPath::kFallback;
}

void launch_grouped_gemm_fp8(const GroupedGemmProblem& p, const float* b_scale, cudaStream_t stream) {
  if (p.groups == 0 || p.rows == 0 || p.n == 0) return;
  MOETRAIN_CHECK(grouped_gemm_fp8_path(p) == GroupedGemmPath::kSm90, ExitCode::kInternal,
                 "grouped_gemm_fp8: a problem the kernel refuses (the caller decodes to scratch for those)");
  if (p.transpose_b) {
    decode::launch_decode_sm90<Fp8Format, false>(p, b_scale, stream);
  } else {
    decode::launch_decode_sm90<Fp8Format, true>(p, b_scale, stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
