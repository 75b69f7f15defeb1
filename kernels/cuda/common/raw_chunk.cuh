// Chunks of 8 consecutive BF16 or F32 elements kept in registers as the raw 16-byte vectors they
// were loaded as (one for BF16, two for F32), for the bandwidth-bound row kernels (rmsnorm,
// rope): half the registers of F32 copies for BF16, so more bytes are in flight per
// multiprocessor. The dtype is a template argument here (element_access.cuh's run-time kinds
// cost registers for both layouts). Addresses must be 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::kernels::cuda_ops {

// A chunk of 8 elements as loaded: one 16-byte vector for BF16, two for F32.
template <bool kBf16>
struct RawChunk {
  static constexpr int kVecs = kBf16 ? 1 : 2;
  uint4 v[kVecs];
};

template <bool kBf16>
__device__ __forceinline__ const uint4* chunk_address(const void* base, int64_t element) {
  if constexpr (kBf16) {
    return reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(base) + element);
  } else {
    return reinterpret_cast<const uint4*>(static_cast<const float*>(base) + element);
  }
}

// Streaming loads: no L1 allocation (each byte is used once; L1 keeps what is reused, such as a
// norm's weight or rope's tables). volatile: the kernels store over their inputs in place, so a
// load must stay where it is written (before the stores), never re-issued later.
template <bool kBf16>
__device__ __forceinline__ void load_raw(RawChunk<kBf16>& c, const void* base, int64_t element) {
  const uint4* p = chunk_address<kBf16>(base, element);
#pragma unroll
  for (int q = 0; q < RawChunk<kBf16>::kVecs; ++q)
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(c.v[q].x), "=r"(c.v[q].y), "=r"(c.v[q].z), "=r"(c.v[q].w)
        : "l"(p + q));
}

template <bool kBf16>
__device__ __forceinline__ void zero_raw(RawChunk<kBf16>& c) {
#pragma unroll
  for (int q = 0; q < RawChunk<kBf16>::kVecs; ++q) c.v[q] = make_uint4(0u, 0u, 0u, 0u);
}

template <bool kBf16>
__device__ __forceinline__ void unpack(const RawChunk<kBf16>& c, float (&f)[8]) {
  if constexpr (kBf16) {
    const uint32_t words[4] = {c.v[0].x, c.v[0].y, c.v[0].z, c.v[0].w};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      // bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
      f[2 * p] = __uint_as_float(words[p] << 16);
      f[2 * p + 1] = __uint_as_float(words[p] & 0xffff0000u);
    }
  } else {
    f[0] = __uint_as_float(c.v[0].x), f[1] = __uint_as_float(c.v[0].y);
    f[2] = __uint_as_float(c.v[0].z), f[3] = __uint_as_float(c.v[0].w);
    f[4] = __uint_as_float(c.v[1].x), f[5] = __uint_as_float(c.v[1].y);
    f[6] = __uint_as_float(c.v[1].z), f[7] = __uint_as_float(c.v[1].w);
  }
}

template <bool kBf16>
__device__ __forceinline__ void pack(RawChunk<kBf16>& c, const float (&f)[8]) {
  if constexpr (kBf16) {
    uint32_t words[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(f[2 * p], f[2 * p + 1]);
      words[p] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    c.v[0] = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
    c.v[0] = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    c.v[1] = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7]));
  }
}

// 16-byte stores the compiler cannot split (see store_chunk8_wide in element_access.cuh).
template <bool kBf16>
__device__ __forceinline__ void store_raw(void* base, int64_t element, const RawChunk<kBf16>& c) {
  uint4* p = const_cast<uint4*>(chunk_address<kBf16>(base, element));
#pragma unroll
  for (int q = 0; q < RawChunk<kBf16>::kVecs; ++q) __stwb(p + q, c.v[q]);
}

}  // namespace moetrain::kernels::cuda_ops
