// Rope has two kernels.
// The vector kernel (rope_dim a multiple of 16 up to 512, rows and columns 16-byte aligned: the
// MLA case): each thread owns 8 rotation pairs i = 8k .. 8k+7 of one row, so a row takes
// rope_dim / 16 threads of one warp. It loads its inputs (two 16-byte chunks), the 8 cos and 8
// sin values of its pairs (L1 hits for the row's other heads: adjacent rows share the token), and
// writes its outputs as two 16-byte chunks. In place with the interleaved layout, its outputs land
// on other threads' inputs of the same row: every thread loads first, __syncwarp, then stores.
// The staged kernel covers every other shape: each block owns `rows_per_block` whole rows. It
// stages their rope columns in shared memory (as F32), waits, then writes the rotated pairs, so
// the interleaved layout is safe in place. Out of place, both kernels also copy the row's other
// columns.
#include "kernels/cuda/rope.h"

#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

struct RopeShape {
  int64_t rows, width, heads, col_offset, rope_dim, max_position, rows_per_block;
  bool interleaved, inverse, in_place;
};

__global__ void rope_staged_kernel(MutOperand out, ConstOperand x, const int32_t* __restrict__ positions,
                            const float* __restrict__ cos_table, const float* __restrict__ sin_table, RopeShape s) {
  extern __shared__ float staged[];  // [rows_per_block, rope_dim]
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * s.rows_per_block;
  const int64_t rows_here = min(s.rows_per_block, s.rows - row0);
  const int64_t half = s.rope_dim / 2;

  if (!s.in_place) {
    for (int64_t e = threadIdx.x; e < rows_here * s.width; e += blockDim.x) {
      const int64_t col = e % s.width;
      if (col < s.col_offset || col >= s.col_offset + s.rope_dim) {
        const int64_t at = row0 * s.width + e;
        store_one(out, at, load_one(x, at));
      }
    }
  }
  for (int64_t e = threadIdx.x; e < rows_here * s.rope_dim; e += blockDim.x) {
    const int64_t r = e / s.rope_dim, i = e % s.rope_dim;
    staged[e] = load_one(x, (row0 + r) * s.width + s.col_offset + i);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < rows_here * half; e += blockDim.x) {
    const int64_t r = e / half, i = e % half;
    const int64_t row = row0 + r;
    const float* in = staged + r * s.rope_dim;
    const int64_t out_base = row * s.width + s.col_offset;
    const int32_t position = positions[row / s.heads];
    float first, second;  // the values for out[i] and out[i + half] (forward) or the two layout slots
    if (position < 0 || position >= s.max_position) {
      first = second = nanf("");
    } else {
      const float c = cos_table[static_cast<int64_t>(position) * half + i];
      const float sn = sin_table[static_cast<int64_t>(position) * half + i];
      if (!s.inverse) {
        const float a = s.interleaved ? in[2 * i] : in[i];
        const float b = s.interleaved ? in[2 * i + 1] : in[i + half];
        first = a * c - b * sn;
        second = b * c + a * sn;
      } else {
        const float xa = in[i], xb = in[i + half];
        first = xa * c + xb * sn;
        second = xb * c - xa * sn;
      }
    }
    if (!s.inverse || !s.interleaved) {
      store_one(out, out_base + i, first);
      store_one(out, out_base + i + half, second);
    } else {
      store_one(out, out_base + 2 * i, first);
      store_one(out, out_base + 2 * i + 1, second);
    }
  }
}

