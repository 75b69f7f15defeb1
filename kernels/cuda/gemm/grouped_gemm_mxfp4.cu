// The MXFP4 grouped GEMM (see grouped_gemm_mxfp4.h): the Hopper kernel's MXFP4 format for the
// decoding mainloop of grouped_gemm_decode_sm90.cuh, and a plain fallback.
//
// The format's stages: the packed W tile (4 KB: the forward's b [G, n, k / 2] as [G * n, k / 2]
// bytes, 128 rows x 32 bytes, unswizzled; the input gradient's b [G, k, n / 2] as 3-D, 64 k rows x
// 64 bytes, 64-byte swizzle) and 256 scale words (BF16). Input gradient with n % 512 == 0: also
// the stage's scale bytes by TMA, 64 k rows x 16 groups.
//   The converters turn the stage's E8M0 scales (from that TMA box, else byte loads from global
//   memory) into BF16 in the order the consumers read them.
//   The consumers decode:
//     - forward: a fragment row is a W row; its k pairs are byte c of each 4-byte word of the
//       row's 32 bytes: two 16-byte loads per row, a byte permute per k16.
//     - input gradient: a fragment row is a W column, whose codes are nibbles of bytes along n.
//       ldmatrix.x4.trans in 16-bit units (4 columns) gives a thread columns 4g .. 4g + 3 of a
//       32-column chunk at k rows 2c, 2c + 1 of each 8-row matrix: wgmma's k pairs. The chunk's
//       two warps each take two of the four (warp parity e: columns 4g + 2e, 4g + 2e + 1 are
//       fragment rows g, g + 8), a byte permute and decode4's strided pairs give each column's
//       k pairs.
//       The scales differ along K, so each register has its own pair.
//     decode4: E2M1 magnitudes by byte permutes from 8-entry tables, the sign by a permute's
//     sign-replicate mode, then a bf16x2 multiply by the power-of-two scale (exact).
#include "kernels/cuda/gemm/grouped_gemm_mxfp4.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"
#include "kernels/cuda/gemm/grouped_gemm_decode_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;
namespace decode = ::moetrain::kernels::cuda_ops::decode_sm90;
using decode::byte_permute;
using decode::kWeightRows;
using decode::Params;
using decode::Tile;
using grouped::kBK;

constexpr const char* kMxfp4Op = "grouped_gemm_mxfp4";  // names this file's errors

// Input gradient with TMA scales: a stage's E8M0 bytes as copied, 64 k rows x 16 groups.
constexpr int kRawGroups = 16;
constexpr int kRawBytes = kBK * kRawGroups;
// Input gradient: a stage's scale words per c (4 chunks x 8 k pairs), + 4 so the four c's of a
// warp's 16-byte loads fall in different banks.
constexpr int kScaleStride = 36;

// BF16 bit patterns of the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0000 3F00 3F80 3FC0 4000
// 4040 4080 40C0), split into their high and low bytes, 8 bytes each across two words.
constexpr uint32_t kHighBytes0 = 0x3F3F3F00u, kHighBytes1 = 0x40404040u;
constexpr uint32_t kLowBytes0 = 0xC0800000u, kLowBytes1 = 0xC0804000u;

// The E8M0 scale 2^(s - 127) as BF16 bits (s = 0: the subnormal 2^-127; 255: NaN).
__device__ __forceinline__ uint32_t scale_bits(uint32_t s) { return s == 0 ? 0x0040u : s == 255 ? 0x7FC0u : s << 7; }

