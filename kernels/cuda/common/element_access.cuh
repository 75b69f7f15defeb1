// Device-side access to the floating operands of the elementwise and row kernels, whose dtype
// (F32 or BF16, chosen per operand: see the policy at the top of kernels/ops.h) is known only at
// run time. A kernel reads and writes in "chunks" of kChunk consecutive elements:
//   kChunk == 1: plain scalar loads, any alignment, any width;
//   kChunk == 8: one 16-byte load for BF16 (two for F32); the launcher picks it only when every
//                operand's base pointer is 16-byte aligned and the chunked extent (row width or
//                element count) is a multiple of 8 (vector_ok below).
// The dtype branch is uniform across the grid, so it costs no divergence.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/base/dtype.h"
#include "core/base/error.h"

namespace moetrain::kernels::cuda_ops {

enum class ElemKind : uint8_t { kF32, kBF16 };

struct ConstOperand {
  const void* data = nullptr;
  ElemKind kind = ElemKind::kF32;
};
struct MutOperand {
  void* data = nullptr;
  ElemKind kind = ElemKind::kF32;
  __host__ __device__ operator ConstOperand() const { return {data, kind}; }  // NOLINT: reading an output is fine
};

// Host: the element kind of a floating activation operand (F32 or BF16), else an Error naming it.
inline ElemKind elem_kind(const char* op, const char* name, DType dtype) {
  if (dtype == DType::kF32) return ElemKind::kF32;
  if (dtype == DType::kBF16) return ElemKind::kBF16;
  throw Error(ExitCode::kInternal, std::string("cuda backend: ") + op + ": " + name + " is " + dtype_name(dtype) +
                                       ", expected F32 or BF16");
}

// Host: 16-byte alignment of a device pointer (for the kChunk == 8 path).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <int kChunk>
__device__ __forceinline__ void load_chunk(float (&v)[kChunk], ConstOperand src, int64_t i) {
  if constexpr (kChunk == 8) {
    if (src.kind == ElemKind::kBF16) {
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(src.data) + i);
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 f = __bfloat1622float2(pairs[p]);
        v[2 * p] = f.x;
        v[2 * p + 1] = f.y;
      }
    } else {
      const float4* base = reinterpret_cast<const float4*>(static_cast<const float*>(src.data) + i);
      const float4 lo = base[0], hi = base[1];
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
      v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      v[e] = src.kind == ElemKind::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(src.data)[i + e])
                                         : static_cast<const float*>(src.data)[i + e];
    }
  }
}

template <int kChunk>
__device__ __forceinline__ void store_chunk(MutOperand dst, int64_t i, const float (&v)[kChunk]) {
  if constexpr (kChunk == 8) {
    if (dst.kind == ElemKind::kBF16) {
      uint4 raw;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
      for (int p = 0; p < 4; ++p) pairs[p] = __floats2bfloat162_rn(v[2 * p], v[2 * p + 1]);
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(dst.data) + i) = raw;
    } else {
      float4* base = reinterpret_cast<float4*>(static_cast<float*>(dst.data) + i);
      base[0] = make_float4(v[0], v[1], v[2], v[3]);
      base[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      if (dst.kind == ElemKind::kBF16)
        static_cast<__nv_bfloat16*>(dst.data)[i + e] = __float2bfloat16_rn(v[e]);
      else
        static_cast<float*>(dst.data)[i + e] = v[e];
    }
  }
}

// Like store_chunk<8> (same values, same 16-byte alignment requirement), but always two 16-byte
// stores for F32 and one for BF16: the stores go through __stwb (write-back, the default cache
// policy), which the compiler cannot split. Plain store_chunk<8> was seen split into 4-byte stores
// where the compiler merges several store sites (rmsnorm, rope); use this in bandwidth-bound code.
__device__ __forceinline__ void store_chunk8_wide(MutOperand dst, int64_t i, const float (&v)[8]) {
  if (dst.kind == ElemKind::kBF16) {
    uint32_t words[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * p], v[2 * p + 1]);
      words[p] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    __stwb(reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(dst.data) + i),
           make_uint4(words[0], words[1], words[2], words[3]));
  } else {
    float4* base = reinterpret_cast<float4*>(static_cast<float*>(dst.data) + i);
    __stwb(base, make_float4(v[0], v[1], v[2], v[3]));
    __stwb(base + 1, make_float4(v[4], v[5], v[6], v[7]));
  }
}

__device__ __forceinline__ float load_one(ConstOperand src, int64_t i) {
  float v[1];
  load_chunk<1>(v, src, i);
  return v[0];
}

__device__ __forceinline__ void store_one(MutOperand dst, int64_t i, float value) {
  const float v[1] = {value};
  store_chunk<1>(dst, i, v);
}

// Host: blocks for a grid-stride loop over `work` items, capped so that the grid stays within
// limits (the loop covers the rest).
inline unsigned int grid_for(int64_t work, int threads, int64_t max_blocks = 65536) {
  int64_t blocks = (work + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned int>(blocks);
}

// Block-wide sum of one float per thread in a fixed tree order (deterministic). blockDim.x must be
// a multiple of 32, at most 1024. Every thread gets the total. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

}  // namespace moetrain::kernels::cuda_ops
