// Causal attention within cu_seqlens segments, FlashAttention-2 style: the [T, T] score matrix
// never exists in memory. Forward and backward side by side; the CPU reference
// (kernels/cpu/attention.cpp) is the spec.
//
// Forward: one block per (64-query tile, head). It walks the key tiles (32 keys) from the start
// of its first query's segment to its last query, keeping an online softmax in F32 registers
// (running max and sum per row) and the output accumulator [64, v_dim] spread over 256 threads.
// lse = max + log(sum) is saved (natural log, scale included).
//
// Backward (deterministic, no atomics), after delta[t, h] = dout[t, h] . out[t, h]:
//   dk/dv pass: one block per (32-key tile, head) walks the query tiles that see those keys
//     (from the tile's first key to the end of its last key's segment), recomputes
//     P = exp(scale q.k - lse), dP = dout.v, dS = P (dP - delta) scale, and accumulates
//     dv += P^T dout, dk += dS^T q in registers.
//   dq pass: one block per (32-query tile, head) walks the key tiles as the forward does and
//     accumulates dq += dS k.
// Each pass owns its output rows outright, so every element is written once, in a fixed order.
//
// Segments: a query row's visible keys come from a binary search of cu_seqlens; a tile may
// straddle segments, so masking is per (query, key): first(t) <= s <= last(t). Keys with segments
// of their own (cu_seqlens_k, a context-parallel shard's queries against every earlier key) only
// move those bounds: last(t) = t + k_end - q_end, or t + key_shift for one chunk of a shard's
// keys, where a query may see none (out 0, lse -inf; attention_merge below folds the chunks)
// (attention_segments.cuh); without them the kernels take cu_seqlens_k = cu_seqlens, so
// first(t) = segment start, last(t) = t.
//
// Three paths, picked in attention_forward / attention_backward below (the one place):
//   1. Hopper flash attention (flash_attention_sm90_*.cu: wgmma + TMA, warp-specialised) for BF16
//      operands with head dims 64/64, 128/128 or MLA's 192/128 on an sm_90 device;
//   2. mma.sync tensor cores (attention_sm80.cu) for other BF16 head dims that are
//      multiples of 16 (up to 256), and for everything BF16 when MOETRAIN_ATTENTION=mma;
//   3. everything else, everything when MOETRAIN_ATTENTION=simt, and every call with cu_seqlens_k
// (the tensor-core paths assume keys at the queries' rows) runs the SIMT kernels below: F32 FMAs
// from shared memory, a 16 x 16 thread grid holding a 4 x 2
// (forward scores) or 2 x 2 (backward) micro-tile of scores and 16-column-strided slices of the
// accumulators, so value/key columns are read conflict-free (rows padded by one float). They are
// ~16x slower than the tensor-core path (docs/PERF.md) and serve as its reference on the GPU.
#include "kernels/cuda/attention/attention.h"

#include <cuda_bf16.h>

#include <climits>
#include <type_traits>
#include <cmath>
#include <string>

#include "kernels/cuda/attention/attention_segments.cuh"
#include "kernels/cuda/attention/attention_sm80.h"
#include "kernels/cuda/attention/flash_attention_sm90.h"
#include "kernels/arg_checks.h"
#include "kernels/cuda/common/cuda_check.h"

namespace moetrain::kernels::cuda_ops {
namespace {

// ---------------------------------------------------------------------------------------------
// Tiling constants (device code) and operands

constexpr int kThreads = 256;     // a 16 x 16 grid: ty = tid / 16 (rows), tx = tid % 16 (cols)
constexpr int kGridSide = 16;
constexpr int kForwardRows = 64;  // queries per forward block (4 per thread row)
constexpr int kForwardKeys = 32;  // keys per forward step (2 per thread column)
constexpr int kBackwardRows = 32;  // queries per backward step (2 per thread row)
constexpr int kBackwardKeys = 32;  // keys per backward step (2 per thread column)
constexpr int kMaxHeadDim = 256;   // 16 columns per thread at most
static_assert(kGridSide * kGridSide == kThreads, "the thread grid is 16 x 16");
static_assert(kForwardRows % kGridSide == 0 && kForwardKeys % kGridSide == 0, "forward tiles are whole thread rows");
static_assert(kBackwardRows == 2 * kGridSide && kBackwardKeys == 2 * kGridSide, "backward micro-tile is 2 x 2");

// A BF16 or F32 operand, chosen at run time (a warp-uniform branch on each load).
struct InOperand {
  const void* data = nullptr;
  bool bf16 = false;
};
struct OutOperand {
  void* data = nullptr;
  bool bf16 = false;
};

__device__ __forceinline__ float load_element(const InOperand& x, int64_t i) {
  return x.bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x.data)[i]) : static_cast<const float*>(x.data)[i];
}
__device__ __forceinline__ void store_element(const OutOperand& x, int64_t i, float value) {
  if (x.bf16) {
    static_cast<__nv_bfloat16*>(x.data)[i] = __float2bfloat16_rn(value);
  } else {
    static_cast<float*>(x.data)[i] = value;
  }
}