// 4 codes (the low 16 bits of `codes`: nibble i is value i) to BF16 pairs times `scale` (a pair
// of powers of two): (v0, v1) and (v2, v3), or with kStrided (v0, v2) and (v1, v3). The sign: a
// selector nibble with bit 3 set replicates the chosen byte's top bit (0x80: 0xFF), otherwise
// copies it (0x80); shifted left, bit 7 tells.
template <bool kStrided>
__device__ __forceinline__ void decode4(uint32_t codes, uint32_t scale, uint32_t& v01, uint32_t& v23) {
  const uint32_t magnitudes = codes & 0x7777u;
  const uint32_t high = byte_permute(kHighBytes0, kHighBytes1, magnitudes) |
                        ((byte_permute(0x80808080u, 0x80808080u, codes) << 1) & 0x80808080u);
  const uint32_t low = byte_permute(kLowBytes0, kLowBytes1, magnitudes);
  // Value i is byte i of `low` (selector nibble i) and of `high` (4 + i).
  uint32_t pair[2] = {byte_permute(low, high, kStrided ? 0x6240u : 0x5140u),
                      byte_permute(low, high, kStrided ? 0x7351u : 0x7362u)};
  const __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&scale);
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[0]), s);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[1]), s);
  v01 = *reinterpret_cast<const uint32_t*>(&a);
  v23 = *reinterpret_cast<const uint32_t*>(&b);
}

// Converter i's share of one K step's scales: four E8M0 bytes, written as BF16 into the stage's
// words (store_scales) in the order the consumers read them. They come from global memory
// (load_scales, issued two K steps ahead), or for the input gradient when n % 512 == 0 from the
// stage's raw bytes (raw_scales): thread 0 copies the step's 64 k rows x 16 groups (the tile's 4
// and their neighbours: TMA boxes are whole 16-byte pieces) by TMA with the stage's other loads,
// so their latency hides behind the whole ring instead of two K steps (each k row is a new L2
// line: the input gradient's scales are L1 misses, the forward's L1 hits).
//   Forward: W rows 2i, 2i + 1 of the tile, groups 2s, 2s + 1: word 2 row + group holds the
//     scale twice (both halves of a fragment register share it).
//   Input gradient: k rows 2 pr, 2 pr + 1 (pr = i / 2) of the step, chunks 2 (i % 2) and + 1:
//     word c * kScaleStride + chunk * 8 + j (c = pr % 4, j = pr / 4) holds (scale of k row 2 pr,
//     of 2 pr + 1), the pair a fragment register of consumer lane c, k16 j / 2, half j % 2 needs.
// Missing scales (rows past n or k, groups past the row) read as 1: their codes are zeros or
// their products are never stored.
struct ScaleBytes {
  uint32_t b[2][2];
};

struct Mxfp4Format {
  static constexpr const char* kOp = kMxfp4Op;
  static constexpr int kCodesPerByte = 2;
  static constexpr int kWBytes = kWeightRows * kBK / 2;
  static constexpr int kSBytes = 1024;  // a stage's scales as BF16: 256 words
  static constexpr int raw_bytes(bool input_grad) { return input_grad ? kRawBytes : 0; }
  static_assert(4 * kScaleStride * 4 <= kSBytes && 2 * kWeightRows * 4 <= kSBytes, "a stage's scale words");

