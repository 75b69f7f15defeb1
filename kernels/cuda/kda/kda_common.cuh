// Shared pieces of the chunked KDA kernels (kda_intra.cu, kda_state.cu, kda_backward.cu, kda.cu):
// the parameter block, the chunk table lookup, and the warp-level tensor-core products.
//
// Chunks: every segment of cu_seqlens is cut into chunks of kChunk tokens from its start (the last
// one may be shorter; a chunk never spans two segments). Chunks are numbered globally, segment by
// segment: chunk_offsets[s] (an exclusive prefix sum written by kda.cu's table kernel) is the
// number of the first chunk of segment s, chunk_offsets[segments] the total. Per-chunk buffers
// (decay of the whole chunk, states) are indexed by that number; per-token buffers by the token.
// Bounds from cu_seqlens are clamped (segment_span), so malformed offsets give wrong numbers,
// never an out-of-bounds access.
//
// Tensor cores: mma.sync.m16n8k16 BF16 -> F32. Fragment layouts (PTX ISA), g = lane / 4, c = lane % 4:
//   A (16 x 16): a0 = (g, 2c..2c+1), a1 = (g + 8, 2c..), a2 = (g, 2c + 8..), a3 = (g + 8, 2c + 8..)
//   B (16 x 8, k x n): b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g)
//   C (16 x 8): c0, c1 = (g, 2c), (g, 2c + 1); c2, c3 = (g + 8, 2c), (g + 8, 2c + 1)
// Operands come from shared tiles by ldmatrix; a tile stored the other way round is read with
// ldmatrix.trans. Shared rows are padded by 8 BF16 (16 bytes) so that the eight rows of an
// ldmatrix phase fall in distinct banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/common/warp_mma_sm80.cuh"

namespace moetrain::kernels::cuda_ops::kda {

using bf16 = __nv_bfloat16;
using namespace sm80;

constexpr int kChunk = 64;      // tokens per chunk (fla's and the CPU reference's chunk size)
constexpr int kSub = 16;        // sub-chunk: one mma row block; pairs inside one are computed exactly
constexpr int kSubs = kChunk / kSub;
constexpr int kPad = 8;         // BF16 per padded shared row
constexpr int kPadF = 4;        // F32 per padded shared row
constexpr float kLog2e = 1.4426950408889634f;

// Everything the KDA kernels read and write (each kernel uses a subset; kda.cu fills it).
// Per-token buffers are [tokens, heads, dim] like the inputs; per-chunk ones [chunks, heads, ...].
struct KdaParams {
  int tokens = 0;
  int heads = 0;
  int segments = 0;
  int capacity = 0;  // chunks the per-chunk buffers hold: ceil(tokens / 64) + segments
  float scale = 1.0f;

  const int32_t* cu_seqlens = nullptr;
  const int32_t* chunk_offsets = nullptr;  // [segments + 1]

  // Inputs (BF16 copies when the caller's are F32).
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  const bf16* dout = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;

  // Chunk-local forward quantities (kda_intra.cu), per token unless said otherwise:
  bf16* w = nullptr;     // [T, H, Dk]  (I + A)^-1 diag(beta) (k exp(G))
  bf16* u = nullptr;     // [T, H, Dv]  (I + A)^-1 diag(beta) v
  bf16* qg = nullptr;    // [T, H, Dk]  scale q exp(G)
  bf16* kt = nullptr;    // [T, H, Dk]  k exp(G_last - G)
  bf16* aqk = nullptr;   // [T, H, 64]  scale sum_d q_i k_j exp(G_i - G_j), j <= i (chunk-relative j)
  float* decay = nullptr;  // [chunks, H, Dk]  exp(G_last)
  // ... and for the backward:
  float* pkk = nullptr;  // [T, H, 64]  sum_d k_i k_j exp(G_i - G_j), j < i (A without beta)
  bf16* minv = nullptr;  // [T, H, 64]  (I + A)^-1
  bf16* kg = nullptr;    // [T, H, Dk]  k exp(G)