struct AttentionShape {
  int tokens = 0;  // cu_seqlens is int32, so token indices fit in int
  int key_tokens = 0;  // k, v rows: tokens unless cu_seqlens_k is given
  int heads = 0;
  int qk_dim = 0;
  int v_dim = 0;
  int num_segments = 0;
  float scale = 1.0f;
  int key_shift = kSegmentShift;  // AttentionArgs::key_shift (attention_segments.cuh)
};


// Copies rows [row0, row0 + rows) of head `head` of a [tokens, heads, dim] operand into a
// shared tile [rows][dim + 1] as F32; rows at or past `row_limit` become zeros.
__device__ void load_tile(float* tile, const InOperand& src, int row0, int rows, int row_limit, int head, int heads,
                          int dim) {
  const int stride = dim + 1;
  for (int i = threadIdx.x; i < rows * dim; i += kThreads) {
    const int r = i / dim, d = i - r * dim;
    const int t = row0 + r;
    tile[r * stride + d] = t < row_limit ? load_element(src, (static_cast<int64_t>(t) * heads + head) * dim + d) : 0.0f;
  }
}

// Sum and max over the 16 threads of one thread row (they are one half of a warp).
__device__ __forceinline__ float row_max16(float x) {
  for (int offset = 8; offset >= 1; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float row_sum16(float x) {
  for (int offset = 8; offset >= 1; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Forward

struct ForwardParams {
  OutOperand out;
  float* lse = nullptr;
  InOperand q, k, v;
  const int32_t* cu_seqlens = nullptr;
  const int32_t* cu_seqlens_k = nullptr;  // cu_seqlens when the keys have no segments of their own
  AttentionShape shape;
};

__host__ __device__ constexpr size_t forward_smem_floats(int qk_dim, int v_dim) {
  return static_cast<size_t>(kForwardRows) * (qk_dim + 1) + static_cast<size_t>(kForwardKeys) * (qk_dim + 1) +
         static_cast<size_t>(kForwardKeys) * (v_dim + 1) + static_cast<size_t>(kForwardRows) * (kForwardKeys + 1) +
         2 * kForwardRows;  // + the int first and last visible keys
}

// kCols: value columns per thread (v_dim <= 16 * kCols).
template <int kCols>
__global__ void __launch_bounds__(kThreads) attention_forward_simt_f32acc_kernel(ForwardParams p) {
  constexpr int kRowsPerThread = kForwardRows / kGridSide;  // 4
  constexpr int kKeysPerThread = kForwardKeys / kGridSide;  // 2
  extern __shared__ float smem[];
  const AttentionShape& s = p.shape;
  const int qk_stride = s.qk_dim + 1, v_stride = s.v_dim + 1, p_stride = kForwardKeys + 1;
  float* q_tile = smem;                                // [kForwardRows][qk_stride]
  float* k_tile = q_tile + kForwardRows * qk_stride;   // [kForwardKeys][qk_stride]
  float* v_tile = k_tile + kForwardKeys * qk_stride;   // [kForwardKeys][v_stride]
  float* p_tile = v_tile + kForwardKeys * v_stride;    // [kForwardRows][p_stride]
  int* row_start = reinterpret_cast<int*>(p_tile + kForwardRows * p_stride);  // [kForwardRows]
  int* row_last = row_start + kForwardRows;                                   // [kForwardRows]

  const int ty = threadIdx.x / kGridSide, tx = threadIdx.x % kGridSide;
  const int head = blockIdx.y;
  const int m0 = blockIdx.x * kForwardRows;
  const int row_end = min(m0 + kForwardRows, s.tokens);

  load_tile(q_tile, p.q, m0, kForwardRows, s.tokens, head, s.heads, s.qk_dim);
  for (int r = threadIdx.x; r < kForwardRows; r += kThreads) {
    const int t = m0 + r;
    const KeyRange keys = t < s.tokens ? visible_keys(p.cu_seqlens, p.cu_seqlens_k, s.num_segments, t, s.key_tokens, s.key_shift)
                                       : KeyRange{INT_MAX, -1};
    row_start[r] = keys.first;
    row_last[r] = keys.last;
  }
  __syncthreads();

  float acc[kRowsPerThread][kCols];
  float row_max[kRowsPerThread], row_sum[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;
  }

  // The first row's keys start no later than any other row's, the last row's end no earlier
  // (both bounds are monotone in t).
  const int kv_begin = row_start[0];
  const int kv_end = row_last[row_end - 1 - m0] + 1;
  for (int n0 = kv_begin; n0 < kv_end; n0 += kForwardKeys) {
    load_tile(k_tile, p.k, n0, kForwardKeys, kv_end, head, s.heads, s.qk_dim);
    load_tile(v_tile, p.v, n0, kForwardKeys, kv_end, head, s.heads, s.v_dim);
    __syncthreads();

    float score[kRowsPerThread][kKeysPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kKeysPerThread; ++j) score[i][j] = 0.0f;
    for (int d = 0; d < s.qk_dim; ++d) {
      float qv[kRowsPerThread], kv[kKeysPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) qv[i] = q_tile[(ty + kGridSide * i) * qk_stride + d];
#pragma unroll
      for (int j = 0; j < kKeysPerThread; ++j) kv[j] = k_tile[(tx + kGridSide * j) * qk_stride + d];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kKeysPerThread; ++j) score[i][j] = fmaf(qv[i], kv[j], score[i][j]);
    }

#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = ty + kGridSide * i, t = m0 + r;
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeysPerThread; ++j) {
        const int key = n0 + tx + kGridSide * j;
        const bool visible = t < s.tokens && key <= row_last[r] && key >= row_start[r];
        score[i][j] = visible ? score[i][j] * s.scale : -INFINITY;
        tile_max = fmaxf(tile_max, score[i][j]);
      }
      tile_max = row_max16(tile_max);
      const float new_max = fmaxf(row_max[i], tile_max);
      // While a row has seen no visible key its max is -inf; exponents are then taken against 0
      // so that exp(-inf - base) is 0, never exp(NaN).
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float correction = expf(row_max[i] - base);
      float tile_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeysPerThread; ++j) {
        const float prob = expf(score[i][j] - base);
        p_tile[r * p_stride + tx + kGridSide * j] = prob;
        tile_sum += prob;
      }
      tile_sum = row_sum16(tile_sum);
      row_sum[i] = row_sum[i] * correction + tile_sum;
      row_max[i] = new_max;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] *= correction;
    }
    __syncthreads();

    // acc += P . V; keys past the visible range have P = 0 and zero-filled V rows.
    for (int n = 0; n < kForwardKeys; ++n) {
      float pv[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) pv[i] = p_tile[(ty + kGridSide * i) * p_stride + n];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = tx + kGridSide * c;
        const float vv = col < s.v_dim ? v_tile[n * v_stride + col] : 0.0f;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) acc[i][c] = fmaf(pv[i], vv, acc[i][c]);
      }
    }
    __syncthreads();  // k/v/p tiles are overwritten next step
  }

