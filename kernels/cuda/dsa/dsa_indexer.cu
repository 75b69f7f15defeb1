// The lightning indexer's causal top-k (kernels/ops.h DsaIndexerArgs; kernels/cpu/dsa.cpp is the
// spec): I[t, s] = scale * sum_j w[t, j] relu(q[t, j] . k[s]) for s in [segment start(t), t] (with
// cu_seqlens_k: [key segment start, t + k_end - q_end], attention_segments.cuh visible_keys), the
// top_k largest per query, ties to the lower s, written in ascending s, -1 padded.
//
// Queries go in chunks (dsa_indexer.h); per chunk two kernels:
//   scores  F32 scores of each query's keys into scratch [chunk_rows, key_tokens] as uint32 keys whose
//           unsigned order is the scores' order (NaN ranks as -inf and -0 as +0, as the reference
//           ranks them). Only a query's own causal range is written and later read. The grid is
//           query blocks x key spans: a CTA scores its queries' keys in one span of 4096 (blockIdx.y),
//           so a chunk of few queries with long key ranges still fills the GPU.
//           BF16 q and k: tensor cores (mma.sync m16n8k16, F32 accumulators). A CTA of 4 warps holds
//           4 queries' q (heads padded to 16 and dim to 16 with zeros, zero head weights for the
//           padding) in shared memory and walks its span's 64-key tiles of k (double-buffered,
//           cp.async); warp w computes its query's [16 heads x 64 keys] logits for up to 4 head
//           blocks at once (each k fragment read from shared memory feeds all of them), applies
//           relu and the head weights in registers and sums the heads by shuffles. Other dtypes: a
//           SIMT kernel (a warp per query, a lane per key, q read through L1), the reference on the
//           GPU for F32 operands.
//   select  one CTA per query: a 4 x 8-bit radix select on the keys finds the top_k-th largest key
//           (integer histograms, so the result is exact; a warp adds each distinct digit once, as
//           the keys of one row mostly share their high digits), then one pass in key order writes
//           every key above it and the first (lowest s) keys equal to it, in ascending s, through a
//           block scan. The row sits in shared memory when it fits.
// Nothing depends on timing: histogram counts are integer sums, the scan is in index order.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/attention/attention_segments.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/warp_mma_sm80.cuh"
#include "kernels/cuda/dsa/dsa_indexer.h"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
using namespace sm80;

// Scores of one chunk in scratch: at most this many bytes unless one row alone is larger. Large
// enough that a long sequence's chunk still holds thousands of queries (2048 at 128K keys), so the
// select kernel's one CTA per query fills the GPU. The backend's scratch is grow-only and the
// DSA backward's chunk is larger in training (core/plan/memory_plan.cpp add_workspace).
constexpr int64_t kScoreBudgetBytes = int64_t{1} << 30;

// Keys per CTA of the score kernels (blockIdx.y picks the span): a chunk's few query blocks
// still fill the GPU when each query has a long key range. A multiple of both key tiles.
constexpr int kKeySpan = 4096;
constexpr int kMaxGridY = 65535;

constexpr int kMmaWarps = 4;  // queries per CTA of the tensor-core score kernel (one per warp)
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kKeyTile = 64;  // keys per step: 8 mma n-tiles
constexpr int kGroupBlocks = 4;  // 16-head blocks whose logits a warp accumulates at once (64 heads)
constexpr int kRowPad = 8;    // bf16 per shared row beyond the padded dim: 16 bytes, conflict-free ldmatrix

constexpr int kSimtWarps = 8;  // SIMT score kernel: a warp per query, a lane per key
constexpr int kSimtThreads = 32 * kSimtWarps;
constexpr int kSimtKeys = 32;

constexpr int kSelectThreads = 256;
constexpr int kSelectCacheKeys = 16384;  // a row of up to this many keys is selected from shared memory

struct ScoreParams {
  const void* q = nullptr;  // [tokens, heads, dim]
  const void* k = nullptr;  // [key_tokens, dim]
  bool q_bf16 = false, k_bf16 = false;
  const float* w = nullptr;  // [tokens, heads]
  const int32_t* cu_seqlens = nullptr;
  const int32_t* cu_seqlens_k = nullptr;  // cu_seqlens when the keys have no segments of their own
  int segments = 1;
  int tokens = 0, key_tokens = 0, heads = 0, dim = 0;
  float scale = 1.0f;
  int chunk_begin = 0, chunk_rows = 0;  // queries [chunk_begin, chunk_begin + chunk_rows)
  int key_span = kKeySpan;              // keys per score CTA (block_key_span), a multiple of kKeyTile
  uint32_t* keys = nullptr;             // [chunk_rows, key_tokens]
};