  template <bool kInputGrad>
  __device__ __forceinline__ static ScaleBytes load_scales(const Params& p, const Tile& tile, int s, int i) {
    const uint8_t* scales = static_cast<const uint8_t*>(p.scales);
    const int group_words = (kInputGrad ? p.n : p.k) / 32;
    ScaleBytes out;
#pragma unroll
    for (int d = 0; d < 2; ++d) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // Input gradient: d the k row, e the chunk. Forward: d the W row, e the group.
        const int outer = kInputGrad ? s * kBK + 2 * (i / 2) + d : tile.n0 + 2 * i + d;
        const int group = kInputGrad ? tile.n0 / 32 + (i % 2) * 2 + e : 2 * s + e;
        const bool valid = outer < (kInputGrad ? p.k : p.n) && group < group_words;
        const int64_t at =
            (static_cast<int64_t>(tile.group) * (kInputGrad ? p.k : p.n) + outer) * group_words + group;
        out.b[d][e] = valid ? __ldg(scales + at) : 127u;
      }
    }
    return out;
  }

  // Thread 0: the raw scale bytes of K step s, 64 k rows x the 16 groups holding the tile's.
  __device__ __forceinline__ static void load_raw_scales(unsigned char* dst, const CUtensorMap* map, uint64_t* bar,
                                                         const Tile& tile, int s) {
    sm90::tma_load_3d(dst, map, bar, tile.n0 / 32 / kRawGroups * kRawGroups, s * kBK, tile.group);
  }

  // Input gradient, TMA scales: the bytes load_scales<true> reads, from the stage's raw box (row
  // r, group column x at r * kRawGroups + x; k rows past k arrive as zeros, read as scale
  // 2^-127: their codes are zeros too). The tile's 4 groups start at column (n0 / 32) % 16, a
  // multiple of 4: each k row's two chunk bytes are one aligned 16-bit load.
  __device__ __forceinline__ static ScaleBytes raw_scales(const unsigned char* raw, const Tile& tile, int i) {
    const unsigned char* at = raw + 2 * (i / 2) * kRawGroups + (tile.n0 / 32) % kRawGroups + 2 * (i % 2);
    ScaleBytes out;
#pragma unroll
    for (int d = 0; d < 2; ++d) {
      const uint32_t two = *reinterpret_cast<const uint16_t*>(at + d * kRawGroups);
      out.b[d][0] = two & 0xFFu;
      out.b[d][1] = two >> 8;
    }
    return out;
  }

  template <bool kInputGrad>
  __device__ __forceinline__ static void store_scales(uint32_t* words, const ScaleBytes& in, int i) {
    if constexpr (kInputGrad) {
      const int pr = i / 2;
      uint32_t* out = words + (pr % 4) * kScaleStride + (i % 2) * 2 * 8 + pr / 4;
      out[0] = scale_bits(in.b[0][0]) | scale_bits(in.b[1][0]) << 16;
      out[8] = scale_bits(in.b[0][1]) | scale_bits(in.b[1][1]) << 16;
    } else {
      uint32_t bits[2][2];
#pragma unroll
      for (int d = 0; d < 2; ++d) {
#pragma unroll
        for (int e = 0; e < 2; ++e) bits[d][e] = scale_bits(in.b[d][e]) * 0x10001u;
      }
      *reinterpret_cast<uint4*>(words + 4 * i) = make_uint4(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
    }
  }

  // A consumer thread's decoding of a stage into its 16 A-fragment registers.
  template <bool kInputGrad>
  struct Decoder {
    int row;      // forward: the thread's W row in the tile (fragment row g; g + 8 is row + 8)
    int chunk;    // input gradient: the 32-column chunk of the tile's 128 columns
    int c;
    int column0;  // the column of c of fragment row g, from the tile's first
    uint32_t selector;
    uint32_t ldmatrix_offset;

    __device__ __forceinline__ Decoder(int warpgroup, int warp_in_group, int lane) {
      const int g = lane / 4, half = warp_in_group % 2;
      c = lane % 4;
      row = warpgroup * 64 + warp_in_group * 16 + g;
      chunk = warpgroup * 2 + warp_in_group / 2;
      column0 = kInputGrad ? chunk * 32 + 4 * g + 2 * half : row;
      // Forward: byte c of two words. Input gradient: bytes e and 2 + e of two words (a ldmatrix
      // register holds k row 2c's bytes 2g, 2g + 1, then k row 2c + 1's), and the ldmatrix row
      // of this lane (k row 32 q + lane; 64-byte swizzle: unit u of row r at u ^ ((r / 2) % 4)).
      selector = kInputGrad ? (half ? 0x7531u : 0x6420u) : (c | (c + 4) << 4);
      ldmatrix_offset = lane * 64 + ((chunk ^ ((lane / 2) % 4)) << 4);
    }

    __device__ __forceinline__ void operator()(uint32_t (&f)[16], const unsigned char* w_stage,
                                               const unsigned char* scales) const {
      if constexpr (kInputGrad) {
        uint32_t x[2][4];
        const uint32_t w_base = sm90::smem_address(w_stage) + ldmatrix_offset;
        decode::ldmatrix_x4_trans(x[0], w_base);
        decode::ldmatrix_x4_trans(x[1], w_base + 32 * 64);
        const uint4* pairs = reinterpret_cast<const uint4*>(scales + (c * kScaleStride + chunk * 8) * 4);
        const uint4 p0 = pairs[0], p1 = pairs[1];
        const uint32_t scale[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // Registers 2 kk and 2 kk + 1: k rows 16 kk + 2c (+ 1) and 16 kk + 8 + 2c (+ 1). Per 16
          // bits, the nibbles are (k even: column lo, hi; k odd: lo, hi): decode4's strided pairs
          // are each column's (k even, k odd).
          const uint32_t codes = byte_permute(x[kk / 2][(kk % 2) * 2], x[kk / 2][(kk % 2) * 2 + 1], selector);
          decode4<true>(codes, scale[2 * kk], f[4 * kk], f[4 * kk + 1]);
          decode4<true>(codes >> 16, scale[2 * kk + 1], f[4 * kk + 2], f[4 * kk + 3]);
        }
      } else {
        const unsigned char* w = w_stage + row * 32;
        const uint4 r0 = *reinterpret_cast<const uint4*>(w);
        const uint4 r1 = *reinterpret_cast<const uint4*>(w + 16);
        const uint4 r2 = *reinterpret_cast<const uint4*>(w + 8 * 32);
        const uint4 r3 = *reinterpret_cast<const uint4*>(w + 8 * 32 + 16);
        const uint32_t words0[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
        const uint32_t words1[8] = {r2.x, r2.y, r2.z, r2.w, r3.x, r3.y, r3.z, r3.w};
        const uint2 s0 = *reinterpret_cast<const uint2*>(scales + row * 8);  // row g: groups 2s, 2s + 1
        const uint2 s1 = *reinterpret_cast<const uint2*>(scales + (row + 8) * 8);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          decode4<false>(byte_permute(words0[2 * kk], words0[2 * kk + 1], selector), kk < 2 ? s0.x : s0.y,
                         f[4 * kk], f[4 * kk + 2]);
          decode4<false>(byte_permute(words1[2 * kk], words1[2 * kk + 1], selector), kk < 2 ? s1.x : s1.y,
                         f[4 * kk + 1], f[4 * kk + 3]);
        }
      }
    }
  };

  // W's tensor map. Forward: boxes of 128 rows x 32 bytes (one K step), unswizzled: the
  // consumers' 16-byte loads meet at most 2-way bank conflicts. Input gradient: boxes of 64 k
  // rows x 64 bytes (128 columns), 64-byte swizzle for the conflict-free ldmatrix. The packed
  // dimension is whole groups of 32, so the row stride is a multiple of 16 bytes.
  static CUtensorMap w_map(const GroupedGemmProblem& p) {
    const bool input_grad = !p.transpose_b;
    return decode::w_tensor_map(kOp, p, (input_grad ? p.n : p.k) / 2, input_grad ? kWeightRows / 2 : kBK / 2,
                                input_grad ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE);
  }

  // The input gradient's scales [G, k, n / 32] bytes as 3-D (k rows past a group's arrive as
  // zeros), boxes of 64 k rows x 16 bytes, when TMA can take them: rows a multiple of 16 bytes
  // (n % 512 == 0, so a 128-column tile's 4 groups never straddle two boxes), 16-byte aligned.
  // Otherwise false and the converters load the bytes themselves.
  static bool scale_map(const GroupedGemmProblem& p, const void* b_scale, CUtensorMap* map) {
    const int64_t row_bytes = p.n / 32;
    if (p.transpose_b || row_bytes % kRawGroups != 0 || reinterpret_cast<uintptr_t>(b_scale) % 16 != 0) return false;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(p.k),
                                static_cast<cuuint64_t>(p.groups)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(row_bytes * p.k)};
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(kRawGroups), static_cast<cuuint32_t>(kBK), 1};
    *map = grouped::encode_map(kOp, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, b_scale, dims, strides, box,
                               CU_TENSOR_MAP_SWIZZLE_NONE);
    return true;
  }
};