#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int t = m0 + ty + kGridSide * i;
    if (t >= s.tokens) continue;
    // A row that sees a key has row_sum >= 1 (the max term is exp(0)); one that sees none (a
    // chunk of the keys, AttentionArgs::key_shift) gets out 0 and lse -inf.
    const float inv_sum = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f;
    const int64_t out_row = (static_cast<int64_t>(t) * s.heads + head) * s.v_dim;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = tx + kGridSide * c;
      if (col < s.v_dim) store_element(p.out, out_row + col, acc[i][c] * inv_sum);
    }
    if (tx == 0) p.lse[static_cast<int64_t>(t) * s.heads + head] = row_sum[i] > 0.0f ? row_max[i] + logf(row_sum[i]) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

struct BackwardParams {
  OutOperand dq, dk, dv;
  InOperand dout, q, k, v;
  const float* lse = nullptr;
  const float* delta = nullptr;  // [tokens, heads] = dout . out
  const int32_t* cu_seqlens = nullptr;
  const int32_t* cu_seqlens_k = nullptr;  // as ForwardParams
  AttentionShape shape;
};

// delta[t, h] = sum_c dout[t, h, c] * out[t, h, c], one warp per (t, h).
__global__ void attention_backward_delta_kernel(float* delta, InOperand dout, InOperand out, int64_t rows, int v_dim) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together: rows are per warp
  float sum = 0.0f;
  for (int c = lane; c < v_dim; c += 32) sum = fmaf(load_element(dout, row * v_dim + c), load_element(out, row * v_dim + c), sum);
  for (int offset = 16; offset >= 1; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[row] = sum;
}

// Shared layout common to both backward passes: the query-side tiles (q, dout, lse, delta, row
// first and last visible keys) for kBackwardRows queries and the key-side tiles (k, v) for kBackwardKeys keys, plus
// the P and dS tiles.
struct BackwardTiles {
  float* q;      // [kBackwardRows][qk_dim + 1]
  float* dout;   // [kBackwardRows][v_dim + 1]
  float* k;      // [kBackwardKeys][qk_dim + 1]
  float* v;      // [kBackwardKeys][v_dim + 1]
  float* prob;   // [kBackwardRows][kBackwardKeys + 1]
  float* dscore; // [kBackwardRows][kBackwardKeys + 1]
  float* lse;    // [kBackwardRows]
  float* delta;  // [kBackwardRows]
  int* row_start;  // [kBackwardRows]
  int* row_last;   // [kBackwardRows]
};

