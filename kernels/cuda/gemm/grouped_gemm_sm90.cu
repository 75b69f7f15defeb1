// The grouped GEMM's Hopper kernel (see grouped_gemm.h); the entry and the plain fallback are
// grouped_gemm.cu, the tile choice grouped_gemm_tiling.h.
//
// grouped_gemm_sm90_bf16_kernel<Layout, BN>: CTA tile 128 x BN over the output, K in steps of 64.
//   Threads: warpgroup 0 is the producer (one thread issues every TMA copy), warpgroups 1 and 2
//   the consumers, each owning 64 rows of the tile (wgmma m64nBNk16, accumulators in registers).
//   Shared memory: a ring of kStages stages, each an A tile (128 x 64) and a B tile (64 x BN),
//   with a 'full' mbarrier (TMA bytes landed) and an 'empty' one (both consumers done) per stage.
//   Operand layouts (PTX ISA canonical layouts; T = 8 bf16 = 16 bytes):
//     K-major tiles (a of m-grouped, b with transpose_b): rows of 64 k values = 128 bytes,
//       128-byte swizzle; 8-row groups 1024 bytes apart (stride byte offset); the k16 steps of a
//       stage start 32 bytes apart inside the swizzled rows.
//     M/N-major tiles (a and b of k-grouped, b without transpose_b): chunks of S/2 columns (S = 128
//       bytes, or 2 * BN when BN < 64) x 64 k rows, each row S bytes, S-byte swizzle; chunks
//       64 * S bytes apart (leading byte offset), 8-row groups 8 * S apart (stride byte offset);
//       the k16 steps start 16 * S bytes apart.
//   Scheduling (grouped_gemm_common_sm90.cuh): every CTA builds, from the device offsets, the clamped
//   row offsets and (m-grouped) a prefix of tiles per group in shared memory. The tiles are listed
//   by group, then n-tile, then m-tile, and handed out in that order through a counter in device
//   memory (the producer thread takes the next one when it starts a tile and passes it to the
//   consumers through a two-slot ring): the tiles in flight are always a contiguous run of the
//   list, so the m-tiles that share a slice of b[g] and the n-tiles that share rows of a run at the
//   same time and find them in L2, whatever the tiles cost. (Taking tiles blockIdx.x + i *
//   gridDim.x instead lets CTAs drift apart when groups are uneven, and the shared slices are
//   read from DRAM again.) The last CTA to finish puts the counter back to zero for the next
//   launch. A tile is (group, 128 rows, BN columns):
//     m-grouped: rows of the group's slice of a and c; its last tile may run past the group's
//       end: TMA reads the next group's rows (or zeros past the tensor) and those rows are
//       computed but never stored.
//     k-grouped: rows of c[g] (n_out) x columns (n_in), K = the group's rows; the last K step's
//       rows past the group's end are zeroed in shared memory before the wgmma, so another
//       group's rows never enter the sum. An empty group runs no K step: c[g] = beta * c[g].
//   m-grouped with a second product (a2, b2): its K steps follow those of a . op(b) in the same
//   tile, loaded through their own tensor maps into the same ring, so the LoRA term of a projection
//   costs a K step or two of the base GEMM's tile instead of a pass of its own over c.
//   A consumer warpgroup whose 64 rows all lie past the tile's end issues no wgmma (the half-empty
//   last tile of a group, or n_out <= 64 in k-grouped). The consumers keep one wgmma group in
//   flight: a stage is released when the next one's multiplications have been issued and the
//   earlier ones completed. The epilogue stores from registers; BF16 outputs (beta 0) first
//   regroup each quad's columns so that every lane stores 16 contiguous bytes.
// Rows as N (Layout::kMGroupedKMajorBRowsAsN and kMGroupedNMajorBRowsAsN, m-grouped with small
//   groups; grouped_gemm.h, GroupedGemmTiling): the same kernel computes c^T = op(b[g])^T . a^T.
//   The A tile is 128 of c's columns (64 per consumer warpgroup): b[g]'s rows, K-major, or for
//   the input gradient its columns, M-major in two chunks of 64. The B tile is up to
//   kRowsAsNTileRows of the group's rows, loaded in TMA boxes of 32 and multiplied with wgmma's
//   N = the rows rounded up to 16 (WgmmaSsPrefix; past 256, a second wgmma for the rest). A
//   group takes ceil(rows / kRowsAsNTileRows) tiles that split its rows evenly: 207 rows cost
//   208 rows of work, not 256, a group a little above the mean count is one tile, not a full one
//   and a sliver that streams b[g] again, and 1792 rows are 7 tiles of 256. N is chosen once
//   per tile (the K loop is compiled for each N). The tiles are listed by group, then 128-column
//   block, then row block.
//   A fragment row of the accumulators is a column of c: BF16 outputs (beta 0) leave through a
//   shared-memory buffer per warpgroup (store_rows_as_n_staged), the others as pairs from
//   registers (grouped::store_rows_as_n).
#include "kernels/cuda/gemm/grouped_gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"
#include "kernels/cuda/gemm/grouped_gemm_tiling.h"
#include "kernels/cuda/common/primitives_sm90.cuh"
#include "kernels/cuda/common/wgmma_bf16_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------------
// The sm_90a kernel

namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;
using grouped::GroupTable;
using grouped::kAllLanes;
using grouped::kBK;
using grouped::kConsumerRegisters;
using grouped::kProducerRegisters;
using grouped::kTileSlots;

constexpr int kBM = grouped::kTileM;  // two consumer warpgroups x 64 rows
using grouped::kRowsAsNTableBytes;
using grouped::kRowsAsNTileRows;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);