// ---------------------------------------------------------------------------------------------
// The fallback: one thread per output element, F32 sums in order, weights decoded on the fly.

struct FallbackParams {
  void* c;
  int c_f32;
  const bf16* a;
  const uint8_t* packed;
  const uint8_t* scales;
  const int32_t* offsets;
  int64_t groups, rows, n, k;
  int transpose_b;
  float alpha, beta;
};

// Element (row, col) of b viewed as [G * outer, width], packed along width.
__device__ __forceinline__ float mxfp4_element(const uint8_t* packed, const uint8_t* scales, int64_t row, int64_t col,
                                               int64_t width) {
  const uint8_t byte = packed[row * (width / 2) + col / 2];
  const int code = col % 2 == 0 ? byte & 0xf : byte >> 4;
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float value = code & 8 ? -magnitudes[code & 7] : magnitudes[code & 7];
  const int s = scales[row * (width / 32) + col / 32];
  return s == 255 ? __int_as_float(0x7fc00000) : value * ldexpf(1.0f, s - 127);
}

__global__ void mxfp4_fallback_kernel(const FallbackParams p) {
  const int64_t total = p.rows * p.n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.n, j = i % p.n;
    if (r < p.offsets[0] || r >= p.offsets[p.groups]) continue;
    int64_t lo = 0, hi = p.groups;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.offsets[mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (!(p.offsets[lo] <= r && r < p.offsets[lo + 1])) continue;  // offsets out of order
    const bf16* a = p.a + r * p.k;
    float sum = 0.0f;
    for (int64_t q = 0; q < p.k; ++q) {
      const float w = p.transpose_b ? mxfp4_element(p.packed, p.scales, lo * p.n + j, q, p.k)
                                    : mxfp4_element(p.packed, p.scales, lo * p.k + q, j, p.n);
      sum += __bfloat162float(a[q]) * w;
    }
    grouped::store_output(p, i, sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

void launch_fallback(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  FallbackParams params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.a = static_cast<const bf16*>(p.a);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  params.offsets = p.group_offsets;
  params.groups = p.groups;
  params.rows = p.rows;
  params.n = p.n;
  params.k = p.k;
  params.transpose_b = p.transpose_b ? 1 : 0;
  params.alpha = p.alpha;
  params.beta = p.beta;
  constexpr int kFallbackThreads = 256;
  mxfp4_fallback_kernel<<<grid_for(p.rows * p.n, kFallbackThreads), kFallbackThreads, 0, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

GroupedGemmPath grouped_gemm_mxfp4_path(const GroupedGemmProblem& p, const void* b_scale) {
  (void)b_scale;  // read a byte at a time: any alignment
  const bool shapes = p.k % 8 == 0 && p.n % 8 == 0;
  if (shapes && decode::decode_sm90_fits(p) &&
      grouped::have_sm90a_code<decode::grouped_gemm_sm90_decode_kernel<Mxfp4Format, false>>())
    return GroupedGemmPath::kSm90;
  return GroupedGemmPath::kFallback;
}

void launch_grouped_gemm_mxfp4(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  if (p.groups == 0 || p.rows == 0 || p.n == 0) return;
  if (grouped_gemm_mxfp4_path(p, b_scale) == GroupedGemmPath::kFallback) {
    launch_fallback(p, b_scale, stream);  // also k == 0: c = beta * c
    return;
  }
  if (p.transpose_b) {
    decode::launch_decode_sm90<Mxfp4Format, false>(p, b_scale, stream);
  } else {
    decode::launch_decode_sm90<Mxfp4Format, true>(p, b_scale, stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