__host__ __device__ constexpr size_t backward_smem_floats(int qk_dim, int v_dim) {
  return static_cast<size_t>(kBackwardRows) * (qk_dim + 1) + static_cast<size_t>(kBackwardRows) * (v_dim + 1) +
         static_cast<size_t>(kBackwardKeys) * (qk_dim + 1) + static_cast<size_t>(kBackwardKeys) * (v_dim + 1) +
         2 * static_cast<size_t>(kBackwardRows) * (kBackwardKeys + 1) + 4 * static_cast<size_t>(kBackwardRows);
}

__device__ BackwardTiles carve_backward_tiles(float* smem, int qk_dim, int v_dim) {
  BackwardTiles tiles;
  tiles.q = smem;
  tiles.dout = tiles.q + kBackwardRows * (qk_dim + 1);
  tiles.k = tiles.dout + kBackwardRows * (v_dim + 1);
  tiles.v = tiles.k + kBackwardKeys * (qk_dim + 1);
  tiles.prob = tiles.v + kBackwardKeys * (v_dim + 1);
  tiles.dscore = tiles.prob + kBackwardRows * (kBackwardKeys + 1);
  tiles.lse = tiles.dscore + kBackwardRows * (kBackwardKeys + 1);
  tiles.delta = tiles.lse + kBackwardRows;
  tiles.row_start = reinterpret_cast<int*>(tiles.delta + kBackwardRows);
  tiles.row_last = tiles.row_start + kBackwardRows;
  return tiles;
}

// Loads the query-side tiles for queries [m0, m0 + kBackwardRows); rows at or past query_limit
// are zeros with an empty key range (masked).
__device__ void load_query_side(const BackwardTiles& tiles, const BackwardParams& p, int m0, int query_limit, int head) {
  const AttentionShape& s = p.shape;
  load_tile(tiles.q, p.q, m0, kBackwardRows, query_limit, head, s.heads, s.qk_dim);
  load_tile(tiles.dout, p.dout, m0, kBackwardRows, query_limit, head, s.heads, s.v_dim);
  for (int r = threadIdx.x; r < kBackwardRows; r += kThreads) {
    const int t = m0 + r;
    const bool valid = t < query_limit;
    const int64_t row = static_cast<int64_t>(t) * s.heads + head;
    tiles.lse[r] = valid ? p.lse[row] : 0.0f;
    tiles.delta[r] = valid ? p.delta[row] : 0.0f;
    const KeyRange keys = valid ? visible_keys(p.cu_seqlens, p.cu_seqlens_k, s.num_segments, t, s.key_tokens, s.key_shift)
                                : KeyRange{INT_MAX, -1};
    tiles.row_start[r] = keys.first;
    tiles.row_last[r] = keys.last;
  }
}