enum class Layout {
  kMGroupedKMajorB,  // m-grouped, b [groups, n, k] (transpose_b: the forward, x W^T)
  kMGroupedNMajorB,  // m-grouped, b [groups, k, n] (the input gradient, dy W)
  // The forward with the group's rows as wgmma's N (c^T = b . a^T): 128 of b[g]'s rows (c's
  // columns) are the A tile, a the B tile (up to kBN rows, in boxes of kRowBox).
  kMGroupedKMajorBRowsAsN,
  // The input gradient the same way (c^T = b^T . a^T): b[g]'s transpose, M-major, as the A tile.
  kMGroupedNMajorBRowsAsN,
  kKGrouped,  // k-grouped: a [rows, n_out] and b [rows, n_in], both M/N-major
};

// Rows-as-N tiles: rows of a per TMA box and the step of wgmma's N (kRowsAsNTileRows rows at
// most: grouped_gemm_tiling.h).
constexpr int kRowBox = 32;
constexpr int kRowStep = 16;
// Rows-as-N tiles: each consumer warpgroup's shared-memory buffer for its BF16 stores, kRowBox
// rows x its 64 columns (store_rows_as_n_staged).
constexpr int kEpilogueBytes = kRowBox * 64 * 2;

template <Layout kLayout, int kBN>
struct Tiling {
  static constexpr bool kKGrouped = kLayout == Layout::kKGrouped;
  static constexpr bool kRowsAsN =
      kLayout == Layout::kMGroupedKMajorBRowsAsN || kLayout == Layout::kMGroupedNMajorBRowsAsN;
  static constexpr bool kAMajorM = kKGrouped || kLayout == Layout::kMGroupedNMajorBRowsAsN;
  static constexpr bool kBMajorN = kKGrouped || kLayout == Layout::kMGroupedNMajorB;
  // Rows of the tile list's row tiles (m-grouped): kBM, or kBN with the rows as N.
  static constexpr int kTileRows = kRowsAsN ? kBN : kBM;
  // Row width in bytes (and swizzle) of the B tile: 128 for K-major; for N-major the chunk width.
  static constexpr int kBSwizzle = kBMajorN && kBN < 64 ? kBN * 2 : 128;
  static constexpr int kBChunkColumns = kBSwizzle / 2;  // N-major: columns per TMA box
  static constexpr int kBChunks = kBMajorN ? kBN / kBChunkColumns : 1;
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages =
      kRowsAsN ? std::min(grouped::kMaxStages, (grouped::kMaxDynamicSharedBytes - kConsumerWarpgroups * kEpilogueBytes -
                                                kRowsAsNTableBytes - 2048) /
                                                   kStageBytes)
               : grouped::stage_count(kStageBytes);
  static_assert(kRowsAsN || kBN == 16 || kBN == 32 || kBN == 64 || kBN == 128 || kBN == 256, "a wgmma N the kernel has");
  static_assert(kStages >= 3, "too few stages to overlap loads with the math");
  static_assert(kBChunks * kBChunkColumns == kBN || !kBMajorN, "an N-major B tile is whole chunks");
  static_assert(!kRowsAsN || (kBN % kRowBox == 0 && kBN >= 256 && kBN <= 256 + 64),
                "rows-as-N tiles: whole TMA boxes, two wgmmas at most (the second of N <= 64)");
  static_assert(!kRowsAsN || kStages * kStageBytes + kConsumerWarpgroups * kEpilogueBytes + kRowsAsNTableBytes +
                                     2048 <= grouped::kMaxDynamicSharedBytes,
                "the stages, the epilogue buffers and the largest group table fit a CTA's shared memory");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stages must start on a 1024-byte swizzle pattern");
};

struct Sm90Params {
  void* c;
  int c_f32;  // c is F32 (else BF16)
  const int32_t* offsets;
  int groups;
  int rows;
  int m_extent;  // k-grouped: n_out, the rows of each c[g]
  int n;         // columns of c
  int k;         // m-grouped: the inner dimension
  int k2;        // m-grouped: the second product's inner dimension (0: none)
  int m_tiles;   // k-grouped: tiles over n_out (m-grouped: per group, from the table)
  int n_tiles;
  float alpha;
  float beta;
  int* tile_counter;  // [2], zero between launches: the next tile, the CTAs done fetching
};

struct Tile {
  int group;
  // Output rows [m0, min(m0 + tile rows, m_end)): rows of c (m-grouped; 128, or with the rows as
  // N up to kBN, m_end then the tile's own end) or of c[group].
  int m0, m_end;
  int n0;  // the first of the tile's columns of c (kBN of them, or 128 with the rows as N)
  int k0, k_end;  // the K range: [0, k) (m-grouped) or the group's rows (k-grouped)
  int k_steps;
};

template <Layout kLayout, int kBN>
__device__ __forceinline__ Tile decode_tile(int t, const Sm90Params& p, GroupTable table) {
  Tile tile;
  if constexpr (kLayout == Layout::kKGrouped) {
    const int per_group = p.m_tiles * p.n_tiles;
    tile.group = t / per_group;
    const int local = t - tile.group * per_group;
    tile.m0 = local % p.m_tiles * kBM;
    tile.m_end = p.m_extent;
    tile.n0 = local / p.m_tiles * kBN;
    tile.k0 = table.rows[tile.group];
    tile.k_end = table.rows[tile.group + 1];
  } else {
    using T = Tiling<kLayout, kBN>;
    grouped::locate_m_grouped_tile<T::kTileRows, T::kRowsAsN ? kBM : kBN, T::kRowsAsN>(t, p.groups, table, tile);
    tile.k0 = 0;
    tile.k_end = p.k;
  }
  tile.k_steps = (tile.k_end - tile.k0 + kBK - 1) / kBK;
  if constexpr (kLayout != Layout::kKGrouped) tile.k_steps += (p.k2 + kBK - 1) / kBK;  // then a2 . op(b2)
  return tile;
}