  // State sweeps (kda_state.cu).
  MutOperand out;          // [T, H, Dv]
  bf16* state = nullptr;   // [chunks, H, Dk, Dv]  the state entering each chunk
  bf16* vnew = nullptr;    // [T, H, Dv]  u - w S (the delta-rule corrections)
  bf16* dstate = nullptr;  // [chunks, H, Dk, Dv]  gradient of the state leaving each chunk
  bf16* dvnew = nullptr;   // [T, H, Dv]
  // The caller's optional states (KdaArgs), F32 [H, state_dk, state_dv] at the unpadded head
  // dims: the first segment starts from initial_state, the last one's final state (forward) or
  // its gradient (backward) goes to / comes from the others.
  int state_dk = 0;
  int state_dv = 0;
  const float* initial_state = nullptr;
  float* final_state = nullptr;
  const float* dfinal_state = nullptr;
  float* dinitial_state = nullptr;

  // Backward outputs and the intermediates between its chunk-parallel kernels (kda_backward.cu).
  MutOperand dq, dk, dv;
  float* dg = nullptr;
  float* dbeta = nullptr;
  float* dpkk = nullptr;  // [T, H, 64]  d(loss)/d pkk, strictly lower
  float* dkg = nullptr;   // [T, H, Dk]  d(loss)/d(k exp(G)) through w
};

// ---------------------------------------------------------------------------------------------
// Segments and chunks

struct Span {
  int begin;
  int end;
};

// Segment s as [begin, end) within [0, tokens], begin clamped first so that end >= begin.
__device__ __forceinline__ Span segment_span(const int32_t* cu_seqlens, int s, int tokens) {
  const int begin = min(max(cu_seqlens[s], 0), tokens);
  const int end = min(max(cu_seqlens[s + 1], begin), tokens);
  return {begin, end};
}

// The tokens [begin, begin + len) of global chunk `chunk`; false past the last chunk.
struct ChunkSpan {
  int begin;
  int len;
};
__device__ __forceinline__ bool find_chunk(const KdaParams& p, int chunk, ChunkSpan& span) {
  if (chunk >= p.chunk_offsets[p.segments]) return false;
  // The last segment whose first chunk is <= chunk (empty segments share their successor's offset).
  int lo = 0, hi = p.segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.chunk_offsets[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const Span seg = segment_span(p.cu_seqlens, lo, p.tokens);
  span.begin = seg.begin + (chunk - p.chunk_offsets[lo]) * kChunk;
  span.len = min(kChunk, seg.end - span.begin);
  return span.len > 0;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products (one warp; the primitives are warp_mma_sm80.cuh's)

// acc[16 x 8 kNTiles] (+)= A[m0 .. m0 + 16, k0 .. k0 + 16 kKSteps] . B[k0 .., n0 .. n0 + 8 kNTiles];
// `negate` flips the sign of A (exactly: the BF16 sign bits).
template <ALayout kA, BLayout kB, int kKSteps, int kNTiles>
__device__ __forceinline__ void warp_mma(float (&acc)[kNTiles][4], const bf16* a_st, int a_stride, int m0, int a_k0,
                                         const bf16* b_st, int b_stride, int n0, int b_k0, int lane,
                                         bool negate = false) {
  static_assert(kNTiles % 2 == 0, "B fragments are read two n-tiles at a time");
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t a[4];
    load_a<kA>(a, a_st, a_stride, m0, a_k0 + 16 * kk, lane);
    if (negate) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] ^= 0x80008000u;
    }
#pragma unroll
    for (int j = 0; j < kNTiles / 2; ++j) {
      uint32_t b[4];
      load_b_x2<kB>(b, b_st, b_stride, n0 + 16 * j, b_k0 + 16 * kk, lane);
      mma_m16n8k16_bf16_ordered(acc[2 * j], a, b[0], b[1]);
      mma_m16n8k16_bf16_ordered(acc[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Global -> shared (cp.async, 16 bytes, L2 only); visible after cp_async_wait and a barrier.

// Issues the copy of rows [0, 64) of a tile: row r comes from src + r * src_row_stride (elements
// of T), kCols elements wide (16-byte aligned), into dst + r * dst_stride; rows >= valid_rows are
// zero-filled. Every thread of the block calls it (blockDim.x threads share the work).
template <typename T, int kCols>
__device__ __forceinline__ void load_tile_async(T* dst, int dst_stride, const T* src, int64_t src_row_stride,
                                                int valid_rows, int rows = kChunk) {
  constexpr int kPerCopy = 16 / static_cast<int>(sizeof(T));
  static_assert(kCols % kPerCopy == 0, "whole 16-byte copies per row");
  constexpr int kCopies = kCols / kPerCopy;
  for (int i = threadIdx.x; i < rows * kCopies; i += blockDim.x) {
    const int r = i / kCopies, piece = i - r * kCopies;
    const bool copy = r < valid_rows;
    const T* from = copy ? src + r * src_row_stride + piece * kPerCopy : src;
    cp_async_16(dst + r * dst_stride + piece * kPerCopy, from, copy);
  }
}

// ---------------------------------------------------------------------------------------------
// Stores

__device__ __forceinline__ void store_bf16x2(bf16* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = pack_bf16x2(lo, hi);
}

// A pair of consecutive elements of a caller's output (F32 or BF16, any alignment).
__device__ __forceinline__ void store_pair(MutOperand dst, int64_t i, float lo, float hi) {
  if (dst.kind == ElemKind::kBF16) {
    bf16* p = static_cast<bf16*>(dst.data) + i;
    p[0] = __float2bfloat16_rn(lo);
    p[1] = __float2bfloat16_rn(hi);
  } else {
    float* p = static_cast<float*>(dst.data) + i;
    p[0] = lo;
    p[1] = hi;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: the kernels' launchers (kda.cu runs them in order) and the head-dim dispatch.

// Calls body(std::integral_constant<int, Dk>, std::integral_constant<int, Dv>) for Dk, Dv in {64, 128}
// (the callers check the dims first).
template <typename Body>
void dispatch_head_dims(int dk, int dv, Body&& body) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dk == 64) {
    if (dv == 64) body(D64{}, D64{});
    else body(D64{}, D128{});
  } else {
    if (dv == 64) body(D128{}, D64{});
    else body(D128{}, D128{});
  }
}

// The shared memory one CTA may opt into on sm_90 (227 KiB); every KDA kernel's layout fits.
constexpr size_t kMaxSmemBytes = 227 * 1024;

// Raises `kernel`'s dynamic shared memory limit to what it needs, then launches it (nothing to do
// on an empty grid).
template <typename Kernel>
void launch_kda_kernel(Kernel kernel, dim3 grid, int threads, size_t smem_bytes, cudaStream_t stream,
                       const KdaParams& p) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem_bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  }
  kernel<<<grid, threads, smem_bytes, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

// kda_intra.cu: w, u, qg, kt, aqk, decay (and pkk, minv, kg when `for_backward`), one CTA per (chunk, head).
void launch_kda_intra(const KdaParams& p, int dk, int dv, bool for_backward, cudaStream_t stream);
// kda_state.cu: the sequential sweeps, one CTA per (segment, head, 32 value columns).
// Forward: out (or, `save`, state and vnew); backward: dstate and dvnew.
void launch_kda_state_forward(const KdaParams& p, int dk, int dv, bool save, cudaStream_t stream);
void launch_kda_state_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream);
// kda_backward.cu: dv, dbeta, dpkk, dkg (one CTA per (chunk, head)), then dq, dk, dg (one CTA
// per (chunk, head, half of the key dims)).
void launch_kda_wy_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream);
void launch_kda_intra_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops::kda