// For this thread's 2 x 2 (query ty + 16a, key tx + 16b) entries: P and dS = P (dP - delta) scale,
// written to the shared prob/dscore tiles; invisible pairs get 0.
__device__ void compute_prob_and_dscore(const BackwardTiles& tiles, const AttentionShape& s, int m0, int n0,
                                        int query_limit) {
  const int ty = threadIdx.x / kGridSide, tx = threadIdx.x % kGridSide;
  const int qk_stride = s.qk_dim + 1, v_stride = s.v_dim + 1, p_stride = kBackwardKeys + 1;
  float score[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  float dprob[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (int d = 0; d < s.qk_dim; ++d) {
    const float q0 = tiles.q[ty * qk_stride + d], q1 = tiles.q[(ty + kGridSide) * qk_stride + d];
    const float k0 = tiles.k[tx * qk_stride + d], k1 = tiles.k[(tx + kGridSide) * qk_stride + d];
    score[0][0] = fmaf(q0, k0, score[0][0]);
    score[0][1] = fmaf(q0, k1, score[0][1]);
    score[1][0] = fmaf(q1, k0, score[1][0]);
    score[1][1] = fmaf(q1, k1, score[1][1]);
  }
  for (int d = 0; d < s.v_dim; ++d) {
    const float g0 = tiles.dout[ty * v_stride + d], g1 = tiles.dout[(ty + kGridSide) * v_stride + d];
    const float v0 = tiles.v[tx * v_stride + d], v1 = tiles.v[(tx + kGridSide) * v_stride + d];
    dprob[0][0] = fmaf(g0, v0, dprob[0][0]);
    dprob[0][1] = fmaf(g0, v1, dprob[0][1]);
    dprob[1][0] = fmaf(g1, v0, dprob[1][0]);
    dprob[1][1] = fmaf(g1, v1, dprob[1][1]);
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int r = ty + kGridSide * a, t = m0 + r;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int c = tx + kGridSide * b, key = n0 + c;
      const bool visible = t < query_limit && key <= tiles.row_last[r] && key >= tiles.row_start[r];
      const float prob = visible ? expf(score[a][b] * s.scale - tiles.lse[r]) : 0.0f;
      tiles.prob[r * p_stride + c] = prob;
      tiles.dscore[r * p_stride + c] = visible ? prob * (dprob[a][b] - tiles.delta[r]) * s.scale : 0.0f;
    }
  }
}

// dk/dv pass. kCols: columns per thread for both dk and dv (max(qk_dim, v_dim) <= 16 * kCols).
template <int kCols>
__global__ void __launch_bounds__(kThreads) attention_backward_dkdv_simt_f32acc_kernel(BackwardParams p) {
  extern __shared__ float smem[];
  const AttentionShape& s = p.shape;
  const BackwardTiles tiles = carve_backward_tiles(smem, s.qk_dim, s.v_dim);
  const int ty = threadIdx.x / kGridSide, tx = threadIdx.x % kGridSide;
  const int qk_stride = s.qk_dim + 1, v_stride = s.v_dim + 1, p_stride = kBackwardKeys + 1;
  const int head = blockIdx.y;
  const int n0 = blockIdx.x * kBackwardKeys;
  const int last_key = min(n0 + kBackwardKeys, s.key_tokens) - 1;

  load_tile(tiles.k, p.k, n0, kBackwardKeys, s.key_tokens, head, s.heads, s.qk_dim);
  load_tile(tiles.v, p.v, n0, kBackwardKeys, s.key_tokens, head, s.heads, s.v_dim);

  float dk[2][kCols], dv[2][kCols];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dk[i][c] = dv[i][c] = 0.0f;

  // Queries that see these keys: from the one whose last key is the first key (the first key's
  // own query without cu_seqlens_k) to the end of the last key's segment.
  const int query_begin = first_query_seeing(p.cu_seqlens, p.cu_seqlens_k, s.num_segments, n0, s.key_shift);
  const int query_end = query_end_seeing(p.cu_seqlens, p.cu_seqlens_k, s.num_segments, last_key, s.tokens);
  for (int m0 = query_begin; m0 < query_end; m0 += kBackwardRows) {
    __syncthreads();  // the previous step's readers are done (and the k/v loads are ordered)
    load_query_side(tiles, p, m0, query_end, head);
    __syncthreads();
    compute_prob_and_dscore(tiles, s, m0, n0, query_end);
    __syncthreads();
    for (int m = 0; m < kBackwardRows; ++m) {
      const float p0 = tiles.prob[m * p_stride + ty], p1 = tiles.prob[m * p_stride + ty + kGridSide];
      const float ds0 = tiles.dscore[m * p_stride + ty], ds1 = tiles.dscore[m * p_stride + ty + kGridSide];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = tx + kGridSide * c;
        if (col < s.v_dim) {
          const float g = tiles.dout[m * v_stride + col];
          dv[0][c] = fmaf(p0, g, dv[0][c]);
          dv[1][c] = fmaf(p1, g, dv[1][c]);
        }
        if (col < s.qk_dim) {
          const float qv = tiles.q[m * qk_stride + col];
          dk[0][c] = fmaf(ds0, qv, dk[0][c]);
          dk[1][c] = fmaf(ds1, qv, dk[1][c]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = n0 + ty + kGridSide * i;
    if (key >= s.key_tokens) continue;
    const int64_t row = static_cast<int64_t>(key) * s.heads + head;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = tx + kGridSide * c;
      if (col < s.qk_dim) store_element(p.dk, row * s.qk_dim + col, dk[i][c]);
      if (col < s.v_dim) store_element(p.dv, row * s.v_dim + col, dv[i][c]);
    }
  }
}

// dq pass. kCols: dq columns per thread (qk_dim <= 16 * kCols).
template <int kCols>
__global__ void __launch_bounds__(kThreads) attention_backward_dq_simt_f32acc_kernel(BackwardParams p) {
  extern __shared__ float smem[];
  const AttentionShape& s = p.shape;
  const BackwardTiles tiles = carve_backward_tiles(smem, s.qk_dim, s.v_dim);
  const int ty = threadIdx.x / kGridSide, tx = threadIdx.x % kGridSide;
  const int qk_stride = s.qk_dim + 1, p_stride = kBackwardKeys + 1;
  const int head = blockIdx.y;
  const int m0 = blockIdx.x * kBackwardRows;
  const int row_end = min(m0 + kBackwardRows, s.tokens);

  load_query_side(tiles, p, m0, s.tokens, head);
  __syncthreads();
  const int kv_begin = tiles.row_start[0];
  const int kv_end = tiles.row_last[row_end - 1 - m0] + 1;

  float dq[2][kCols];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dq[i][c] = 0.0f;

  for (int n0 = kv_begin; n0 < kv_end; n0 += kBackwardKeys) {
    load_tile(tiles.k, p.k, n0, kBackwardKeys, kv_end, head, s.heads, s.qk_dim);
    load_tile(tiles.v, p.v, n0, kBackwardKeys, kv_end, head, s.heads, s.v_dim);
    __syncthreads();
    compute_prob_and_dscore(tiles, s, m0, n0, s.tokens);
    __syncthreads();
    for (int n = 0; n < kBackwardKeys; ++n) {
      const float ds0 = tiles.dscore[ty * p_stride + n], ds1 = tiles.dscore[(ty + kGridSide) * p_stride + n];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = tx + kGridSide * c;
        const float kv = col < s.qk_dim ? tiles.k[n * qk_stride + col] : 0.0f;
        dq[0][c] = fmaf(ds0, kv, dq[0][c]);
        dq[1][c] = fmaf(ds1, kv, dq[1][c]);
      }
    }
    __syncthreads();  // k/v/dscore tiles are overwritten next step
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = m0 + ty + kGridSide * i;
    if (t >= s.tokens) continue;
    const int64_t row = static_cast<int64_t>(t) * s.heads + head;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = tx + kGridSide * c;
      if (col < s.qk_dim) store_element(p.dq, row * s.qk_dim + col, dq[i][c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: checks, tile choice, launches


// The launchers check again what they rely on (kernels/arg_checks.h), as the backend does.
void expect_device(const char* op, const char* name, const TensorView& t) { expect_on(op, name, t, Device::kCUDA); }
InOperand activation_in(const char* op, const char* name, const TensorView& t) {
  expect_device(op, name, t);
  expect(t.dtype == DType::kBF16 || t.dtype == DType::kF32, op,
         std::string(name) + " is " + dtype_name(t.dtype) + ", expected BF16 or F32");
  return InOperand{t.data, t.dtype == DType::kBF16};
}
OutOperand activation_out(const char* op, const char* name, const TensorView& t) {
  const InOperand in = activation_in(op, name, t);
  return OutOperand{t.data, in.bf16};
}
void expect_f32(const char* op, const char* name, const TensorView& t) {
  expect_device(op, name, t);
  expect_dtype_is(op, name, t, DType::kF32);
}

// Shapes of q, k, v, out, lse, cu_seqlens (and cu_seqlens_k, if given), checked; the scale and
// the key shift too.
AttentionShape check_attention(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& lse, const TensorView& cu_seqlens,
                               const TensorView& cu_seqlens_k, double scale, int64_t key_shift) {
  expect(q.ndim() == 3 && v.ndim() == 3 && k.ndim() == 3, op, "q " + q.shape.str() + ", k " + k.shape.str() +
                                                                  " and v " + v.shape.str() +
                                                                  " must be [tokens, heads, dim]");
  const int64_t tokens = q.size(0), heads = q.size(1), qk_dim = q.size(2), v_dim = v.size(2);
  const bool own_keys = cu_seqlens_k.data != nullptr;
  const int64_t key_tokens = own_keys ? k.size(0) : tokens;
  expect_shape(op, "k", k, Shape{key_tokens, heads, qk_dim});
  expect_shape(op, "v", v, Shape{key_tokens, heads, v_dim});
  expect_shape(op, "out", out, Shape{tokens, heads, v_dim});
  expect(lse.numel() == tokens * heads, op, "lse is " + lse.shape.str() + ", expected [" + std::to_string(tokens) +
                                                ", " + std::to_string(heads) + "]");
  expect_f32(op, "lse", lse);
  expect(qk_dim >= 1 && qk_dim <= kMaxHeadDim && v_dim >= 1 && v_dim <= kMaxHeadDim, op,
         "qk_dim " + std::to_string(qk_dim) + " and v_dim " + std::to_string(v_dim) + " must be in [1, " +
             std::to_string(kMaxHeadDim) + "]");
  expect(heads >= 1 && heads <= 65535, op, std::to_string(heads) + " heads (grid y holds at most 65535)");
  expect(tokens <= INT_MAX && key_tokens <= INT_MAX, op,
         std::to_string(tokens) + " tokens, " + std::to_string(key_tokens) + " key tokens do not fit int32 cu_seqlens");
  expect_device(op, "cu_seqlens", cu_seqlens);
  expect(cu_seqlens.dtype == DType::kI32 && cu_seqlens.ndim() == 1 && cu_seqlens.numel() >= 2, op,
         "cu_seqlens is " + cu_seqlens.shape.str() + " " + dtype_name(cu_seqlens.dtype) +
             ", expected int32 [num_seqs + 1] with num_seqs >= 1");
  if (own_keys) {
    expect_device(op, "cu_seqlens_k", cu_seqlens_k);
    expect(cu_seqlens_k.dtype == DType::kI32 && cu_seqlens_k.ndim() == 1 &&
               cu_seqlens_k.numel() == cu_seqlens.numel(),
           op, "cu_seqlens_k is " + cu_seqlens_k.shape.str() + " " + dtype_name(cu_seqlens_k.dtype) +
                   ", expected int32 [" + std::to_string(cu_seqlens.numel()) + "] (as many segments as cu_seqlens)");
  }
  expect(std::isfinite(scale), op, "scale is not finite");
  const bool shifted = key_shift != kShiftFromSegments;
  expect(!shifted || (own_keys && key_shift > INT_MIN && key_shift <= INT_MAX), op,
         "key_shift " + std::to_string(key_shift) + " needs cu_seqlens_k and must fit int32");
  AttentionShape s;
  s.key_shift = shifted ? static_cast<int>(key_shift) : kSegmentShift;
  s.tokens = static_cast<int>(tokens);
  s.key_tokens = static_cast<int>(key_tokens);
  s.heads = static_cast<int>(heads);
  s.qk_dim = static_cast<int>(qk_dim);
  s.v_dim = static_cast<int>(v_dim);
  s.num_segments = static_cast<int>(cu_seqlens.numel() - 1);
  s.scale = static_cast<float>(scale);
  return s;
}

// Columns per thread for a head dimension: the register accumulators are sized at compile time.
template <typename F>
void dispatch_columns(int dim, F&& f) {
  if (dim <= 64) {
    f(std::integral_constant<int, 4>{});
  } else if (dim <= 128) {
    f(std::integral_constant<int, 8>{});
  } else if (dim <= 192) {
    f(std::integral_constant<int, 12>{});
  } else {
    f(std::integral_constant<int, 16>{});
  }
}

// Launches `kernel` with `smem_bytes` of dynamic shared memory, raising the per-kernel limit
// above the default 48 KB when needed (and refusing what the device cannot give).
template <typename Params>
void launch_with_smem(const char* op, void (*kernel)(Params), dim3 grid, size_t smem_bytes, cudaStream_t stream,
                      const Params& params) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  expect(smem_bytes <= static_cast<size_t>(optin), op,
         "needs " + std::to_string(smem_bytes) + " bytes of shared memory, the device allows " + std::to_string(optin));
  if (smem_bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  }
  kernel<<<grid, kThreads, smem_bytes, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

unsigned blocks_for(int tokens, int rows_per_block) {
  return static_cast<unsigned>((tokens + rows_per_block - 1) / rows_per_block);
}

}  // namespace

void attention_forward(const AttentionArgs& args, cudaStream_t stream) {
  const char* op = "attention_forward";
  ForwardParams p;
  p.shape = check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens, args.cu_seqlens_k,
                            args.scale, args.key_shift);
  p.out = activation_out(op, "out", args.out);
  p.lse = static_cast<float*>(args.lse.data);
  p.q = activation_in(op, "q", args.q);
  p.k = activation_in(op, "k", args.k);
  p.v = activation_in(op, "v", args.v);
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  const bool own_keys = args.cu_seqlens_k.data != nullptr;
  p.cu_seqlens_k = own_keys ? static_cast<const int32_t*>(args.cu_seqlens_k.data) : p.cu_seqlens;
  if (p.shape.tokens == 0) return;
  // The paths in order (the header comment says which shapes each takes).
  if (!own_keys && flash_attention_forward_sm90_supported(args)) {
    flash_attention_forward_sm90(args, stream);
    return;
  }
  if (!own_keys && attention_forward_sm80_supported(args)) {
    attention_forward_sm80(args, stream);
    return;
  }

  const dim3 grid(blocks_for(p.shape.tokens, kForwardRows), static_cast<unsigned>(p.shape.heads));
  const size_t smem = forward_smem_floats(p.shape.qk_dim, p.shape.v_dim) * sizeof(float);
  dispatch_columns(p.shape.v_dim, [&](auto cols) {
    launch_with_smem(op, attention_forward_simt_f32acc_kernel<decltype(cols)::value>, grid, smem, stream, p);
  });
}

void attention_backward(const AttentionBackwardArgs& args, cudaStream_t stream) {
  const char* op = "attention_backward";
  BackwardParams p;
  p.shape = check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens, args.cu_seqlens_k,
                            args.scale, args.key_shift);
  expect_shape(op, "dq", args.dq, args.q.shape);
  expect_shape(op, "dk", args.dk, args.k.shape);
  expect_shape(op, "dv", args.dv, args.v.shape);
  expect_shape(op, "dout", args.dout, args.out.shape);
  p.dq = activation_out(op, "dq", args.dq);
  p.dk = activation_out(op, "dk", args.dk);
  p.dv = activation_out(op, "dv", args.dv);
  p.dout = activation_in(op, "dout", args.dout);
  p.q = activation_in(op, "q", args.q);
  p.k = activation_in(op, "k", args.k);
  p.v = activation_in(op, "v", args.v);
  const InOperand out = activation_in(op, "out", args.out);
  p.lse = static_cast<const float*>(args.lse.data);
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  const bool own_keys = args.cu_seqlens_k.data != nullptr;
  p.cu_seqlens_k = own_keys ? static_cast<const int32_t*>(args.cu_seqlens_k.data) : p.cu_seqlens;
  const AttentionShape& s = p.shape;
  if (s.tokens == 0) {
    // Keys no query sees get zero gradients.
    if (own_keys && s.key_tokens > 0) {
      CUDA_CHECK(cudaMemsetAsync(args.dk.data, 0, args.dk.nbytes(), stream));
      CUDA_CHECK(cudaMemsetAsync(args.dv.data, 0, args.dv.nbytes(), stream));
    }
    return;
  }
  if (!own_keys && flash_attention_backward_sm90_supported(args)) {  // computes its own delta
    flash_attention_backward_sm90(args, stream);
    return;
  }

  // delta lives in stream-ordered scratch, freed on the stream after the two passes.
  const int64_t rows = static_cast<int64_t>(s.tokens) * s.heads;
  float* delta = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&delta), static_cast<size_t>(rows) * sizeof(float), stream));
  p.delta = delta;
  constexpr int kDeltaThreads = 256;  // 8 rows per block
  const unsigned delta_blocks = static_cast<unsigned>((rows * 32 + kDeltaThreads - 1) / kDeltaThreads);
  attention_backward_delta_kernel<<<delta_blocks, kDeltaThreads, 0, stream>>>(delta, p.dout, out, rows, s.v_dim);
  CUDA_CHECK_LAUNCH();

  if (!own_keys && attention_backward_sm80_supported(args)) {
    attention_backward_sm80(args, delta, stream);
  } else {
    const size_t smem = backward_smem_floats(s.qk_dim, s.v_dim) * sizeof(float);
    const unsigned heads = static_cast<unsigned>(s.heads);
    dispatch_columns(s.qk_dim > s.v_dim ? s.qk_dim : s.v_dim, [&](auto cols) {
      launch_with_smem(op, attention_backward_dkdv_simt_f32acc_kernel<decltype(cols)::value>,
                       dim3(blocks_for(s.key_tokens, kBackwardKeys), heads), smem, stream, p);
    });
    dispatch_columns(s.qk_dim, [&](auto cols) {
      launch_with_smem(op, attention_backward_dq_simt_f32acc_kernel<decltype(cols)::value>,
                       dim3(blocks_for(s.tokens, kBackwardRows), heads), smem, stream, p);
    });
  }
  CUDA_CHECK(cudaFreeAsync(delta, stream));
}