// What the reference's std::max(logit, 0.0) gives: NaN stays NaN, -0 stays -0.
__device__ __forceinline__ float relu_like_reference(float x) { return x < 0.0f ? 0.0f : x; }

// An unsigned key in the order of the score: NaN ranks as -inf, -0 as +0 (the reference compares
// doubles, where -0 == +0).
__device__ __forceinline__ uint32_t score_key(float score) {
  if (isnan(score)) score = -INFINITY;
  if (score == 0.0f) score = 0.0f;
  const uint32_t bits = __float_as_uint(score);
  return (bits & 0x80000000u) != 0u ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float load_value(const void* p, bool is_bf16, int64_t i) {
  return is_bf16 ? __bfloat162float(static_cast<const bf16*>(p)[i]) : static_cast<const float*>(p)[i];
}

// The keys CTA (blockIdx.x, blockIdx.y) scores for queries [t_first, t_last]: span blockIdx.y of
// p.key_span keys from the first query's first key rounded down to a tile. Both key bounds are
// non-decreasing in t, so the first query's start and the last query's end bound every query's
// range; each span writes its own columns of the scratch rows, so the spans need no reduction.
// Empty (first > last) past the block's last key.
struct KeySpan {
  int first;
  int last;
};
__device__ __forceinline__ KeySpan block_key_span(const ScoreParams& p, int t_first, int t_last, int tile) {
  const int64_t block_first =
      visible_keys(p.cu_seqlens, p.cu_seqlens_k, p.segments, t_first, p.key_tokens).first / tile * tile;
  const int block_last = visible_keys(p.cu_seqlens, p.cu_seqlens_k, p.segments, t_last, p.key_tokens).last;
  const int64_t first = block_first + static_cast<int64_t>(blockIdx.y) * p.key_span;
  if (first > block_last) return KeySpan{0, -1};
  const int64_t last = first + p.key_span - 1;
  return KeySpan{static_cast<int>(first), static_cast<int>(last < block_last ? last : block_last)};
}

// ---------------------------------------------------------------------------------------------
// Tensor-core scores (BF16 q and k; the fragment loads and mma are warp_mma_sm80.cuh's)

// Rows [0, rows) of a shared bf16 tile with `cols` columns (a multiple of 8) and row stride
// `stride`: row i is src_row(i)'s first `width` values then zeros, or all zeros when src_row(i)
// is null. vector: 16-byte copies (width a multiple of 8, rows 16-byte aligned).
template <typename RowSource>
__device__ __forceinline__ void load_bf16_tile(bf16* tile, int stride, int rows, int cols, int width, bool vector,
                                               RowSource src_row) {
  if (vector) {
    const int chunks = cols / 8;
    for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
      const int i = e / chunks, c = (e % chunks) * 8;
      const bf16* src = src_row(i);
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (src != nullptr && c < width) v = *reinterpret_cast<const uint4*>(src + c);
      *reinterpret_cast<uint4*>(tile + i * stride + c) = v;
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
      const int i = e / cols, c = e % cols;
      const bf16* src = src_row(i);
      tile[i * stride + c] = (src != nullptr && c < width) ? src[c] : __float2bfloat16_rn(0.0f);
    }
  }
}

// Shared memory of the tensor-core kernel: q [kMmaWarps * padded_heads][stride],
// k [2][kKeyTile][stride] (bf16, double-buffered), head weights [kMmaWarps][padded_heads] (F32).
size_t mma_scores_smem_bytes(int padded_heads, int padded_dim) {
  const size_t stride = static_cast<size_t>(padded_dim + kRowPad);
  return (static_cast<size_t>(kMmaWarps) * padded_heads + 2 * kKeyTile) * stride * sizeof(bf16) +
         static_cast<size_t>(kMmaWarps) * padded_heads * sizeof(float);
}

