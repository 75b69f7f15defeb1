// Causal segment attention on BF16 tensor cores (mma.sync.m16n8k16, F32 accumulators),
// FlashAttention-2 style; the SIMT kernels in attention.cu are its reference on the GPU and the
// CPU reference (kernels/cpu/attention.cpp) is the spec.
//
// Every kernel runs 4 warps; each warp owns 16 rows of the CTA's 64-row block and computes
// 16 x 8 accumulator tiles. Fragment layouts (PTX ISA, mma.m16n8k16 .bf16), with g = lane / 4,
// c = lane % 4:
//   A (16 x 16, row-major): a0 = (g, 2c..2c+1), a1 = (g + 8, 2c..), a2 = (g, 2c + 8..),
//                           a3 = (g + 8, 2c + 8..)        (two bf16 per 32-bit register, low first)
//   B (16 x 8, k x n):      b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g)
//   C (16 x 8, F32):        c0, c1 = (g, 2c), (g, 2c + 1); c2, c3 = (g + 8, 2c), (g + 8, 2c + 1)
// So the C tiles of keys [16kk, 16kk + 8) and [16kk + 8, 16kk + 16) packed to bf16 are exactly the
// A fragment of k-step kk: P (and dS) go from the score accumulators straight into the next mma.
// Operands come from padded shared tiles by ldmatrix (.x4: one 16 x 16 A fragment, or the B
// fragments of two n-tiles); B operands stored [k][n] (V, dO, Q, K when they are the right-hand
// side along the token axis) by ldmatrix.trans. Shared rows are padded by 8 bf16 (16 bytes): a
// row stride of 4 mod 32 words makes each 8-row ldmatrix phase conflict-free.
// Tiles reach shared memory by cp.async (zero-filled past the valid rows/columns), double-
// buffered: the next key block (forward, dq) or query block (dk/dv) lands while the current one
// is used. Exponentials are exp2 with the scale folded into one FFMA (scores and lse in log2
// units inside the kernels; lse is written in natural-log units).
//
// Forward: one CTA per (64 queries, head) walks 64-key blocks from its first query's segment
// start to its last query; online softmax in F32 registers, P rounded to BF16 for P V.
// Backward (no atomics, each output row written once by one CTA, fixed order):
//   dk/dv: one CTA per (64 keys, head) walks 32-query blocks from its first key to the end of
//          its last key's segment: S^T = K Q^T, P^T = exp(scale S^T - lse), dV += P^T dO,
//          dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q (times scale at the end).
//   dq:    one CTA per (64 queries, head) walks the key blocks as the forward does:
//          dQ += dS K (times scale at the end).
// Masking is per (query t, key s): start(t) <= s <= t, so blocks may straddle segments. Rows
// past the valid range are zero-filled in shared memory and masked; head dims below the
// template's bucket are zero-filled columns.
//
// Blocks wholly inside the causal/segment range skip the per-element mask (a uniform branch).
//
// mma.sync, 4 warps per CTA, no warp specialization: the portable path. On Hopper the head dims
// 64/64, 128/128 and 192/128 run on flash_attention_*_sm90.cu instead (wgmma + TMA, several times
// faster; docs/PERF.md has both); this path keeps the other BF16 head dims, other GPUs, and
// MOETRAIN_ATTENTION=mma.
#include "kernels/cuda/attention/attention_sm80.h"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention/attention_segments.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/warp_mma_sm80.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
using namespace sm80;

constexpr int kWarps = 4;
constexpr int kTcThreads = 32 * kWarps;
constexpr int kWarpRows = 16;                     // one mma tile of rows per warp
constexpr int kBlockRows = kWarps * kWarpRows;    // queries per forward/dq CTA, keys per dk/dv CTA
constexpr int kKeyBlock = 64;                     // keys per step of the forward and dq passes
constexpr int kDkdvQueryBlock = 32;               // queries per step of the dk/dv pass
constexpr int kSmemPad = 8;                       // bf16 per shared row: 16 bytes
// Exponentials are exp2 (one FFMA + MUFU.EX2): scores and lse are carried in log2 units.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kKeyBlock % 16 == 0 && kDkdvQueryBlock % 16 == 0, "token blocks are whole mma k-steps");
static_assert(kBlockRows == 64, "the CTA's rows are 4 warps of 16");

struct TcShape {
  int tokens = 0;
  int heads = 0;
  int qk_dim = 0;
  int v_dim = 0;
  int num_segments = 0;
  float scale = 1.0f;
};

struct TcForwardParams {
  bf16* out = nullptr;
  float* lse = nullptr;
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  const int32_t* cu_seqlens = nullptr;
  TcShape shape;
};