namespace {

// One thread per (row, column) of out; every thread of a row reads the row's two lse.
__global__ void attention_merge_kernel(OutOperand out, float* lse, InOperand chunk_out, const float* chunk_lse,
                                       int64_t rows, int v_dim) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * v_dim) return;
  const int64_t r = i / v_dim;
  const float a = lse[r], b = chunk_lse[r];
  const float base = fmaxf(a, b);
  if (base == -INFINITY) return;
  const float wa = expf(a - base), wb = expf(b - base), sum = wa + wb;
  const float merged = wa * load_element(InOperand{out.data, out.bf16}, i) + wb * load_element(chunk_out, i);
  store_element(out, i, merged / sum);
}

// lse is written after every column of its row has read it: a second pass.
__global__ void attention_merge_lse_kernel(float* lse, const float* chunk_lse, int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float a = lse[r], b = chunk_lse[r];
  const float base = fmaxf(a, b);
  if (base != -INFINITY) lse[r] = base + logf(expf(a - base) + expf(b - base));
}

}  // namespace

void attention_merge(const AttentionMergeArgs& args, cudaStream_t stream) {
  const char* op = "attention_merge";
  const OutOperand out = activation_out(op, "out", args.out);
  const InOperand chunk_out = activation_in(op, "chunk_out", args.chunk_out);
  expect_f32(op, "lse", args.lse);
  expect_f32(op, "chunk_lse", args.chunk_lse);
  const int64_t rows = args.lse.numel(), v_dim = args.out.size(2);
  if (rows == 0 || v_dim == 0) return;
  constexpr int kMergeThreads = 256;
  attention_merge_kernel<<<static_cast<unsigned>((rows * v_dim + kMergeThreads - 1) / kMergeThreads), kMergeThreads, 0,
                           stream>>>(out, static_cast<float*>(args.lse.data), chunk_out,
                                     static_cast<const float*>(args.chunk_lse.data), rows, static_cast<int>(v_dim));
  CUDA_CHECK_LAUNCH();
  attention_merge_lse_kernel<<<static_cast<unsigned>((rows + kMergeThreads - 1) / kMergeThreads), kMergeThreads, 0,
                               stream>>>(static_cast<float*>(args.lse.data), static_cast<const float*>(args.chunk_lse.data),
                                         rows);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