// The vector kernel; kSets = rope_dim / 16 threads per row, a power of two up to 32 (so a row
// never straddles warps).
template <int kSets>
__global__ void __launch_bounds__(kThreads)
    rope_vector_kernel(MutOperand out, ConstOperand x, const int32_t* __restrict__ positions,
                       const float* __restrict__ cos_table, const float* __restrict__ sin_table, RopeShape s) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = g / kSets;
  const int k = static_cast<int>(g % kSets);
  const bool valid = row < s.rows;
  const int64_t half = s.rope_dim / 2;
  const int64_t base = row * s.width + s.col_offset;
  const bool interleaved_in = s.interleaved && !s.inverse, interleaved_out = s.interleaved && s.inverse;
  // a[e], b[e]: the pair 8k + e (forward: (x[2i], x[2i+1]) or (x[i], x[i + half]); inverse: the
  // rotated values at i and i + half).
  float a[8], b[8], c[8], sn[8];
  bool position_ok = false;
  if (valid) {
    if (interleaved_in) {
      float lo[8], hi[8];
      load_chunk<8>(lo, x, base + 16 * k);
      load_chunk<8>(hi, x, base + 16 * k + 8);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        a[e] = lo[2 * e], b[e] = lo[2 * e + 1];
        a[4 + e] = hi[2 * e], b[4 + e] = hi[2 * e + 1];
      }
    } else {
      load_chunk<8>(a, x, base + 8 * k);
      load_chunk<8>(b, x, base + half + 8 * k);
    }
    const int64_t token = row / s.heads;
    const int32_t position = positions[token];
    position_ok = position >= 0 && position < s.max_position;
    if (position_ok) {
      const int64_t at = static_cast<int64_t>(position) * half + 8 * k;
      const float4* cos4 = reinterpret_cast<const float4*>(cos_table + at);
      const float4* sin4 = reinterpret_cast<const float4*>(sin_table + at);
      const float4 c0 = __ldg(cos4), c1 = __ldg(cos4 + 1), s0 = __ldg(sin4), s1 = __ldg(sin4 + 1);
      c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w;
      c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
      sn[0] = s0.x, sn[1] = s0.y, sn[2] = s0.z, sn[3] = s0.w;
      sn[4] = s1.x, sn[5] = s1.y, sn[6] = s1.z, sn[7] = s1.w;
    }
  }
  // Every lane of the warp gets here (no early return above): the row's loads are done before
  // any of its stores, which in place may overwrite another thread's inputs.
  __syncwarp();
  if (!valid) return;
  float first[8], second[8];  // the values for pair slot i and i + half (or 2i and 2i + 1)
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (!position_ok) {
      first[e] = second[e] = nanf("");
    } else if (!s.inverse) {
      first[e] = a[e] * c[e] - b[e] * sn[e];
      second[e] = b[e] * c[e] + a[e] * sn[e];
    } else {
      first[e] = a[e] * c[e] + b[e] * sn[e];
      second[e] = b[e] * c[e] - a[e] * sn[e];
    }
  }
  // Both output layouts share one pair of 16-byte store sites.
  float lo[8], hi[8];
  int64_t lo_at, hi_at;
  if (interleaved_out) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo[2 * e] = first[e], lo[2 * e + 1] = second[e];
      hi[2 * e] = first[4 + e], hi[2 * e + 1] = second[4 + e];
    }
    lo_at = base + 16 * k;
    hi_at = lo_at + 8;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) lo[e] = first[e], hi[e] = second[e];
    lo_at = base + 8 * k;
    hi_at = base + half + 8 * k;
  }
  store_chunk8_wide(out, lo_at, lo);
  store_chunk8_wide(out, hi_at, hi);
  if (!s.in_place) {  // the columns rope leaves alone, 8 at a time (the rope columns are whole chunks)
    const int64_t row_base = row * s.width;
    for (int64_t col = 8 * static_cast<int64_t>(k); col < s.width; col += 8 * kSets) {
      if (col >= s.col_offset && col < s.col_offset + s.rope_dim) continue;
      float v[8];
      load_chunk<8>(v, x, row_base + col);
      store_chunk8_wide(out, row_base + col, v);
    }
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void rope(const RopeArgs& args, cudaStream_t stream) {
  RopeShape s{};
  s.width = args.x.size(-1);
  s.rows = s.width == 0 ? 0 : args.x.numel() / s.width;
  if (s.rows == 0) return;
  s.heads = args.heads;
  s.col_offset = args.col_offset;
  s.rope_dim = args.rope_dim;
  s.max_position = args.cos.size(0);
  s.interleaved = args.layout == RopeLayout::kInterleaved;
  s.inverse = args.inverse;
  s.in_place = args.out.data == args.x.data;
  const MutOperand out{args.out.data, kind_of(args.out.dtype)};
  const ConstOperand x{args.x.data, kind_of(args.x.dtype)};
  const auto* positions = static_cast<const int32_t*>(args.positions.data);
  const auto* cos_table = static_cast<const float*>(args.cos.data);
  const auto* sin_table = static_cast<const float*>(args.sin.data);
  const int64_t sets = s.rope_dim % 16 == 0 ? s.rope_dim / 16 : 0;
  const bool vector = sets > 0 && sets <= 32 && (sets & (sets - 1)) == 0 && s.width % 8 == 0 &&
                      s.col_offset % 8 == 0 && aligned16(out.data) && aligned16(x.data) && aligned16(cos_table) &&
                      aligned16(sin_table);
  if (vector) {
    const unsigned int blocks = static_cast<unsigned int>((s.rows * sets + kThreads - 1) / kThreads);
    using VectorKernel = void (*)(MutOperand, ConstOperand, const int32_t*, const float*, const float*, RopeShape);
    const VectorKernel kernel = sets == 1    ? rope_vector_kernel<1>
                                : sets == 2  ? rope_vector_kernel<2>
                                : sets == 4  ? rope_vector_kernel<4>
                                : sets == 8  ? rope_vector_kernel<8>
                                : sets == 16 ? rope_vector_kernel<16>
                                             : rope_vector_kernel<32>;
    kernel<<<blocks, kThreads, 0, stream>>>(out, x, positions, cos_table, sin_table, s);
    CUDA_CHECK_LAUNCH();
    return;
  }
  // About 16 KiB of staging per block.
  s.rows_per_block = 4096 / s.rope_dim;
  if (s.rows_per_block < 1) s.rows_per_block = 1;
  if (s.rows_per_block > 32) s.rows_per_block = 32;
  const size_t shared_bytes = sizeof(float) * static_cast<size_t>(s.rows_per_block * s.rope_dim);
  const unsigned int blocks = static_cast<unsigned int>((s.rows + s.rows_per_block - 1) / s.rows_per_block);
  rope_staged_kernel<<<blocks, kThreads, shared_bytes, stream>>>(out, x, positions, cos_table, sin_table, s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
