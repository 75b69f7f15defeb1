// Warp-level tensor-core building blocks (sm_80 and later): mma.sync m16n8k16 (BF16 in, F32
// accumulate), ldmatrix fragment loads from shared memory, and cp.async global -> shared copies,
// as thin inline-PTX wrappers. The mma.sync kernels (attention_sm80.cu, the KDA kernels, the DSA
// indexer) build on these; the Hopper kernels use them beside wgmma (primitives_sm90.cuh).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16), with g = lane / 4, c = lane % 4:
//   A (16 x 16, row-major): a0 = (g, 2c..2c+1), a1 = (g + 8, 2c..), a2 = (g, 2c + 8..),
//                           a3 = (g + 8, 2c + 8..)        (two bf16 per 32-bit register, low first)
//   B (16 x 8, k x n):      b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g)
//   C (16 x 8, F32):        c0, c1 = (g, 2c), (g, 2c + 1); c2, c3 = (g + 8, 2c), (g + 8, 2c + 1)
// A tile stored the other way round is read with ldmatrix.trans.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace moetrain::kernels::cuda_ops::sm80 {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// c (16 x 8) += a (16 x 16) . b (16 x 8).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same product as an asm statement the compiler keeps in program order with the other
// volatile asm (ldmatrix, cp.async) around it: the KDA kernels are scheduled that way.
__device__ __forceinline__ void mma_m16n8k16_bf16_ordered(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t bits) {
  __nv_bfloat162 v;
  memcpy(&v, &bits, sizeof(bits));
  return __bfloat1622float2(v);
}

// Four 8 x 8 bf16 matrices from shared memory; lanes 8i..8i+7 address the rows of matrix i
// (16 bytes each) and register i receives matrix i as lane l holds it in an mma fragment:
// (row l / 4, columns 2 (l % 4), +1). The .trans form transposes each matrix on the way.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row_address) {
  ldmatrix_x4(r, smem_u32(row_address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* row_address) {
  ldmatrix_x4_trans(r, smem_u32(row_address));
}

// How an operand tile is stored in shared memory (row stride `stride` BF16):
//   A: kMK = element (m, k) at [m * stride + k];  kKM = at [k * stride + m] (read transposed)
//   B: kNK = element (k, n) at [n * stride + k];  kKN = at [k * stride + n] (read transposed)
enum class ALayout { kMK, kKM };
enum class BLayout { kNK, kKN };

// The A fragment of the 16 x 16 block at (m0, k0).
template <ALayout kLayout>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* st, int stride, int m0, int k0, int lane) {
  if constexpr (kLayout == ALayout::kMK) {
    // Matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) = a0..a3.
    ldmatrix_x4(a, st + (m0 + (lane & 15)) * stride + k0 + (lane >> 4) * 8);
  } else {
    // The same four matrices, each stored k-major: lanes 8i..8i+7 address its eight k rows.
    ldmatrix_x4_trans(a, st + (k0 + (lane & 7) + ((lane >> 4) << 3)) * stride + m0 + ((lane >> 3) & 1) * 8);
  }
}

// B fragments of the two n-tiles [n0, n0 + 8) and [n0 + 8, n0 + 16) for k in [k0, k0 + 16):
// b[0], b[1] of the first, b[2], b[3] of the second.
//   kNK: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15);
//   kKN: by ldmatrix.trans, lanes 0-15 address rows k0 + lane at column n0, lanes 16-31 rows
//        k0 + lane - 16 at column n0 + 8.
template <BLayout kLayout>
__device__ __forceinline__ void load_b_x2(uint32_t (&b)[4], const bf16* st, int stride, int n0, int k0, int lane) {
  if constexpr (kLayout == BLayout::kNK) {
    ldmatrix_x4(b, st + (n0 + (lane & 7) + ((lane >> 4) << 3)) * stride + k0 + ((lane >> 3) & 1) * 8);
  } else {
    ldmatrix_x4_trans(b, st + (k0 + (lane & 15)) * stride + n0 + (lane >> 4) * 8);
  }
}

template <int kNTiles>
__device__ __forceinline__ void zero_tiles(float (&acc)[kNTiles][4]) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
}

// Max and sum over the 4 lanes (a quad) that hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Asynchronous copies (cp.async, 16 bytes, L2 only): issued now, landed after
// cp_async_wait<N> (at most N newer groups still in flight) and visible to the CTA after the
// __syncthreads that follows it. A source size of 0 (copy false) writes 16 zero bytes and reads
// nothing (the address must stay valid anyway).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(copy ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool copy) {
  cp_async_16(smem_u32(dst), src, copy);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kNewerGroupsInFlight>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kNewerGroupsInFlight) : "memory");
}

}  // namespace moetrain::kernels::cuda_ops::sm80