// Rows-as-N tiles: the boxes of kRowBox rows that cover the tile's rows, and the wgmma steps of
// kRowStep that do (warp-uniform).
__device__ __forceinline__ int row_boxes(const Tile& tile, int tile_rows) {
  return (min(tile_rows, tile.m_end - tile.m0) + kRowBox - 1) / kRowBox;
}
__device__ __forceinline__ int row_steps(const Tile& tile, int tile_rows) {
  return (min(tile_rows, tile.m_end - tile.m0) + kRowStep - 1) / kRowStep;
}

// Calls step(std::integral_constant<int, kRowStep * steps>) for steps in [1, kMaxN / kRowStep].
template <int kN, int kMaxN, typename Step>
__device__ __forceinline__ void with_row_steps(int steps, Step&& step) {
  if constexpr (kN >= kMaxN) {
    step(std::integral_constant<int, kMaxN>{});
  } else if (steps * kRowStep <= kN) {
    step(std::integral_constant<int, kN>{});
  } else {
    with_row_steps<kN + kRowStep, kMaxN>(steps, step);
  }
}

// The producer thread's TMA copies of K step `k` (absolute index) of a tile into one stage: the
// wgmma A tile into a_tile, the B tile into b_tile (with the rows as N, A comes from b's map
// and B from a's). Boxes that start past the tensor's columns are not copied (they would only
// feed output columns, or k-grouped rows, that are never stored); the barrier expects the bytes
// of the rest.
template <Layout kLayout, int kBN>
__device__ __forceinline__ void load_stage(const CUtensorMap* map_a, const CUtensorMap* map_b, uint64_t* full,
                                           unsigned char* a_tile, unsigned char* b_tile, const Tile& tile, int k,
                                           const Sm90Params& p) {
  using T = Tiling<kLayout, kBN>;
  constexpr int kBChunkBytes = kBK * T::kBSwizzle;
  const int b_chunks = T::kBMajorN ? min(T::kBChunks, (p.n - tile.n0 + T::kBChunkColumns - 1) / T::kBChunkColumns)
                                   : 1;
  if constexpr (kLayout == Layout::kKGrouped) {
    const int a_chunks = min(2, (p.m_extent - tile.m0 + 63) / 64);
    sm90::barrier_arrive_expect_bytes(full, a_chunks * kBK * 128 + b_chunks * kBChunkBytes);
    for (int c = 0; c < a_chunks; ++c) sm90::tma_load_2d(a_tile + c * kBK * 128, map_a, full, tile.m0 + c * 64, k);
    for (int c = 0; c < b_chunks; ++c)
      sm90::tma_load_2d(b_tile + c * kBChunkBytes, map_b, full, tile.n0 + c * T::kBChunkColumns, k);
  } else if constexpr (T::kRowsAsN) {
    // 128 of b[g]'s rows (past n: zeros), or (input gradient) its 128 columns as two chunks of
    // 64 (those past n not copied); a: the tile's rows in boxes of kRowBox (past a's end: zeros).
    const int boxes = row_boxes(tile, kBN);
    const int a_chunks = T::kAMajorM ? min(2, (p.n - tile.n0 + 63) / 64) : 2;
    sm90::barrier_arrive_expect_bytes(full, a_chunks * kBK * 128 + boxes * kRowBox * kBK * 2);
    if constexpr (T::kAMajorM) {
      for (int c = 0; c < a_chunks; ++c)
        sm90::tma_load_3d(a_tile + c * kBK * 128, map_b, full, tile.n0 + c * 64, k, tile.group);
    } else {
      sm90::tma_load_3d(a_tile, map_b, full, k, tile.n0, tile.group);
    }
    for (int i = 0; i < boxes; ++i)
      sm90::tma_load_2d(b_tile + i * kRowBox * kBK * 2, map_a, full, k, tile.m0 + i * kRowBox);
  } else if constexpr (kLayout == Layout::kMGroupedKMajorB) {
    sm90::barrier_arrive_expect_bytes(full, T::kStageBytes);
    sm90::tma_load_2d(a_tile, map_a, full, k, tile.m0);
    sm90::tma_load_3d(b_tile, map_b, full, k, tile.n0, tile.group);
  } else {
    sm90::barrier_arrive_expect_bytes(full, T::kABytes + b_chunks * kBChunkBytes);
    sm90::tma_load_2d(a_tile, map_a, full, k, tile.m0);
    for (int c = 0; c < b_chunks; ++c)
      sm90::tma_load_3d(b_tile + c * kBChunkBytes, map_b, full, tile.n0 + c * T::kBChunkColumns, k, tile.group);
  }
}