struct TcBackwardParams {
  bf16* dq = nullptr;
  bf16* dk = nullptr;
  bf16* dv = nullptr;
  const bf16* dout = nullptr;
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  const float* lse = nullptr;
  const float* delta = nullptr;
  const int32_t* cu_seqlens = nullptr;
  TcShape shape;
};

// ---------------------------------------------------------------------------------------------
// Register-tile products (one warp; the primitives are warp_mma_sm80.cuh's)

// The A fragment of k-step kk of a 16-row accumulator array (two C tiles of 8 columns each).
template <int kTiles>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&c)[kTiles][4], int kk) {
  a[0] = pack_bf16x2(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16x2(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16x2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16x2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc[16 x 8 * kNTiles] += A (16 rows at a_row0 of a_st, k over kK) . B^T (b_st stored [n][k]).
template <int kK, int kNTiles>
__device__ __forceinline__ void mma_st_nk(float (&acc)[kNTiles][4], const bf16* a_st, int a_stride, int a_row0,
                                          const bf16* b_st, int b_stride, int lane) {
  static_assert(kNTiles % 2 == 0, "ldmatrix.x4 reads two n-tiles");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    load_a<ALayout::kMK>(a, a_st, a_stride, a_row0, kk * 16, lane);
#pragma unroll
    for (int j = 0; j < kNTiles / 2; ++j) {
      uint32_t b[4];
      load_b_x2<BLayout::kNK>(b, b_st, b_stride, j * 16, kk * 16, lane);
      mma_m16n8k16_bf16(acc[2 * j], a, b[0], b[1]);
      mma_m16n8k16_bf16(acc[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x 8 * kNTiles] += P (register accumulators, 16 x 16 * kKSteps, rounded to bf16)
//                          . B (b_st stored [k][n], rows = the k axis).
template <int kKSteps, int kNTiles>
__device__ __forceinline__ void mma_rt_kn(float (&acc)[kNTiles][4], const float (&p)[2 * kKSteps][4], const bf16* b_st,
                                          int b_stride, int lane) {
  static_assert(kNTiles % 2 == 0, "ldmatrix.x4 reads two n-tiles");
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t a[4];
    accumulators_to_a<2 * kKSteps>(a, p, kk);
#pragma unroll
    for (int j = 0; j < kNTiles / 2; ++j) {
      uint32_t b[4];
      load_b_x2<BLayout::kKN>(b, b_st, b_stride, j * 16, kk * 16, lane);
      mma_m16n8k16_bf16(acc[2 * j], a, b[0], b[1]);
      mma_m16n8k16_bf16(acc[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Global -> shared

// Issues the copy of rows [row0, row0 + rows) of head `head` of a BF16 [tokens, heads, dim]
// tensor into a shared tile [rows][kDim + kSmemPad], 16 bytes per thread per step (not yet
// committed). Rows at or past row_limit and columns at or past dim (dim % 8 == 0) become zeros.
template <int kDim>
__device__ __forceinline__ void load_rows_st(bf16* st, const bf16* src, int row0, int rows, int row_limit, int head,
                                             int heads, int dim) {
  constexpr int kChunks = kDim / 8;
  constexpr int kStride = kDim + kSmemPad;
  for (int i = threadIdx.x; i < rows * kChunks; i += kTcThreads) {
    const int r = i / kChunks, chunk = i - r * kChunks;
    const int t = row0 + r;
    const bool copy = t < row_limit && chunk * 8 < dim;
    // A zero-size copy reads nothing; its source is still a valid address.
    const bf16* from = copy ? src + (static_cast<int64_t>(t) * heads + head) * dim + chunk * 8 : src;
    cp_async_16(st + r * kStride + chunk * 8, from, copy);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward

template <int kQk, int kV>
struct ForwardSmem {
  static constexpr int kQkStride = kQk + kSmemPad;
  static constexpr int kVStride = kV + kSmemPad;
  static constexpr size_t kQElems = static_cast<size_t>(kBlockRows) * kQkStride;
  static constexpr size_t kKElems = static_cast<size_t>(kKeyBlock) * kQkStride;
  static constexpr size_t kVElems = static_cast<size_t>(kKeyBlock) * kVStride;
  // K and V double-buffered: the next key block lands while this one is used.
  static constexpr size_t kBytes = (kQElems + 2 * (kKElems + kVElems)) * sizeof(bf16) + kBlockRows * sizeof(int);
};

template <int kQk, int kV>
__global__ void __launch_bounds__(kTcThreads) attention_forward_sm80_bf16_kernel(TcForwardParams p) {
  static_assert(kQk % 16 == 0 && kV % 16 == 0 && kQk <= 256 && kV <= 256, "head dims are whole k-steps");
  using Smem = ForwardSmem<kQk, kV>;
  constexpr int kScoreTiles = kKeyBlock / 8;
  constexpr int kOutTiles = kV / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_st = reinterpret_cast<bf16*>(smem_raw);
  bf16* k_st = q_st + Smem::kQElems;     // [2] buffers
  bf16* v_st = k_st + 2 * Smem::kKElems;  // [2] buffers
  int* row_start_st = reinterpret_cast<int*>(v_st + 2 * Smem::kVElems);

  const TcShape& s = p.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_col = lane & 3;
  const int head = blockIdx.y;
  // Causal blocks further down see more keys: the grid starts them first (a shorter tail).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;
  const int row_end = min(m0 + kBlockRows, s.tokens);
  const int warp_row0 = warp * kWarpRows;
  const float scale_log2 = s.scale * kLog2e;

  // The first row's segment starts no later than any other row's (starts are monotone in t).
  const int kv_begin = segment_start(p.cu_seqlens, s.num_segments, m0);
  // A key block needs no mask when all 64 rows are valid, every key precedes every row, and the
  // block starts at or after the last row's segment start (the latest of the rows').
  const int last_row_start = segment_start(p.cu_seqlens, s.num_segments, row_end - 1);
  auto block_fully_visible = [&](int m0_, int n0_) {
    return m0_ + kBlockRows <= s.tokens && n0_ + kKeyBlock - 1 <= m0_ && n0_ >= last_row_start;
  };
  const int num_kv_blocks = (row_end - kv_begin + kKeyBlock - 1) / kKeyBlock;
  load_rows_st<kQk>(q_st, p.q, m0, kBlockRows, s.tokens, head, s.heads, s.qk_dim);
  load_rows_st<kQk>(k_st, p.k, kv_begin, kKeyBlock, row_end, head, s.heads, s.qk_dim);
  load_rows_st<kV>(v_st, p.v, kv_begin, kKeyBlock, row_end, head, s.heads, s.v_dim);
  cp_async_commit();
  for (int r = threadIdx.x; r < kBlockRows; r += kTcThreads) {
    const int t = m0 + r;
    row_start_st[r] = t < s.tokens ? segment_start(p.cu_seqlens, s.num_segments, t) : INT_MAX;
  }
  __syncthreads();

  // This thread's two rows: h = 0 -> row g, h = 1 -> row g + 8 of the warp's 16.
  int row_token[2], row_start[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row0 + (lane >> 2) + 8 * h;
    row_token[h] = m0 + r;
    row_start[h] = row_start_st[r];
  }
  float o[kOutTiles][4];
  zero_tiles(o);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this lane's partial sums; the quad adds them at the end

  for (int block = 0; block < num_kv_blocks; ++block) {
    const int n0 = kv_begin + block * kKeyBlock;
    const bf16* k_cur = k_st + (block & 1) * Smem::kKElems;
    const bf16* v_cur = v_st + (block & 1) * Smem::kVElems;
    if (block + 1 < num_kv_blocks) {
      // Into the other buffer, last read in the previous step (closed by its final barrier).
      load_rows_st<kQk>(k_st + ((block + 1) & 1) * Smem::kKElems, p.k, n0 + kKeyBlock, kKeyBlock, row_end, head,
                        s.heads, s.qk_dim);
      load_rows_st<kV>(v_st + ((block + 1) & 1) * Smem::kVElems, p.v, n0 + kKeyBlock, kKeyBlock, row_end, head,
                       s.heads, s.v_dim);
      cp_async_commit();
      cp_async_wait<1>();  // this block's group (and Q) landed; the next may still fly
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float score[kScoreTiles][4];
    zero_tiles(score);
    mma_st_nk<kQk, kScoreTiles>(score, q_st, Smem::kQkStride, warp_row0, k_cur, Smem::kQkStride, lane);

    float tile_max[2] = {-INFINITY, -INFINITY};
    auto mask_and_scale = [&](auto masked) {
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const int key = n0 + 8 * j + 2 * quad_col + (e & 1);
          const bool visible =
              !decltype(masked)::value || (row_token[h] < s.tokens && key <= row_token[h] && key >= row_start[h]);
          score[j][e] = visible ? score[j][e] * scale_log2 : -INFINITY;
          tile_max[h] = fmaxf(tile_max[h], score[j][e]);
        }
    };
    if (block_fully_visible(m0, n0)) {
      mask_and_scale(std::false_type{});
    } else {
      mask_and_scale(std::true_type{});
    }
    float base[2], correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float new_max = fmaxf(row_max[h], quad_max(tile_max[h]));
      // A row that has seen no visible key keeps max -inf; exponents are then taken against 0
      // so that exp(-inf - base) is 0, never exp(NaN).
      base[h] = new_max == -INFINITY ? 0.0f : new_max;
      correction[h] = exp2f(row_max[h] - base[h]);
      row_max[h] = new_max;
      row_sum[h] *= correction[h];
    }
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        score[j][e] = exp2f(score[j][e] - base[e >> 1]);
        row_sum[e >> 1] += score[j][e];
      }
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] *= correction[e >> 1];

    // o += P V; keys past the visible range have P = 0 and zero-filled V rows.
    mma_rt_kn<kKeyBlock / 16, kOutTiles>(o, score, v_cur, Smem::kVStride, lane);
    __syncthreads();  // every reader of this step's buffers is done before they are refilled
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(row_sum[h]);  // every lane of the quad runs this (shuffles)
    const int t = row_token[h];
    if (t >= s.tokens) continue;
    // Every row sees at least its own key, so sum >= 1 (the max term is exp(0)).
    const float inv_sum = 1.0f / sum;
    const int64_t out_row = (static_cast<int64_t>(t) * s.heads + head) * s.v_dim;
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      const int col = 8 * j + 2 * quad_col;
      if (col < s.v_dim) {
        *reinterpret_cast<uint32_t*>(p.out + out_row + col) =
            pack_bf16x2(o[j][2 * h] * inv_sum, o[j][2 * h + 1] * inv_sum);
      }
    }
    // lse in natural-log units with the scale included, as the SIMT kernel writes it.
    if (quad_col == 0) p.lse[static_cast<int64_t>(t) * s.heads + head] = row_max[h] * kLn2 + logf(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dq pass

template <int kQk, int kV>
struct DqSmem {
  static constexpr int kQkStride = kQk + kSmemPad;
  static constexpr int kVStride = kV + kSmemPad;
  static constexpr size_t kQElems = static_cast<size_t>(kBlockRows) * kQkStride;
  static constexpr size_t kDoutElems = static_cast<size_t>(kBlockRows) * kVStride;
  static constexpr size_t kKElems = static_cast<size_t>(kKeyBlock) * kQkStride;
  static constexpr size_t kVElems = static_cast<size_t>(kKeyBlock) * kVStride;
  static constexpr size_t kBytes =
      (kQElems + kDoutElems + 2 * (kKElems + kVElems)) * sizeof(bf16) + 3 * kBlockRows * sizeof(float);
};

template <int kQk, int kV>
__global__ void __launch_bounds__(kTcThreads) attention_backward_dq_sm80_bf16_kernel(TcBackwardParams p) {
  static_assert(kQk % 16 == 0 && kV % 16 == 0, "head dims are whole k-steps");
  using Smem = DqSmem<kQk, kV>;
  constexpr int kScoreTiles = kKeyBlock / 8;
  constexpr int kDqTiles = kQk / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_st = reinterpret_cast<bf16*>(smem_raw);
  bf16* dout_st = q_st + Smem::kQElems;
  bf16* k_st = dout_st + Smem::kDoutElems;  // [2] buffers
  bf16* v_st = k_st + 2 * Smem::kKElems;     // [2] buffers
  float* lse_st = reinterpret_cast<float*>(v_st + 2 * Smem::kVElems);
  float* delta_st = lse_st + kBlockRows;
  int* row_start_st = reinterpret_cast<int*>(delta_st + kBlockRows);

  const TcShape& s = p.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_col = lane & 3;
  const int head = blockIdx.y;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;  // the longest key walks first
  const int row_end = min(m0 + kBlockRows, s.tokens);
  const int warp_row0 = warp * kWarpRows;
  const float scale_log2 = s.scale * kLog2e;

  const int kv_begin = segment_start(p.cu_seqlens, s.num_segments, m0);
  // A key block needs no mask when all 64 rows are valid, every key precedes every row, and the
  // block starts at or after the last row's segment start (the latest of the rows').
  const int last_row_start = segment_start(p.cu_seqlens, s.num_segments, row_end - 1);
  auto block_fully_visible = [&](int m0_, int n0_) {
    return m0_ + kBlockRows <= s.tokens && n0_ + kKeyBlock - 1 <= m0_ && n0_ >= last_row_start;
  };
  const int num_kv_blocks = (row_end - kv_begin + kKeyBlock - 1) / kKeyBlock;
  load_rows_st<kQk>(q_st, p.q, m0, kBlockRows, s.tokens, head, s.heads, s.qk_dim);
  load_rows_st<kV>(dout_st, p.dout, m0, kBlockRows, s.tokens, head, s.heads, s.v_dim);
  load_rows_st<kQk>(k_st, p.k, kv_begin, kKeyBlock, row_end, head, s.heads, s.qk_dim);
  load_rows_st<kV>(v_st, p.v, kv_begin, kKeyBlock, row_end, head, s.heads, s.v_dim);
  cp_async_commit();
  for (int r = threadIdx.x; r < kBlockRows; r += kTcThreads) {
    const int t = m0 + r;
    const bool valid = t < s.tokens;
    const int64_t row = static_cast<int64_t>(t) * s.heads + head;
    lse_st[r] = valid ? p.lse[row] * kLog2e : 0.0f;  // log2 units
    delta_st[r] = valid ? p.delta[row] : 0.0f;
    row_start_st[r] = valid ? segment_start(p.cu_seqlens, s.num_segments, t) : INT_MAX;
  }
  __syncthreads();

  int row_token[2], row_start[2];
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row0 + (lane >> 2) + 8 * h;
    row_token[h] = m0 + r;
    row_start[h] = row_start_st[r];
    row_lse[h] = lse_st[r];
    row_delta[h] = delta_st[r];
  }
  float dq[kDqTiles][4];
  zero_tiles(dq);

  for (int block = 0; block < num_kv_blocks; ++block) {
    const int n0 = kv_begin + block * kKeyBlock;
    const bf16* k_cur = k_st + (block & 1) * Smem::kKElems;
    const bf16* v_cur = v_st + (block & 1) * Smem::kVElems;
    if (block + 1 < num_kv_blocks) {
      // Into the other buffer, last read in the previous step (closed by its final barrier).
      load_rows_st<kQk>(k_st + ((block + 1) & 1) * Smem::kKElems, p.k, n0 + kKeyBlock, kKeyBlock, row_end, head,
                        s.heads, s.qk_dim);
      load_rows_st<kV>(v_st + ((block + 1) & 1) * Smem::kVElems, p.v, n0 + kKeyBlock, kKeyBlock, row_end, head,
                       s.heads, s.v_dim);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float score[kScoreTiles][4];
    zero_tiles(score);
    mma_st_nk<kQk, kScoreTiles>(score, q_st, Smem::kQkStride, warp_row0, k_cur, Smem::kQkStride, lane);
    float dprob[kScoreTiles][4];
    zero_tiles(dprob);
    mma_st_nk<kV, kScoreTiles>(dprob, dout_st, Smem::kVStride, warp_row0, v_cur, Smem::kVStride, lane);

    // dS (without the scale) into `score`.
    auto dscore = [&](auto masked) {
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const int key = n0 + 8 * j + 2 * quad_col + (e & 1);
          const bool visible =
              !decltype(masked)::value || (row_token[h] < s.tokens && key <= row_token[h] && key >= row_start[h]);
          const float prob = visible ? exp2f(fmaf(score[j][e], scale_log2, -row_lse[h])) : 0.0f;
          score[j][e] = prob * (dprob[j][e] - row_delta[h]);
        }
    };
    if (block_fully_visible(m0, n0)) {
      dscore(std::false_type{});
    } else {
      dscore(std::true_type{});
    }

    // dq += dS K: K as the right-hand side along the key axis (stored [key][dim]).
    mma_rt_kn<kKeyBlock / 16, kDqTiles>(dq, score, k_cur, Smem::kQkStride, lane);
    __syncthreads();  // every reader of this step's buffers is done before they are refilled
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = row_token[h];
    if (t >= s.tokens) continue;
    const int64_t out_row = (static_cast<int64_t>(t) * s.heads + head) * s.qk_dim;
#pragma unroll
    for (int j = 0; j < kDqTiles; ++j) {
      const int col = 8 * j + 2 * quad_col;
      if (col < s.qk_dim) {
        *reinterpret_cast<uint32_t*>(p.dq + out_row + col) =
            pack_bf16x2(dq[j][2 * h] * s.scale, dq[j][2 * h + 1] * s.scale);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dk/dv pass

template <int kQk, int kV>
struct DkdvSmem {
  static constexpr int kQkStride = kQk + kSmemPad;
  static constexpr int kVStride = kV + kSmemPad;
  static constexpr size_t kKElems = static_cast<size_t>(kBlockRows) * kQkStride;
  static constexpr size_t kVElems = static_cast<size_t>(kBlockRows) * kVStride;
  static constexpr size_t kQElems = static_cast<size_t>(kDkdvQueryBlock) * kQkStride;
  static constexpr size_t kDoutElems = static_cast<size_t>(kDkdvQueryBlock) * kVStride;
  // The query side (Q, dO, lse, delta, row starts) double-buffered.
  static constexpr size_t kBytes =
      (kKElems + kVElems + 2 * (kQElems + kDoutElems)) * sizeof(bf16) + 2 * 3 * kDkdvQueryBlock * sizeof(float);
};

template <int kQk, int kV>
__global__ void __launch_bounds__(kTcThreads) attention_backward_dkdv_sm80_bf16_kernel(TcBackwardParams p) {
  static_assert(kQk % 16 == 0 && kV % 16 == 0, "head dims are whole k-steps");
  using Smem = DkdvSmem<kQk, kV>;
  constexpr int kQueryTiles = kDkdvQueryBlock / 8;
  constexpr int kDkTiles = kQk / 8;
  constexpr int kDvTiles = kV / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_st = reinterpret_cast<bf16*>(smem_raw);
  bf16* v_st = k_st + Smem::kKElems;
  bf16* q_st_buf = v_st + Smem::kVElems;                    // [2] buffers
  bf16* dout_st_buf = q_st_buf + 2 * Smem::kQElems;        // [2] buffers
  float* lse_st_buf = reinterpret_cast<float*>(dout_st_buf + 2 * Smem::kDoutElems);  // [2][kDkdvQueryBlock]
  float* delta_st_buf = lse_st_buf + 2 * kDkdvQueryBlock;   // [2][kDkdvQueryBlock]
  int* row_start_st_buf = reinterpret_cast<int*>(delta_st_buf + 2 * kDkdvQueryBlock);  // [2][kDkdvQueryBlock]

  const TcShape& s = p.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_col = lane & 3;
  const int head = blockIdx.y;
  const int n0 = blockIdx.x * kBlockRows;
  const int warp_key0 = warp * kWarpRows;
  const int last_key = min(n0 + kBlockRows, s.tokens) - 1;
  const float scale_log2 = s.scale * kLog2e;

  // Queries that see these keys: from the first key to the end of the last key's segment.
  const int query_end = segment_end(p.cu_seqlens, s.num_segments, last_key, s.tokens);
  const int num_query_blocks = (query_end - n0 + kDkdvQueryBlock - 1) / kDkdvQueryBlock;
  // Issues the query side of step `step` into buffer step & 1 (that buffer's previous readers
  // must be past a barrier): Q and dO asynchronously, lse / delta / row starts by plain stores.
  auto load_query_side = [&](int step) {
    const int m0 = n0 + step * kDkdvQueryBlock, buf = step & 1;
    load_rows_st<kQk>(q_st_buf + buf * Smem::kQElems, p.q, m0, kDkdvQueryBlock, query_end, head, s.heads, s.qk_dim);
    load_rows_st<kV>(dout_st_buf + buf * Smem::kDoutElems, p.dout, m0, kDkdvQueryBlock, query_end, head, s.heads,
                     s.v_dim);
    for (int r = threadIdx.x; r < kDkdvQueryBlock; r += kTcThreads) {
      const int t = m0 + r;
      const bool valid = t < query_end;
      const int64_t row = static_cast<int64_t>(t) * s.heads + head;
      lse_st_buf[buf * kDkdvQueryBlock + r] = valid ? p.lse[row] * kLog2e : 0.0f;  // log2 units
      delta_st_buf[buf * kDkdvQueryBlock + r] = valid ? p.delta[row] : 0.0f;
      row_start_st_buf[buf * kDkdvQueryBlock + r] = valid ? segment_start(p.cu_seqlens, s.num_segments, t) : INT_MAX;
    }
  };
  load_rows_st<kQk>(k_st, p.k, n0, kBlockRows, s.tokens, head, s.heads, s.qk_dim);
  load_rows_st<kV>(v_st, p.v, n0, kBlockRows, s.tokens, head, s.heads, s.v_dim);
  load_query_side(0);
  cp_async_commit();

  // This thread's two keys (rows of S^T): h = 0 -> row g, h = 1 -> row g + 8 of the warp's 16.
  int row_key[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) row_key[h] = n0 + warp_key0 + (lane >> 2) + 8 * h;
  float dk[kDkTiles][4], dv[kDvTiles][4];
  zero_tiles(dk);
  zero_tiles(dv);

  for (int step = 0; step < num_query_blocks; ++step) {
    const int m0 = n0 + step * kDkdvQueryBlock, buf = step & 1;
    const bf16* q_st = q_st_buf + buf * Smem::kQElems;
    const bf16* dout_st = dout_st_buf + buf * Smem::kDoutElems;
    const float* lse_st = lse_st_buf + buf * kDkdvQueryBlock;
    const float* delta_st = delta_st_buf + buf * kDkdvQueryBlock;
    const int* row_start_st = row_start_st_buf + buf * kDkdvQueryBlock;
    if (step + 1 < num_query_blocks) {
      load_query_side(step + 1);  // the other buffer: its readers finished before the last barrier
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // S^T = K Q^T (rows: this warp's keys; columns: the step's queries), then P^T in place.
    float prob_t[kQueryTiles][4];
    zero_tiles(prob_t);
    mma_st_nk<kQk, kQueryTiles>(prob_t, k_st, Smem::kQkStride, warp_key0, q_st, Smem::kQkStride, lane);
    auto probability = [&](auto masked) {
#pragma unroll
      for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 8 * j + 2 * quad_col + (e & 1);  // query row in the step
          const int t = m0 + r, key = row_key[e >> 1];
          const bool visible = !decltype(masked)::value || (t < query_end && key <= t && key >= row_start_st[r]);
          prob_t[j][e] = visible ? exp2f(fmaf(prob_t[j][e], scale_log2, -lse_st[r])) : 0.0f;
        }
    };
    // Every (query, key) pair of the step is visible when all queries are valid, follow every key
    // and their segments (the last query's starts latest) start at or before the first key.
    const bool step_fully_visible = m0 + kDkdvQueryBlock <= query_end && n0 + kBlockRows - 1 <= m0 &&
                                    n0 >= row_start_st[kDkdvQueryBlock - 1];
    if (step_fully_visible) {
      probability(std::false_type{});
    } else {
      probability(std::true_type{});
    }

    // dv += P^T dO: dO as the right-hand side along the query axis (stored [query][dim]).
    mma_rt_kn<kDkdvQueryBlock / 16, kDvTiles>(dv, prob_t, dout_st, Smem::kVStride, lane);

    // dP^T = V dO^T, then dS^T = P^T (dP^T - delta) (without the scale) in place.
    float dscore_t[kQueryTiles][4];
    zero_tiles(dscore_t);
    mma_st_nk<kV, kQueryTiles>(dscore_t, v_st, Smem::kVStride, warp_key0, dout_st, Smem::kVStride, lane);
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * j + 2 * quad_col + (e & 1);
        dscore_t[j][e] = prob_t[j][e] * (dscore_t[j][e] - delta_st[r]);
      }

    // dk += dS^T Q: Q as the right-hand side along the query axis (stored [query][dim]).
    mma_rt_kn<kDkdvQueryBlock / 16, kDkTiles>(dk, dscore_t, q_st, Smem::kQkStride, lane);
    __syncthreads();  // every reader of this step's buffers is done before they are refilled
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = row_key[h];
    if (key >= s.tokens) continue;
    const int64_t row = static_cast<int64_t>(key) * s.heads + head;
#pragma unroll
    for (int j = 0; j < kDkTiles; ++j) {
      const int col = 8 * j + 2 * quad_col;
      if (col < s.qk_dim) {
        *reinterpret_cast<uint32_t*>(p.dk + row * s.qk_dim + col) =
            pack_bf16x2(dk[j][2 * h] * s.scale, dk[j][2 * h + 1] * s.scale);
      }
    }
#pragma unroll
    for (int j = 0; j < kDvTiles; ++j) {
      const int col = 8 * j + 2 * quad_col;
      if (col < s.v_dim) {
        *reinterpret_cast<uint32_t*>(p.dv + row * s.v_dim + col) = pack_bf16x2(dv[j][2 * h], dv[j][2 * h + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: the switch, the dims bucket, launches

bool simt_forced_by_environment() {
  const char* value = std::getenv("MOETRAIN_ATTENTION");
  return value != nullptr && std::strcmp(value, "simt") == 0;
}

bool bf16_aligned(const TensorView& t) {
  return t.dtype == DType::kBF16 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

bool head_dims_fit(const TensorView& q, const TensorView& v, int max_qk, int max_v) {
  if (q.ndim() != 3 || v.ndim() != 3) return false;
  const int64_t qk_dim = q.size(2), v_dim = v.size(2);
  return qk_dim >= 16 && v_dim >= 16 && qk_dim % 16 == 0 && v_dim % 16 == 0 && qk_dim <= max_qk && v_dim <= max_v;
}

// The dims bucket (template head dims; smaller real dims are zero-padded columns): the first of
// (64, 64), (128, 128), (192, 128), (256, 256) that holds both.
template <typename F>
void dispatch_dims_bucket(int qk_dim, int v_dim, F&& f) {
  if (qk_dim <= 64 && v_dim <= 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else if (qk_dim <= 128 && v_dim <= 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  } else if (qk_dim <= 192 && v_dim <= 128) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
  }
}
// The backward has no (256, 256) bucket (registers): qk_dim <= 192 and v_dim <= 128.
template <typename F>
void dispatch_backward_dims_bucket(int qk_dim, int v_dim, F&& f) {
  if (qk_dim <= 64 && v_dim <= 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else if (qk_dim <= 128 && v_dim <= 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  }
}

TcShape shape_of(const TensorView& q, const TensorView& v, const TensorView& cu_seqlens, double scale) {
  TcShape s;
  s.tokens = static_cast<int>(q.size(0));
  s.heads = static_cast<int>(q.size(1));
  s.qk_dim = static_cast<int>(q.size(2));
  s.v_dim = static_cast<int>(v.size(2));
  s.num_segments = static_cast<int>(cu_seqlens.numel() - 1);
  s.scale = static_cast<float>(scale);
  return s;
}

template <typename Params>
void launch_tc(const char* op, void (*kernel)(Params), dim3 grid, size_t smem_bytes, cudaStream_t stream,
               const Params& params) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem_bytes > static_cast<size_t>(optin)) {
    throw Error(ExitCode::kInternal, std::string("cuda ") + op + ": needs " + std::to_string(smem_bytes) +
                                         " bytes of shared memory, the device allows " + std::to_string(optin));
  }
  if (smem_bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  }
  kernel<<<grid, kTcThreads, smem_bytes, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

unsigned tc_blocks_for(int tokens) { return static_cast<unsigned>((tokens + kBlockRows - 1) / kBlockRows); }

}  // namespace

bool attention_forward_sm80_supported(const AttentionArgs& args) {
  if (simt_forced_by_environment()) return false;
  for (const TensorView* t : {&args.q, &args.k, &args.v, &args.out}) {
    if (!bf16_aligned(*t)) return false;
  }
  return head_dims_fit(args.q, args.v, 256, 256);
}

bool attention_backward_sm80_supported(const AttentionBackwardArgs& args) {
  if (simt_forced_by_environment()) return false;
  for (const TensorView* t : {&args.q, &args.k, &args.v, &args.dout, &args.dq, &args.dk, &args.dv}) {
    if (!bf16_aligned(*t)) return false;
  }
  return head_dims_fit(args.q, args.v, 192, 128);
}

void attention_forward_sm80(const AttentionArgs& args, cudaStream_t stream) {
  TcForwardParams p;
  p.shape = shape_of(args.q, args.v, args.cu_seqlens, args.scale);
  p.out = static_cast<bf16*>(args.out.data);
  p.lse = static_cast<float*>(args.lse.data);
  p.q = static_cast<const bf16*>(args.q.data);
  p.k = static_cast<const bf16*>(args.k.data);
  p.v = static_cast<const bf16*>(args.v.data);
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  if (p.shape.tokens == 0) return;
  const dim3 grid(tc_blocks_for(p.shape.tokens), static_cast<unsigned>(p.shape.heads));
  dispatch_dims_bucket(p.shape.qk_dim, p.shape.v_dim, [&](auto qk, auto v) {
    constexpr int kQk = decltype(qk)::value, kV = decltype(v)::value;
    launch_tc("attention_forward", attention_forward_sm80_bf16_kernel<kQk, kV>, grid,
              ForwardSmem<kQk, kV>::kBytes, stream, p);
  });
}

void attention_backward_sm80(const AttentionBackwardArgs& args, const float* delta, cudaStream_t stream) {
  TcBackwardParams p;
  p.shape = shape_of(args.q, args.v, args.cu_seqlens, args.scale);
  p.dq = static_cast<bf16*>(args.dq.data);
  p.dk = static_cast<bf16*>(args.dk.data);
  p.dv = static_cast<bf16*>(args.dv.data);
  p.dout = static_cast<const bf16*>(args.dout.data);
  p.q = static_cast<const bf16*>(args.q.data);
  p.k = static_cast<const bf16*>(args.k.data);
  p.v = static_cast<const bf16*>(args.v.data);
  p.lse = static_cast<const float*>(args.lse.data);
  p.delta = delta;
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  if (p.shape.tokens == 0) return;
  const dim3 grid(tc_blocks_for(p.shape.tokens), static_cast<unsigned>(p.shape.heads));
  dispatch_backward_dims_bucket(p.shape.qk_dim, p.shape.v_dim, [&](auto qk, auto v) {
    constexpr int kQk = decltype(qk)::value, kV = decltype(v)::value;
    launch_tc("attention_backward", attention_backward_dkdv_sm80_bf16_kernel<kQk, kV>, grid,
              DkdvSmem<kQk, kV>::kBytes, stream, p);
    launch_tc("attention_backward", attention_backward_dq_sm80_bf16_kernel<kQk, kV>, grid,
              DqSmem<kQk, kV>::kBytes, stream, p);
  });
}

}  // namespace moetrain::kernels::cuda_ops
