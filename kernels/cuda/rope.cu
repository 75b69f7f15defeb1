// Rope: each block owns `rows_per_block` whole rows. It stages their rope columns in shared
// memory (as F32), waits, then writes the rotated pairs, so the interleaved layout (whose
// outputs land on other pairs' inputs) is safe in place. Out of place, the block also copies
// the row's other columns.
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

__global__ void rope_kernel(MutOperand out, ConstOperand x, const int32_t* __restrict__ positions,
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

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void rope(const RopeArgs& args, cudaStream_t stream) {
  RopeShape s;
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
  // About 16 KiB of staging per block.
  s.rows_per_block = 4096 / s.rope_dim;
  if (s.rows_per_block < 1) s.rows_per_block = 1;
  if (s.rows_per_block > 32) s.rows_per_block = 32;
  const size_t shared_bytes = sizeof(float) * static_cast<size_t>(s.rows_per_block * s.rope_dim);
  const unsigned int blocks = static_cast<unsigned int>((s.rows + s.rows_per_block - 1) / s.rows_per_block);
  rope_kernel<<<blocks, kThreads, shared_bytes, stream>>>(
      MutOperand{args.out.data, kind_of(args.out.dtype)}, ConstOperand{args.x.data, kind_of(args.x.dtype)},
      static_cast<const int32_t*>(args.positions.data), static_cast<const float*>(args.cos.data),
      static_cast<const float*>(args.sin.data), s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