// k-grouped, last K step: zeroes the stage's rows [valid, 64) of A and B (whole swizzled rows,
// so the swizzle does not matter). All 256 consumer threads share the work.
template <Layout kLayout, int kBN>
__device__ __forceinline__ void zero_rows_past_group(unsigned char* a_tile, unsigned char* b_tile, int valid,
                                                     int consumer_thread) {
  using T = Tiling<kLayout, kBN>;
  const int rows = kBK - valid;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int a_words = 2 * rows * 8;  // two 64-column chunks, 8 x 16 bytes per row
  for (int i = consumer_thread; i < a_words; i += 128 * kConsumerWarpgroups) {
    const int chunk = i / (rows * 8), rest = i % (rows * 8);
    *reinterpret_cast<uint4*>(a_tile + chunk * kBK * 128 + (valid + rest / 8) * 128 + rest % 8 * 16) = zero;
  }
  constexpr int kWordsPerRow = T::kBSwizzle / 16;
  const int b_words = T::kBChunks * rows * kWordsPerRow;
  for (int i = consumer_thread; i < b_words; i += 128 * kConsumerWarpgroups) {
    const int chunk = i / (rows * kWordsPerRow), rest = i % (rows * kWordsPerRow);
    *reinterpret_cast<uint4*>(b_tile + chunk * kBK * T::kBSwizzle + (valid + rest / kWordsPerRow) * T::kBSwizzle +
                              rest % kWordsPerRow * 16) = zero;
  }
}

// One consumer warpgroup's 64 x kBN accumulators into c: rows past m_end and columns past n are
// not stored (n is a multiple of 8, so a column pair is all in or all out).
// Accumulator layout (wgmma m64nN, F32): acc[4j + 2h + e] is row 16 * warp + lane / 4 + 8h,
// column 8j + 2 (lane % 4) + e of the warpgroup's 64 x N block.
// BF16 output with beta 0, kBN >= 32: as store_tile, but the four lanes of a quad (one row, columns
// 2q and 2q + 1 of every 8-column chunk) swap their packed pairs in two butterfly steps (lanes
// q ^ 2, then q ^ 1) until lane q holds all 8 columns of chunk 4J + q: one 16-byte store where
// store_tile makes four 4-byte ones, and a warp's store fills 64 contiguous bytes of each of its
// 8 rows (whole 32-byte sectors) instead of 16. On an H200 at the MoE expert shapes this made the
// kernel 1.02-1.17x faster (the consumers store while the tensor cores wait for the next tile).
template <int kBN>
__device__ __forceinline__ void store_tile_bf16_quads(const float (&acc)[kBN / 2], const Sm90Params& p,
                                                      const Tile& tile, int64_t c_offset, int row_in_tile, int lane) {
  static_assert(kBN % 32 == 0, "whole groups of four 8-column chunks");
  const int q = lane % 4;
  const bool q1 = (q & 2) != 0, q0 = (q & 1) != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.m0 + row_in_tile + 8 * h;
    bf16* out = static_cast<bf16*>(p.c) + c_offset + static_cast<int64_t>(row) * p.n;
#pragma unroll
    for (int group = 0; group < kBN / 32; ++group) {
      uint32_t w[4];  // w[i]: this lane's two columns of chunk 4 group + i
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * group + i;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(p.alpha * acc[4 * j + 2 * h], p.alpha * acc[4 * j + 2 * h + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      // Step 1 (lane q ^ 2): keep the chunks whose bit 1 is q's, send the others.
      const uint32_t keep0 = q1 ? w[2] : w[0], keep1 = q1 ? w[3] : w[1];
      const uint32_t got0 = __shfl_xor_sync(kAllLanes, q1 ? w[0] : w[2], 2);
      const uint32_t got1 = __shfl_xor_sync(kAllLanes, q1 ? w[1] : w[3], 2);
      // Step 2 (lane q ^ 1): keep chunk q's pairs, send chunk q ^ 1's.
      const uint32_t own = q0 ? keep1 : keep0;                              // from lane q
      const uint32_t across = q0 ? got1 : got0;                             // from lane q ^ 2
      const uint32_t near = __shfl_xor_sync(kAllLanes, q0 ? keep0 : keep1, 1);  // from lane q ^ 1
      const uint32_t far = __shfl_xor_sync(kAllLanes, q0 ? got0 : got1, 1);     // from lane q ^ 3
      // The pair of lane r (columns 2r, 2r + 1): r == q, q ^ 2, q ^ 1 or q ^ 3.
      auto pair_of = [&](int r) {
        const bool same1 = ((r & 2) != 0) == q1, same0 = ((r & 1) != 0) == q0;
        return same0 ? (same1 ? own : across) : (same1 ? near : far);
      };
      // Every lane takes part in the shuffles; only the stores are masked (n is a multiple of 8).
      const int column = tile.n0 + 8 * (4 * group + q);
      if (row < tile.m_end && column < p.n)
        *reinterpret_cast<uint4*>(out + column) = make_uint4(pair_of(0), pair_of(1), pair_of(2), pair_of(3));
    }
  }
}

// Rows-as-N tiles, BF16 c with beta 0: a consumer warpgroup's 64 columns x n_rows rows (a
// multiple of kRowBox) leave through its `buffer` (kRowBox rows of 128 bytes), kRowBox rows at a
// time. stmatrix.trans writes, per accumulator block (j, h), the 8 columns of 8 rows that the
// fragment holds transposed (grouped::store_rows_as_n has the layout) as one 16-byte chunk per
// row: chunk q (columns 8q .. 8q + 7 of the 64) of buffer row r sits at slot q ^ (r % 8), so
// neither the 8 rows of a matrix nor a warp's reads of 4 whole rows meet a bank conflict. Then
// every thread stores two 16-byte chunks: a warp writes 4 rows x 128 contiguous bytes of c,
// where stores from the registers write 8 rows x 16 bytes in 4-byte pieces (with those, rows as
// N ran 10-25% behind rows as M at the MoE expert shapes on an H200).
template <int kTileRows>
__device__ __forceinline__ void store_rows_as_n_staged(const float (&acc)[kTileRows / 2], const Sm90Params& p,
                                                       const Tile& tile, int n_rows, int warpgroup, int warp_in_group,
                                                       int lane, unsigned char* buffer) {
  const uint32_t base = sm90::smem_address(buffer);
  const int thread = warp_in_group * 32 + lane;
  const int matrix = lane / 8, matrix_row = lane % 8;  // whose address this lane gives
  auto slot = [](int row, int q) { return row * 128 + ((q ^ (row % 8)) << 4); };
#pragma unroll
  for (int box = 0; box < kTileRows / kRowBox; ++box) {
    if (box * kRowBox >= n_rows) break;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {  // accumulator blocks j = 4 box + 2 pair + i / 2, h = i % 2
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * box + 2 * pair + i / 2, h = i % 2;
        const __nv_bfloat162 v = __floats2bfloat162_rn(p.alpha * acc[4 * j + 2 * h], p.alpha * acc[4 * j + 2 * h + 1]);
        r[i] = *reinterpret_cast<const uint32_t*>(&v);
      }
      const int row = 8 * (2 * pair + matrix / 2) + matrix_row;
      sm90::stmatrix_x4_trans(base + slot(row, 2 * warp_in_group + matrix % 2), r[0], r[1], r[2], r[3]);
    }
    sm90::named_barrier_sync(2 + warpgroup, 128);  // the box is in the buffer
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int chunk = thread + 128 * e, row = chunk / 8, q = chunk % 8;
      const uint4 v = *reinterpret_cast<const uint4*>(buffer + slot(row, q));
      const int out_row = tile.m0 + box * kRowBox + row, column = tile.n0 + warpgroup * 64 + 8 * q;
      if (out_row < tile.m_end && column < p.n)
        *reinterpret_cast<uint4*>(static_cast<bf16*>(p.c) + static_cast<int64_t>(out_row) * p.n + column) = v;
    }
    sm90::named_barrier_sync(2 + warpgroup, 128);  // the buffer is free again
  }
}