__global__ void __launch_bounds__(kMmaThreads)
    indexer_scores_sm80_bf16_kernel(ScoreParams p, int padded_heads, int padded_dim, bool vector) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int stride = padded_dim + kRowPad;
  bf16* q_st = reinterpret_cast<bf16*>(smem);
  bf16* k_st = q_st + kMmaWarps * padded_heads * stride;
  float* w_st = reinterpret_cast<float*>(k_st + 2 * kKeyTile * stride);
  const bf16* q = static_cast<const bf16*>(p.q);
  const bf16* k = static_cast<const bf16*>(p.k);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * kMmaWarps;  // chunk row of warp 0
  const int rows_here = min(kMmaWarps, p.chunk_rows - row0);
  const int t_first = p.chunk_begin + row0, t_last = t_first + rows_here - 1;
  const KeySpan span = block_key_span(p, t_first, t_last, kKeyTile);
  if (span.first > span.last) return;  // the whole CTA: no key of its queries in this span

  load_bf16_tile(q_st, stride, kMmaWarps * padded_heads, padded_dim, p.dim, vector, [&](int i) -> const bf16* {
    const int r = i / padded_heads, h = i % padded_heads;
    return r < rows_here && h < p.heads ? q + (static_cast<int64_t>(t_first + r) * p.heads + h) * p.dim : nullptr;
  });
  for (int i = threadIdx.x; i < kMmaWarps * padded_heads; i += blockDim.x) {
    const int r = i / padded_heads, h = i % padded_heads;
    w_st[i] = r < rows_here && h < p.heads ? p.w[static_cast<int64_t>(t_first + r) * p.heads + h] : 0.0f;
  }

  const int t = t_first + warp;
  const bool active = warp < rows_here;
  const KeyRange range = active ? visible_keys(p.cu_seqlens, p.cu_seqlens_k, p.segments, t, p.key_tokens)
                                : KeyRange{0, -1};
  uint32_t* out = p.keys + static_cast<int64_t>(row0 + warp) * p.key_tokens;
  const int g = lane / 4, c = lane % 4;
  // Key tiles are double-buffered: the next one copies (cp.async when rows allow 16-byte copies)
  // while this one computes. One commit group per tile, empty past the span.
  auto stage = [&](int key0, bf16* dst) {
    if (key0 <= span.last && vector) {
      const int chunks = padded_dim / 8;
      for (int e = threadIdx.x; e < kKeyTile * chunks; e += blockDim.x) {
        const int i = e / chunks, col = (e % chunks) * 8;
        const bool copy = key0 + i <= span.last && col < p.dim;
        cp_async_16(dst + i * stride + col, copy ? k + static_cast<int64_t>(key0 + i) * p.dim + col : k, copy);
      }
    } else if (key0 <= span.last) {
      load_bf16_tile(dst, stride, kKeyTile, padded_dim, p.dim, false, [&](int i) -> const bf16* {
        return key0 + i <= span.last ? k + static_cast<int64_t>(key0 + i) * p.dim : nullptr;
      });
    }
    cp_async_commit();
  };
  stage(span.first, k_st);
  int buffer = 0;
  for (int key0 = span.first; key0 <= span.last; key0 += kKeyTile, buffer ^= 1) {
    __syncthreads();  // every warp is done with the other buffer (the previous tile)
    stage(key0 + kKeyTile, k_st + (buffer ^ 1) * kKeyTile * stride);
    cp_async_wait<1>();
    __syncthreads();  // this tile (and, the first time, q and w) written for every warp
    const bf16* k_tile = k_st + buffer * kKeyTile * stride;
    if (!active || key0 > range.last || key0 + kKeyTile <= range.first) continue;  // warp-uniform

    // part[n][e]: this lane's rows' (heads g, g + 8 of every head block) weighted relu logits for
    // keys key0 + 8n + 2c + e; summed over the lanes of equal c afterwards.
    float part[kKeyTile / 8][2];
#pragma unroll
    for (int n = 0; n < kKeyTile / 8; ++n) part[n][0] = part[n][1] = 0.0f;
    // Head blocks go kGroupBlocks at a time, so that each k fragment loaded from shared memory
    // feeds every head block of the group (shared-memory reads bound this loop). Per head block
    // the sums run over k0 ascending, then the blocks add to `part` in head order.
    for (int hg = 0; hg < padded_heads; hg += 16 * kGroupBlocks) {
      float acc[kGroupBlocks][kKeyTile / 8][4];
#pragma unroll
      for (int hb = 0; hb < kGroupBlocks; ++hb) {
#pragma unroll
        for (int n = 0; n < kKeyTile / 8; ++n) acc[hb][n][0] = acc[hb][n][1] = acc[hb][n][2] = acc[hb][n][3] = 0.0f;
      }
      for (int k0 = 0; k0 < padded_dim; k0 += 16) {
        uint32_t b[kKeyTile / 16][4];
#pragma unroll
        for (int j = 0; j < kKeyTile / 16; ++j) load_b_x2<BLayout::kNK>(b[j], k_tile, stride, j * 16, k0, lane);
#pragma unroll
        for (int hb = 0; hb < kGroupBlocks; ++hb) {
          if (hg + 16 * hb >= padded_heads) break;  // warp-uniform
          uint32_t a[4];
          load_a<ALayout::kMK>(a, q_st, stride, warp * padded_heads + hg + 16 * hb, k0, lane);
#pragma unroll
          for (int j = 0; j < kKeyTile / 16; ++j) {
            mma_m16n8k16_bf16(acc[hb][2 * j], a, b[j][0], b[j][1]);
            mma_m16n8k16_bf16(acc[hb][2 * j + 1], a, b[j][2], b[j][3]);
          }
        }
      }
#pragma unroll
      for (int hb = 0; hb < kGroupBlocks; ++hb) {
        const int h0 = hg + 16 * hb;
        if (h0 >= padded_heads) break;
        const float w_lo = w_st[warp * padded_heads + h0 + g], w_hi = w_st[warp * padded_heads + h0 + g + 8];
#pragma unroll
        for (int n = 0; n < kKeyTile / 8; ++n) {
          part[n][0] += w_lo * relu_like_reference(acc[hb][n][0]) + w_hi * relu_like_reference(acc[hb][n][2]);
          part[n][1] += w_lo * relu_like_reference(acc[hb][n][1]) + w_hi * relu_like_reference(acc[hb][n][3]);
        }
      }
    }
    // Sum over g (lane bits 2-4): every lane then holds the full scores of its columns; lane
    // (g, c) writes n-tile g's two.
    float mine[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < kKeyTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = part[n][e];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (n == g) mine[e] = v;
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int s = key0 + 8 * g + 2 * c + e;
      if (s >= range.first && s <= range.last) out[s] = score_key(mine[e] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SIMT scores (any operand dtype): the reference's order of sums (heads ascending, then scale)

__global__ void __launch_bounds__(kSimtThreads) indexer_scores_simt_kernel(ScoreParams p) {
  extern __shared__ float k_tile[];  // [kSimtKeys][dim + 1]: a lane per row, conflict-free
  const int stride = p.dim + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * kSimtWarps;
  const int rows_here = min(kSimtWarps, p.chunk_rows - row0);
  const int t_first = p.chunk_begin + row0, t_last = t_first + rows_here - 1;
  const int t = t_first + warp;
  const bool active = warp < rows_here;
  const KeyRange range = active ? visible_keys(p.cu_seqlens, p.cu_seqlens_k, p.segments, t, p.key_tokens)
                                : KeyRange{0, -1};
  uint32_t* out = p.keys + static_cast<int64_t>(row0 + warp) * p.key_tokens;
  const KeySpan span = block_key_span(p, t_first, t_last, kSimtKeys);
  for (int key0 = span.first; key0 <= span.last; key0 += kSimtKeys) {
    __syncthreads();
    for (int e = threadIdx.x; e < kSimtKeys * p.dim; e += blockDim.x) {
      const int i = e / p.dim, d = e % p.dim;
      k_tile[i * stride + d] =
          key0 + i <= span.last ? load_value(p.k, p.k_bf16, static_cast<int64_t>(key0 + i) * p.dim + d) : 0.0f;
    }
    __syncthreads();
    const int s = key0 + lane;
    if (!active || key0 > range.last || key0 + kSimtKeys <= range.first) continue;  // warp-uniform
    float score = 0.0f;
    for (int j = 0; j < p.heads; ++j) {
      const int64_t q_row = (static_cast<int64_t>(t) * p.heads + j) * p.dim;
      float dot = 0.0f;
      for (int d = 0; d < p.dim; ++d) dot += load_value(p.q, p.q_bf16, q_row + d) * k_tile[lane * stride + d];
      score += p.w[static_cast<int64_t>(t) * p.heads + j] * relu_like_reference(dot);
    }
    if (s >= range.first && s <= range.last) out[s] = score_key(score * p.scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Selection

using SelectScan = cub::BlockScan<unsigned long long, kSelectThreads>;

__global__ void __launch_bounds__(kSelectThreads)
    indexer_select_kernel(const uint32_t* __restrict__ keys, int chunk_begin, int key_tokens,
                          const int32_t* __restrict__ cu_seqlens, const int32_t* __restrict__ cu_seqlens_k,
                          int segments, int top_k, int cache_keys, int32_t* __restrict__ topk_index) {
  extern __shared__ uint32_t cached[];  // cache_keys entries
  __shared__ int histogram[256];
  __shared__ int chosen_bin, count_above;
  __shared__ typename SelectScan::TempStorage scan_storage;

  const int t = chunk_begin + blockIdx.x;
  const KeyRange range = visible_keys(cu_seqlens, cu_seqlens_k, segments, t, key_tokens);
  const int start = range.first;
  const int n = max(range.last - start + 1, 0);
  int32_t* out = topk_index + static_cast<int64_t>(t) * top_k;
  if (n <= top_k) {  // every key of the range, then padding
    for (int i = threadIdx.x; i < top_k; i += blockDim.x) out[i] = i < n ? start + i : -1;
    return;
  }
  const uint32_t* row = keys + static_cast<int64_t>(blockIdx.x) * key_tokens + start;
  if (n <= cache_keys) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) cached[i] = row[i];
    __syncthreads();
    row = cached;
  }

  // The top_k-th largest key, 8 bits at a time from the top: `remaining` counts how many of the
  // keys matching `prefix` so far still belong to the top.
  uint32_t prefix = 0u, mask = 0u;
  int remaining = top_k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    // Whole warps run every iteration (the bound is uniform): lanes of equal digit count once.
    for (int base = 0; base < n; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const uint32_t key = i < n ? row[i] : 0u;
      const bool counts = i < n && (key & mask) == prefix;
      if (__any_sync(0xffffffffu, counts)) {
        const uint32_t digit = counts ? (key >> shift) & 255u : 256u;
        const unsigned peers = __match_any_sync(0xffffffffu, digit);
        if (counts && threadIdx.x % 32 == __ffs(peers) - 1) atomicAdd(&histogram[digit], __popc(peers));
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l owns bins 255 - 8l down to 248 - 8l; an exclusive scan over lanes gives the count
      // of keys in the bins above a lane's first.
      const int lane = threadIdx.x;
      int local = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) local += histogram[255 - 8 * lane - e];
      int inclusive = local;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      int above = inclusive - local;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int bin = 255 - 8 * lane - e, count = histogram[bin];
        if (above < remaining && above + count >= remaining) {
          chosen_bin = bin;
          count_above = above;
        }
        above += count;
      }
    }
    __syncthreads();
    remaining -= count_above;
    prefix |= static_cast<uint32_t>(chosen_bin) << shift;
    mask |= 255u << shift;
  }

  // Keys above the threshold all belong; of those equal to it, the first `remaining` in s order.
  // Selected-before counts: (above, equal) packed in one 64-bit scan, in index order.
  unsigned long long running = 0ull;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const uint32_t key = i < n ? row[i] : 0u;
    const bool above = i < n && key > prefix, equal = i < n && key == prefix;
    const unsigned long long mine = (equal ? (1ull << 32) : 0ull) | (above ? 1ull : 0ull);
    unsigned long long before = 0ull, total = 0ull;
    SelectScan(scan_storage).ExclusiveSum(mine, before, total);
    before += running;
    const int above_before = static_cast<int>(before & 0xffffffffull);
    const int equal_before = static_cast<int>(before >> 32);
    if (above || (equal && equal_before < remaining)) out[above_before + min(equal_before, remaining)] = start + i;
    running += total;
    __syncthreads();  // scan_storage is reused
  }
}

}  // namespace