template <typename OutT, int kBN>
__device__ __forceinline__ void store_tile(const float (&acc)[kBN / 2], const Sm90Params& p, const Tile& tile,
                                           int64_t c_offset, int row_in_tile, int column_in_tile) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.m0 + row_in_tile + 8 * h;
    if (row >= tile.m_end) continue;
    OutT* out = static_cast<OutT*>(p.c) + c_offset + static_cast<int64_t>(row) * p.n;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      const int column = tile.n0 + column_in_tile + 8 * j;
      if (column >= p.n) continue;
      grouped::store_pair(out + column, p.alpha * acc[4 * j + 2 * h], p.alpha * acc[4 * j + 2 * h + 1], p.beta);
    }
  }
}

// Rows-as-N tiles, one K step of a warpgroup: acc (64 x kN) += A (its 64 of c's columns: K-major
// rows of 128 bytes, or kAMajorM, the input gradient's b^T: its own M-major chunk of 64 columns)
// . B (the rows, K-major). Past 256 rows a second wgmma takes rows 256.. into acc[128 ..]: an
// accumulator's fragment for columns 256 + j is the one an N > 256 would have.
template <int kN, bool kAMajorM, int kRegisters>
__device__ __forceinline__ void k_step_rows_as_n(float (&acc)[kRegisters], uint32_t a_address, uint32_t b_address) {
  constexpr int kFirstN = kN < 256 ? kN : 256;
  constexpr uint32_t kAStepBytes = kAMajorM ? 16 * 128 : 32;
  constexpr uint32_t kALeading = kAMajorM ? kBK * 128 : 16;
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t desc_a =
        sm90::matrix_descriptor(a_address + kk * kAStepBytes, kALeading, 1024, sm90::swizzle_code(128));
    const uint64_t desc_b = sm90::matrix_descriptor(b_address + kk * 32, 16, 1024, sm90::swizzle_code(128));
    sm90::WgmmaSsPrefix<kFirstN>::template mma<kAMajorM ? 1 : 0>(acc, desc_a, desc_b);
    if constexpr (kN > 256) {
      const uint64_t desc_rest =
          sm90::matrix_descriptor(b_address + 256 * 128 + kk * 32, 16, 1024, sm90::swizzle_code(128));
      auto& rest = reinterpret_cast<float(&)[kRegisters - 128]>(acc[128]);
      sm90::WgmmaSsPrefix<kN - 256>::template mma<kAMajorM ? 1 : 0>(rest, desc_a, desc_rest);
    }
  }
}

template <Layout kLayout, int kBN>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_bf16_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const __grid_constant__ CUtensorMap map_a2, const __grid_constant__ CUtensorMap map_b2,
                             const Sm90Params p) {
  using T = Tiling<kLayout, kBN>;
  extern __shared__ __align__(1024) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + T::kStages;
  uint64_t* tile_full = empty + T::kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_slot = reinterpret_cast<int*>(tile_empty + kTileSlots);
  GroupTable table{tile_slot + kTileSlots, nullptr};
  table.tiles = table.rows + p.groups + 1;
  const uintptr_t table_end = reinterpret_cast<uintptr_t>(table.tiles + p.groups + 1);
  unsigned char* a_stages = reinterpret_cast<unsigned char*>((table_end + 1023) & ~uintptr_t{1023});
  unsigned char* b_stages = a_stages + T::kStages * T::kABytes;
  unsigned char* epilogue_buffers = b_stages + T::kStages * T::kBBytes;  // rows as N: one per consumer warpgroup

  // Broadcasts make the warp index and (below) the tile index warp-uniform in the compiler's eyes
  // too: without them ptxas serializes every wgmma (C7520, "divergent path").
  const int warp = __shfl_sync(kAllLanes, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      sm90::barrier_init(&full[s], 1);
      sm90::barrier_init(&empty[s], kConsumerWarpgroups * 4);  // lane 0 of every consumer warp
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::barrier_init(&tile_full[s], 1);
      sm90::barrier_init(&tile_empty[s], kConsumerWarpgroups * 4);
    }
    sm90::fence_barrier_init();
  }
  if (warp == 1) grouped::build_group_table<T::kTileRows, !T::kKGrouped>(p, table, lane);
  __syncthreads();
  const int total_tiles = T::kKGrouped ? p.groups * p.m_tiles * p.n_tiles : table.tiles[p.groups];

  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_b);
    if (p.k2 > 0) {
      sm90::tma_prefetch_descriptor(&map_a2);
      sm90::tma_prefetch_descriptor(&map_b2);
    }
    int stage = 0;
    uint32_t phase = 0;
    int slot = 0;
    uint32_t slot_phase = 0;
    for (;;) {
      sm90::barrier_wait(&tile_empty[slot], slot_phase ^ 1);
      const int t = atomicAdd(p.tile_counter, 1);
      tile_slot[slot] = t;
      sm90::barrier_arrive(&tile_full[slot]);
      if (++slot == kTileSlots) {
        slot = 0;
        slot_phase ^= 1;
      }
      if (t >= total_tiles) break;
      const Tile tile = decode_tile<kLayout, kBN>(t, p, table);
      const int first_steps = (tile.k_end - tile.k0 + kBK - 1) / kBK;  // of a . op(b); the rest a2 . op(b2)
      for (int s = 0; s < tile.k_steps; ++s) {
        sm90::barrier_wait(&empty[stage], phase ^ 1);
        const bool second = s >= first_steps;
        load_stage<kLayout, kBN>(second ? &map_a2 : &map_a, second ? &map_b2 : &map_b, &full[stage],
                                 a_stages + stage * T::kABytes, b_stages + stage * T::kBBytes, tile,
                                 tile.k0 + (second ? s - first_steps : s) * kBK, p);
        if (++stage == T::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    grouped::release_tile_counter(p.tile_counter);
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;  // 0 or 1: rows [64 w, 64 w + 64) of the tile
  const int consumer_thread = threadIdx.x - 128;
  // A: K-major rows of 128 bytes, or (k-grouped) the warpgroup's own 64-column chunk; either way
  // the warpgroup's part starts 64 x 128 bytes in.
  constexpr uint32_t kAStepBytes = T::kAMajorM ? 16 * 128 : 32;
  constexpr uint32_t kBStepBytes = T::kBMajorN ? 16 * T::kBSwizzle : 32;
  constexpr uint32_t kBLeading = T::kBMajorN ? kBK * T::kBSwizzle : 16;
  constexpr uint32_t kBStride = 8 * T::kBSwizzle;
  constexpr uint32_t kALeading = T::kAMajorM ? kBK * 128 : 16;
  int stage = 0;
  uint32_t phase = 0;
  float acc[kBN / 2];
  int slot = 0;
  uint32_t slot_phase = 0;
  for (;;) {
    sm90::barrier_wait(&tile_full[slot], slot_phase);
    const int t = __shfl_sync(kAllLanes, tile_slot[slot], 0);
    __syncwarp();
    if (lane == 0) sm90::barrier_arrive(&tile_empty[slot]);
    if (++slot == kTileSlots) {
      slot = 0;
      slot_phase ^= 1;
    }
    if (t >= total_tiles) break;
    const Tile tile = decode_tile<kLayout, kBN>(t, p, table);
    // A warpgroup whose 64 rows all lie past the group's end (or n_out), or with the rows as N
    // whose 64 columns all lie past n, multiplies nothing.
    const bool active = T::kRowsAsN ? tile.n0 + warpgroup * 64 < p.n : tile.m0 + warpgroup * 64 < tile.m_end;
    const int boxes = T::kRowsAsN ? row_boxes(tile, kBN) : 0;
    const int steps = T::kRowsAsN ? row_steps(tile, kBN) : 0;
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;
    int previous_stage = 0;
    // The tile's K steps; multiply(a_address, b_address) issues one step's wgmmas. The last
    // step's wgmmas complete inside: with the rows as N each N has its own copy of this loop, and
    // where the copies meet the compiler may move accumulator registers; a move while a wgmma on
    // them is in flight makes ptxas serialize every wgmma of the kernel (C7515).
    auto run_k_steps = [&](auto&& multiply) {
      for (int s = 0; s < tile.k_steps; ++s) {
        sm90::barrier_wait(&full[stage], phase);
        unsigned char* a_tile = a_stages + stage * T::kABytes;
        unsigned char* b_tile = b_stages + stage * T::kBBytes;
        if constexpr (T::kKGrouped) {
          const int valid = tile.k_end - (tile.k0 + s * kBK);
          if (valid < kBK) {
            zero_rows_past_group<kLayout, kBN>(a_tile, b_tile, valid, consumer_thread);
            sm90::fence_proxy_async_shared();
            sm90::named_barrier_sync(1, 128 * kConsumerWarpgroups);
          }
        }
        sm90::fence_registers(acc);
        sm90::wgmma_fence();
        multiply(sm90::smem_address(a_tile) + warpgroup * 64 * 128, sm90::smem_address(b_tile));
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();  // the previous step's wgmmas are done: its stage can be refilled
        sm90::fence_registers(acc);
        if (s > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
        previous_stage = stage;
        if (++stage == T::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      sm90::wgmma_wait<0>();
      sm90::fence_registers(acc);
    };
    if constexpr (T::kRowsAsN) {
      // wgmma's N is a template argument: chosen once per tile, with the K loop compiled for each.
      if (active) {
        with_row_steps<kRowStep, kBN>(steps, [&](auto n) {
          run_k_steps([&](uint32_t a_address, uint32_t b_address) {
            k_step_rows_as_n<decltype(n)::value, T::kAMajorM>(acc, a_address, b_address);
          });
        });
      } else {
        run_k_steps([](uint32_t, uint32_t) {});
      }
    } else {
      run_k_steps([&](uint32_t a_address, uint32_t b_address) {
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          if (!active) break;
          const uint64_t desc_a =
              sm90::matrix_descriptor(a_address + kk * kAStepBytes, kALeading, 1024, sm90::swizzle_code(128));
          const uint64_t desc_b = sm90::matrix_descriptor(b_address + kk * kBStepBytes, kBLeading, kBStride,
                                                          sm90::swizzle_code(T::kBSwizzle));
          sm90::Wgmma<kBN>::template mma<T::kAMajorM ? 1 : 0, T::kBMajorN ? 1 : 0>(acc, desc_a, desc_b, 1);
        }
      });
    }
    if (tile.k_steps > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);

    const int row_in_tile = warpgroup * 64 + warp % 4 * 16 + lane / 4;
    if constexpr (T::kRowsAsN) {  // the fragment rows are c's columns
      if (p.c_f32) {
        grouped::store_rows_as_n<float, kBN>(acc, p, tile, boxes * kRowBox, tile.n0 + row_in_tile, lane);
      } else if (p.beta == 0.0f) {
        if (active)
          store_rows_as_n_staged<kBN>(acc, p, tile, boxes * kRowBox, warpgroup, warp % 4, lane,
                                 epilogue_buffers + warpgroup * kEpilogueBytes);
      } else {
        grouped::store_rows_as_n<bf16, kBN>(acc, p, tile, boxes * kRowBox, tile.n0 + row_in_tile, lane);  // reads c
      }
      continue;
    }
    const int column_in_tile = 2 * (lane % 4);
    const int64_t c_offset = T::kKGrouped ? static_cast<int64_t>(tile.group) * p.m_extent * p.n : 0;
    if (p.c_f32) {
      store_tile<float, kBN>(acc, p, tile, c_offset, row_in_tile, column_in_tile);
    } else {
      if constexpr (kBN >= 32) {
        if (p.beta == 0.0f) {
          store_tile_bf16_quads<kBN>(acc, p, tile, c_offset, row_in_tile, lane);
        } else {
          store_tile<bf16, kBN>(acc, p, tile, c_offset, row_in_tile, column_in_tile);  // reads c: one rounding
        }
      } else {
        store_tile<bf16, kBN>(acc, p, tile, c_offset, row_in_tile, column_in_tile);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

CUtensorMapSwizzle tma_swizzle(int bytes) {
  return bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;
}

// A BF16 tensor map; dims innermost first, strides in bytes of dims 1.., box in elements.
CUtensorMap tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                       int swizzle_bytes) {
  return grouped::encode_map("grouped_gemm", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, base, dims, strides, box,
                             tma_swizzle(swizzle_bytes));
}

template <Layout kLayout, int kBN>
void launch_sm90(const GroupedGemmProblem& p, cudaStream_t stream) {
  using T = Tiling<kLayout, kBN>;
  const bool k_grouped = kLayout == Layout::kKGrouped;
  Sm90Params params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.offsets = p.group_offsets;
  params.groups = static_cast<int>(p.groups);
  params.rows = static_cast<int>(p.rows);
  params.alpha = p.alpha;
  params.beta = p.beta;
  params.tile_counter = grouped::tile_counters(stream);
  CUtensorMap map_a{}, map_b{}, map_a2{}, map_b2{};  // a2 / b2: only with a second product
  const uint64_t rows = static_cast<uint64_t>(p.rows), groups = static_cast<uint64_t>(p.groups);
  int64_t max_tiles = 0;
  if (k_grouped) {
    params.m_extent = static_cast<int>(p.n_out);
    params.n = static_cast<int>(p.n_in);
    params.m_tiles = static_cast<int>((p.n_out + kBM - 1) / kBM);
    params.n_tiles = static_cast<int>((p.n_in + kBN - 1) / kBN);
    const uint64_t a_dims[2] = {static_cast<uint64_t>(p.n_out), rows}, a_strides[1] = {a_dims[0] * 2};
    const uint32_t a_box[2] = {64, kBK};
    map_a = tensor_map(p.a, 2, a_dims, a_strides, a_box, 128);
    const uint64_t b_dims[2] = {static_cast<uint64_t>(p.n_in), rows}, b_strides[1] = {b_dims[0] * 2};
    const uint32_t b_box[2] = {T::kBChunkColumns, kBK};
    map_b = tensor_map(p.b, 2, b_dims, b_strides, b_box, T::kBSwizzle);
    max_tiles = p.groups * params.m_tiles * params.n_tiles;
  } else {
    params.n = static_cast<int>(p.n);
    params.k = static_cast<int>(p.k);
    // Columns of c per tile: kBN, or with the rows as N the 128 rows of wgmma's M.
    const int tile_columns = T::kRowsAsN ? kBM : kBN;
    params.n_tiles = static_cast<int>((p.n + tile_columns - 1) / tile_columns);
    const uint64_t n = static_cast<uint64_t>(p.n);
    // a's boxes: the tile's rows (kBM), or with the rows as N boxes of kRowBox; b's: a K-major
    // tile of tile_columns rows, or N-major chunks of kBChunkColumns.
    const uint32_t a_box[2] = {kBK, static_cast<uint32_t>(T::kRowsAsN ? kRowBox : kBM)};
    const bool k_major_b = kLayout == Layout::kMGroupedKMajorB || kLayout == Layout::kMGroupedKMajorBRowsAsN;
    const uint32_t b_box_k_major[3] = {kBK, static_cast<uint32_t>(tile_columns), 1};
    const uint32_t b_box_n_major[3] = {static_cast<uint32_t>(T::kBChunkColumns), kBK, 1};
    // A product's maps: a_x [rows, inner] and b_x [groups, n, inner] or [groups, inner, n]. (The
    // second product's K steps past k2 read zeros.)
    auto maps = [&](const void* a_x, const void* b_x, int64_t inner, CUtensorMap& a_map, CUtensorMap& b_map) {
      const uint64_t k = static_cast<uint64_t>(inner);
      const uint64_t a_dims[2] = {k, rows}, a_strides[1] = {k * 2};
      a_map = tensor_map(a_x, 2, a_dims, a_strides, a_box, 128);
      if (k_major_b) {
        const uint64_t b_dims[3] = {k, n, groups}, b_strides[2] = {k * 2, n * k * 2};
        b_map = tensor_map(b_x, 3, b_dims, b_strides, b_box_k_major, 128);
      } else {
        const uint64_t b_dims[3] = {n, k, groups}, b_strides[2] = {n * 2, k * n * 2};
        b_map = tensor_map(b_x, 3, b_dims, b_strides, b_box_n_major, T::kBSwizzle);
      }
    };
    maps(p.a, p.b, p.k, map_a, map_b);
    params.k2 = static_cast<int>(p.k2);
    if (p.k2 > 0) maps(p.a2, p.b2, p.k2, map_a2, map_b2);
    // Each group adds at most one partial row tile.
    max_tiles = ((p.rows + T::kTileRows - 1) / T::kTileRows + p.groups) * params.n_tiles;
  }
  // Barriers per stage: full and empty.
  const size_t shared_bytes = grouped::shared_bytes(2, T::kStages, T::kStageBytes, p.groups) +
                              (T::kRowsAsN ? kConsumerWarpgroups * kEpilogueBytes : 0);
  grouped::allow_shared_memory<grouped_gemm_sm90_bf16_kernel<kLayout, kBN>>();
  grouped_gemm_sm90_bf16_kernel<kLayout, kBN><<<grouped::persistent_grid(max_tiles), kThreads, shared_bytes, stream>>>(
      map_a, map_b, map_a2, map_b2, params);
  CUDA_CHECK_LAUNCH();
}

template <Layout kLayout>
void launch_sm90_bn(const GroupedGemmProblem& p, int bn, cudaStream_t stream) {
  switch (bn) {
    case 16: launch_sm90<kLayout, 16>(p, stream); break;
    case 32: launch_sm90<kLayout, 32>(p, stream); break;
    case 64: launch_sm90<kLayout, 64>(p, stream); break;
    case 128: launch_sm90<kLayout, 128>(p, stream); break;
    default: launch_sm90<kLayout, 256>(p, stream); break;
  }
}

}  // namespace

GroupedGemmPath grouped_gemm_path(const GroupedGemmProblem& p) {
  const bool m_grouped = p.kind == GroupedGemmKind::kMGrouped;
  // TMA: 16-byte aligned bases and row strides; int32 coordinates and tile counts.
  const bool shapes = m_grouped ? p.k > 0 && p.k % 8 == 0 && p.n % 8 == 0 && p.k2 % 8 == 0
                                : p.rows > 0 && p.n_out % 8 == 0 && p.n_in % 8 == 0;
  const int64_t widest = std::max({p.rows, p.n, p.k + p.k2, p.n_out, p.n_in});
  const bool fits = widest < (int64_t{1} << 30) && grouped::group_table_fits(p.groups) &&
                    p.groups * ((p.n_out + kBM - 1) / kBM) * ((p.n_in + 15) / 16) < (int64_t{1} << 30) &&
                    ((p.rows + kBM - 1) / kBM + p.groups) * ((p.n + 15) / 16) < (int64_t{1} << 30);
  using grouped::aligned_16;
  const bool aligned = aligned_16(p.a) && aligned_16(p.b) && aligned_16(p.c) &&
                       (p.k2 == 0 || (aligned_16(p.a2) && aligned_16(p.b2)));
  // The probe: any instantiation tells whether the binary has sm_90a code.
  if (shapes && fits && aligned && grouped::device_info().hopper &&
      grouped::have_sm90a_code<grouped_gemm_sm90_bf16_kernel<Layout::kMGroupedKMajorB, 256>>())
    return GroupedGemmPath::kSm90;
  return GroupedGemmPath::kFallback;
}

void launch_grouped_gemm_sm90(const GroupedGemmProblem& p, cudaStream_t stream) {
  if (p.kind != GroupedGemmKind::kMGrouped) {
    launch_sm90_bn<Layout::kKGrouped>(p, grouped::tile_n(p.n_in), stream);
  } else if (grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsN) {
    if (p.transpose_b) {
      launch_sm90<Layout::kMGroupedKMajorBRowsAsN, kRowsAsNTileRows>(p, stream);
    } else {
      launch_sm90<Layout::kMGroupedNMajorBRowsAsN, kRowsAsNTileRows>(p, stream);
    }
  } else if (p.transpose_b) {
    launch_sm90_bn<Layout::kMGroupedKMajorB>(p, grouped::tile_n(p.n), stream);
  } else {
    launch_sm90_bn<Layout::kMGroupedNMajorB>(p, grouped::tile_n(p.n), stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