void dsa_indexer_topk(const DsaIndexerArgs& args, DeviceScratch& scratch, cudaStream_t stream, int64_t chunk_rows) {
  const int64_t tokens = args.q.size(0), heads = args.q.size(1), dim = args.q.size(2), top_k = args.top_k;
  if (tokens == 0) return;
  ScoreParams p;
  p.q = args.q.data;
  p.k = args.k.data;
  p.q_bf16 = args.q.dtype == DType::kBF16;
  p.k_bf16 = args.k.dtype == DType::kBF16;
  p.w = static_cast<const float*>(args.weights.data);
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  p.cu_seqlens_k = args.cu_seqlens_k.data != nullptr ? static_cast<const int32_t*>(args.cu_seqlens_k.data) : p.cu_seqlens;
  p.segments = static_cast<int>(std::max<int64_t>(1, args.cu_seqlens.numel() - 1));
  p.tokens = static_cast<int>(tokens);
  const int64_t key_tokens = args.k.size(0);  // tokens unless cu_seqlens_k is given
  p.key_tokens = static_cast<int>(key_tokens);
  p.heads = static_cast<int>(heads);
  p.dim = static_cast<int>(dim);
  p.scale = static_cast<float>(args.scale);
  int32_t* out = static_cast<int32_t*>(args.topk_index.data);
  // kKeySpan keys per score CTA, more where the grid's y limit would not cover every key.
  const int64_t min_span = ((key_tokens + kMaxGridY - 1) / kMaxGridY + kKeyTile - 1) / kKeyTile * kKeyTile;
  p.key_span = static_cast<int>(std::max<int64_t>(kKeySpan, min_span));
  const unsigned key_spans = static_cast<unsigned>(std::max<int64_t>(1, (key_tokens + p.key_span - 1) / p.key_span));

  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(1, kScoreBudgetBytes / (std::max<int64_t>(key_tokens, 1) * 4));
  chunk_rows = std::min(chunk_rows, tokens);
  // No query has more than `key_tokens` keys: with top_k >= key_tokens every query takes its whole
  // range and no score is needed.
  const bool need_scores = top_k < key_tokens;
  if (need_scores) p.keys = static_cast<uint32_t*>(scratch.reserve(static_cast<size_t>(chunk_rows * key_tokens) * 4));

  int device = 0, smem_optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int padded_heads = static_cast<int>((heads + 15) / 16 * 16), padded_dim = static_cast<int>((dim + 15) / 16 * 16);
  const size_t mma_smem = mma_scores_smem_bytes(padded_heads, padded_dim);
  const bool use_mma = p.q_bf16 && p.k_bf16 && mma_smem <= static_cast<size_t>(smem_optin);
  const bool vector = dim % 8 == 0 && (reinterpret_cast<uintptr_t>(p.q) & 15u) == 0 &&
                      (reinterpret_cast<uintptr_t>(p.k) & 15u) == 0;
  const size_t simt_smem = static_cast<size_t>(kSimtKeys) * (dim + 1) * sizeof(float);
  if (need_scores) {
    if (use_mma) {
      CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_sm80_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(mma_smem)));
    } else {
      CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_simt_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(simt_smem)));
    }
  }
  const int cache_keys = static_cast<int>(std::min<int64_t>(key_tokens, kSelectCacheKeys));
  const size_t select_smem = static_cast<size_t>(cache_keys) * sizeof(uint32_t);
  CUDA_CHECK(cudaFuncSetAttribute(indexer_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(select_smem)));

  for (int64_t begin = 0; begin < tokens; begin += chunk_rows) {
    const int rows = static_cast<int>(std::min(chunk_rows, tokens - begin));
    p.chunk_begin = static_cast<int>(begin);
    p.chunk_rows = rows;
    if (need_scores) {
      if (use_mma) {
        const dim3 grid((rows + kMmaWarps - 1) / kMmaWarps, key_spans);
        indexer_scores_sm80_bf16_kernel<<<grid, kMmaThreads, mma_smem, stream>>>(p, padded_heads, padded_dim, vector);
      } else {
        const dim3 grid((rows + kSimtWarps - 1) / kSimtWarps, key_spans);
        indexer_scores_simt_kernel<<<grid, kSimtThreads, simt_smem, stream>>>(p);
      }
      CUDA_CHECK_LAUNCH();
    }
    indexer_select_kernel<<<rows, kSelectThreads, select_smem, stream>>>(p.keys, p.chunk_begin, p.key_tokens,
                                                                         p.cu_seqlens, p.cu_seqlens_k, p.segments,
                                                                         static_cast<int>(top_k), cache_keys, out);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moetrain::kernels::cuda_ops
