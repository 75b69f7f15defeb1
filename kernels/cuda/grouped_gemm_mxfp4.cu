// The MXFP4 grouped GEMM (see grouped_gemm_mxfp4.h): three Hopper kernels and a plain fallback.
// The two with the weight as wgmma's register operand (forward_rs, input_grad_rs) are described
// where they are defined; the general one:
//
// sm90_grouped_gemm_mxfp4_kernel<kKMajorB, BN>: grouped_gemm.cu's m-grouped kernel (tiles handed
// out in group / n-tile / m-tile order through a device counter; the per-group table built from the
// device offsets) with a 192 x BN CTA tile (BN 64 or 128, K steps of 64; warpgroup 0 produces,
// warpgroups 1-3 consume 64 rows each) and b's path replaced. A stage is still an A tile
// (activations, BF16, by TMA) and a B tile, but the producer warpgroup's 128 threads fill the B tile:
//   - they read b's packed bytes and E8M0 scales straight from global memory into registers,
//     kLoadAhead K steps ahead of their use. Each thread owns 2 x BN / 32 chunks of 8 consecutive
//     values along the packed dimension (one 32-bit word of codes each) and their scales: a
//     quarter of the bytes bf16 would read.
//   - when the stage is free they decode them to BF16 (E2M1 magnitudes by byte permutes from an
//     8-entry table, the sign bit by a permute's sign-replicate mode, then one bf16x2 multiply by
//     the power-of-two scale: exact) and store them, 16 bytes per chunk, in the layout TMA would
//     have written: K-major (the forward, b [G, n, k/2]) rows of 64 k values = 128 bytes, or
//     N-major (dy W, b [G, k, n/2]) 64-column chunks of 64 k rows; both 128-byte swizzled (the
//     16-byte unit u of row r at u ^ (r % 8)). Then a proxy fence and an arrival on the stage's
//     'full' barrier, which completes when all 128 have arrived and A's TMA bytes have landed.
// The consumers are grouped_gemm.cu's: wait for a full stage, wgmma, release it, so decoding
// overlaps the tensor cores' work on earlier stages. Out-of-range chunks (past n, or past k in the
// last K step) are stored as zeros: the A columns past k arrive as TMA zeros, and 0 x 0 keeps the
// sum finite. Rows past a group's end are computed from the next group's A rows and never stored,
// as in grouped_gemm.cu.
#include "kernels/cuda/grouped_gemm_mxfp4.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_access.cuh"
#include "kernels/cuda/sm90_primitives.cuh"
#include "kernels/cuda/wgmma_bf16.cuh"
#include "kernels/cuda/wgmma_bf16_rs_prefix.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;

// Three consumer warpgroups of 64 rows: a 192-row tile holds a whole K3 expert (~146 rows at
// EP8), so each B tile is decoded once per expert where 128-row tiles decode it twice (the
// rows computed are the same: a warpgroup past the group's end skips its wgmmas). Their m64n128
// accumulators and everyone else fit in the 128 registers a 512-thread CTA gets; m64n256 would
// not, hence B tiles of at most 128 columns and no setmaxnreg.
constexpr int kConsumerWarpgroups = 3;
constexpr int kBM = 64 * kConsumerWarpgroups;
constexpr int kMaxBN = 128;
constexpr int kBK = 64;  // one 128-byte swizzle row of BF16
constexpr int kProducerThreads = 128;
constexpr int kDecodeThreads = 256;  // the B tile's decoding is laid out for 256 slots: two passes of the producers
constexpr int kDecodePasses = kDecodeThreads / kProducerThreads;
constexpr int kLoadAhead = 2;  // K steps of packed words a producer thread holds in registers
constexpr int kTileSlots = 2;
constexpr int kThreads = kProducerThreads + 128 * kConsumerWarpgroups;
constexpr int kStageBudgetBytes = 200 * 1024;  // of the 227 KB a CTA may have
constexpr int kMaxStages = 8;
constexpr int64_t kTableBudgetBytes = 24 * 1024;
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kProducerBarrier = 1;  // named barrier of the producer warpgroup (0 is __syncthreads)

template <bool kKMajorB, int kBN>
struct Tiling {
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = std::min(kMaxStages, kStageBudgetBytes / kStageBytes);
  static constexpr int kChunks = kBN / 32;  // 8-value chunks per decoding pass of a thread and K step
  static_assert(kBN == 64 || kBN == kMaxBN, "a B tile of whole 64-column swizzle chunks");
  static_assert(kStages >= 3, "too few stages to overlap loads with the math");
  static_assert(kChunks * 8 * kDecodeThreads == kBN * kBK, "the decoding passes cover the whole B tile");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "tiles must start on a 1024-byte swizzle pattern");
};

struct Params {
  void* c;
  int c_f32;
  const int32_t* offsets;
  int groups;
  int rows;
  int n;  // columns of c
  int k;  // the inner dimension
  int n_tiles;
  float alpha;
  float beta;
  int* tile_counter;  // [2], zero between launches: the next tile, the CTAs done fetching
  const uint8_t* packed;  // b's codes
  const uint8_t* scales;  // b's E8M0 bytes
};

struct GroupTable {
  int* rows;   // [groups + 1] clamped offsets
  int* tiles;  // [groups + 1] tiles before each group
};

// Warp-wide, as grouped_gemm.cu: rows[i] = the offsets clamped into a non-decreasing sequence
// inside [0, rows]; tiles[g] = the tiles of the groups before g.
__device__ void build_group_table(const Params& p, GroupTable table, int lane, int tile_rows) {
  int running_max = 0;
  for (int base = 0; base <= p.groups; base += 32) {
    const int i = base + lane;
    int v = i <= p.groups ? p.offsets[i] : INT_MIN;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(kAllLanes, v, d);
      if (lane >= d) v = max(v, u);
    }
    v = min(max(v, running_max), p.rows);
    if (i <= p.groups) table.rows[i] = v;
    running_max = __shfl_sync(kAllLanes, v, 31);
  }
  __syncwarp();
  if (lane == 0) table.tiles[0] = 0;
  int running_tiles = 0;
  for (int base = 0; base < p.groups; base += 32) {
    const int g = base + lane;
    const int count = g < p.groups ? (table.rows[g + 1] - table.rows[g] + tile_rows - 1) / tile_rows * p.n_tiles : 0;
    int sum = count;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(kAllLanes, sum, d);
      if (lane >= d) sum += u;
    }
    if (g < p.groups) table.tiles[g + 1] = running_tiles + sum;
    running_tiles += __shfl_sync(kAllLanes, sum, 31);
  }
}

struct Tile {
  int group;
  int m0, m_end;  // rows [m0, min(m0 + tile rows, m_end)) of c
  int n0;
  int k_steps;
};

template <int kTileRows, int kTileColumns>
__device__ __forceinline__ Tile decode_tile(int t, const Params& p, GroupTable table) {
  int lo = 0, hi = p.groups;  // tiles[lo] <= t < tiles[lo + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (table.tiles[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  Tile tile;
  tile.group = lo;
  const int local = t - table.tiles[lo];
  const int row0 = table.rows[lo], row_end = table.rows[lo + 1];
  const int m_tiles = (row_end - row0 + kTileRows - 1) / kTileRows;
  tile.m0 = row0 + local % m_tiles * kTileRows;
  tile.m_end = row_end;
  tile.n0 = local / m_tiles * kTileColumns;
  tile.k_steps = (p.k + kBK - 1) / kBK;
  return tile;
}

// ---------------------------------------------------------------------------------------------
// b: loading the packed chunks and decoding them into the B tile

// One decoding pass's part of b for one K step: kChunks words of 8 codes, consecutive along
// the packed dimension, and the scale of each group of 32 they start (chunks 4i .. 4i + 3).
template <int kChunks>
struct PackedChunks {
  uint32_t words[kChunks];
  uint32_t scales[(kChunks + 3) / 4];
};

// Where the chunks of decoding slot v (0..255: producer thread v % 128, pass v / 128) sit in the
// B tile: K-major, row r = n - n0, chunks from j0 (k = k0 + 8 j0 ...); N-major, row r = k - k0,
// columns from n0 + 8 j0. Neighbouring slots take neighbouring rows, so the 16-byte stores of a
// quarter warp hit 8 different swizzle units.
template <bool kKMajorB, int kBN>
struct ChunkPlace {
  int row, j0;
  __device__ explicit ChunkPlace(int slot) {
    constexpr int kRows = kKMajorB ? kBN : kBK;
    row = slot % kRows;
    j0 = slot / kRows * Tiling<kKMajorB, kBN>::kChunks;
  }
};

template <bool kKMajorB, int kBN>
__device__ __forceinline__ void load_chunks(PackedChunks<Tiling<kKMajorB, kBN>::kChunks>& out, const Params& p,
                                            const Tile& tile, int k0, ChunkPlace<kKMajorB, kBN> place) {
  constexpr int kChunks = Tiling<kKMajorB, kBN>::kChunks;
  // The weight row (of b viewed as [G * outer, width]) and the first packed column.
  const int outer = kKMajorB ? tile.n0 + place.row : k0 + place.row;
  const int col0 = (kKMajorB ? k0 : tile.n0) + 8 * place.j0;
  const int outer_extent = kKMajorB ? p.n : p.k, width = kKMajorB ? p.k : p.n;
  const bool valid = outer < outer_extent && col0 < width;
  // width is a multiple of 32, so a chunk group of 16 or 32 values is all in or all out; with 8
  // chunks the second group of 32 may be out.
  const bool second_valid = valid && (kChunks < 8 || col0 + 32 < width);
  const int64_t row = static_cast<int64_t>(tile.group) * outer_extent + outer;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) out.words[i] = 0;
#pragma unroll
  for (int i = 0; i < (kChunks + 3) / 4; ++i) out.scales[i] = 127;
  if (!valid) return;
  const uint8_t* bytes = p.packed + row * (width / 2) + col0 / 2;
  const uint8_t* scales = p.scales + row * (width / 32) + col0 / 32;
  if constexpr (kChunks == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(bytes));
    out.words[0] = v.x;
    out.words[1] = v.y;
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(bytes));
    out.words[0] = v.x;
    out.words[1] = v.y;
    out.words[2] = v.z;
    out.words[3] = v.w;
    if constexpr (kChunks == 8) {
      if (second_valid) {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(bytes) + 1);
        out.words[4] = w.x;
        out.words[5] = w.y;
        out.words[6] = w.z;
        out.words[7] = w.w;
        out.scales[1] = __ldg(scales + 1);
      }
    }
  }
  out.scales[0] = __ldg(scales);
}

__device__ __forceinline__ uint32_t byte_permute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// BF16 bit patterns of the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0000 3F00 3F80 3FC0 4000
// 4040 4080 40C0), split into their high and low bytes, 8 bytes each across two words.
constexpr uint32_t kHighBytes0 = 0x3F3F3F00u, kHighBytes1 = 0x40404040u;
constexpr uint32_t kLowBytes0 = 0xC0800000u, kLowBytes1 = 0xC0804000u;

// The E8M0 scale as a BF16 pair: 2^(s - 127) (s = 0: the subnormal 2^-127; 255: NaN).
__device__ __forceinline__ __nv_bfloat162 scale_pair(uint32_t s) {
  const uint32_t bits = s == 0 ? 0x0040u : s == 255 ? 0x7FC0u : s << 7;
  const uint32_t pair = bits | bits << 16;
  return *reinterpret_cast<const __nv_bfloat162*>(&pair);
}

// 8 codes (nibble i of `word` is value i: the low nibble of a byte first) to 8 BF16 values.
__device__ __forceinline__ uint4 decode_chunk(uint32_t word, __nv_bfloat162 scale) {
  const uint32_t magnitudes = word & 0x77777777u;
  uint32_t out[4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // values 4 half .. 4 half + 3
    const uint32_t selector = half ? magnitudes >> 16 : magnitudes;
    uint32_t high = byte_permute(kHighBytes0, kHighBytes1, selector);
    const uint32_t low = byte_permute(kLowBytes0, kLowBytes1, selector);
    // The sign bits: a selector nibble with bit 3 set replicates the chosen byte's top bit (here
    // 1: 0xFF), otherwise copies the byte (0x80); bit 6 tells the two apart.
    const uint32_t signs = byte_permute(0x80808080u, 0x80808080u, half ? word >> 16 : word) << 1;
    high |= signs & 0x80808080u;
    out[2 * half] = byte_permute(low, high, 0x5140u);      // values 0, 1 of the four
    out[2 * half + 1] = byte_permute(low, high, 0x7362u);  // values 2, 3
  }
  uint4 result;
  uint32_t* r = &result.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&out[i]), scale);
    r[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return result;
}

template <bool kKMajorB, int kBN>
__device__ __forceinline__ void store_chunks(unsigned char* b_tile, const PackedChunks<Tiling<kKMajorB, kBN>::kChunks>& in,
                                             ChunkPlace<kKMajorB, kBN> place) {
  constexpr int kChunks = Tiling<kKMajorB, kBN>::kChunks;
  __nv_bfloat162 scales[(kChunks + 3) / 4];
#pragma unroll
  for (int i = 0; i < (kChunks + 3) / 4; ++i) scales[i] = scale_pair(in.scales[i]);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const uint4 values = decode_chunk(in.words[i], scales[i / 4]);
    const int j = place.j0 + i, r = place.row;
    int offset;
    if constexpr (kKMajorB) {
      offset = r * 128 + ((j ^ (r & 7)) << 4);  // row r (an n), 16-byte unit j (k 8j .. 8j + 7)
    } else {
      offset = (j >> 3) * (kBK * 128) + r * 128 + (((j & 7) ^ (r & 7)) << 4);  // 64-column chunk, row r (a k)
    }
    *reinterpret_cast<uint4*>(b_tile + offset) = values;
  }
}

// One consumer warpgroup's 64 x kBN accumulators into c (grouped_gemm.cu's store): rows past
// m_end and columns past n are not stored (n is a multiple of 8).
template <typename OutT, int kBN>
__device__ __forceinline__ void store_tile(const float (&acc)[kBN / 2], const Params& p, const Tile& tile,
                                           int row_in_tile, int column_in_tile) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.m0 + row_in_tile + 8 * h;
    if (row >= tile.m_end) continue;
    OutT* out = static_cast<OutT*>(p.c) + static_cast<int64_t>(row) * p.n;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      const int column = tile.n0 + column_in_tile + 8 * j;
      if (column >= p.n) continue;
      float v0 = p.alpha * acc[4 * j + 2 * h], v1 = p.alpha * acc[4 * j + 2 * h + 1];
      if constexpr (std::is_same_v<OutT, float>) {
        float2* dst = reinterpret_cast<float2*>(out + column);
        if (p.beta != 0.0f) {
          const float2 old = *dst;
          v0 += p.beta * old.x;
          v1 += p.beta * old.y;
        }
        *dst = make_float2(v0, v1);
      } else {
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + column);
        if (p.beta != 0.0f) {
          const float2 old = __bfloat1622float2(*dst);
          v0 += p.beta * old.x;
          v1 += p.beta * old.y;
        }
        *dst = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}

template <bool kKMajorB, int kBN>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_grouped_gemm_mxfp4_kernel(const __grid_constant__ CUtensorMap map_a, const Params p) {
  using T = Tiling<kKMajorB, kBN>;
  using Chunks = PackedChunks<T::kChunks>;
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

  // Warp-uniform in the compiler's eyes too (a broadcast), so the wgmma paths are not divergent.
  const int warp = __shfl_sync(kAllLanes, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      // Thread 0's arrival that arms A's bytes, then every producer thread's after its decoding.
      sm90::barrier_init(&full[s], 1 + kProducerThreads);
      sm90::barrier_init(&empty[s], kConsumerWarpgroups * 4);  // lane 0 of every consumer warp
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::barrier_init(&tile_full[s], 1);
      sm90::barrier_init(&tile_empty[s], kConsumerWarpgroups * 4);
    }
    sm90::fence_barrier_init();
  }
  if (warp == 1) build_group_table(p, table, lane, kBM);
  __syncthreads();
  const int total_tiles = table.tiles[p.groups];

  if (warp < 4) {
    const int thread = threadIdx.x;  // 0 .. 127
    if (thread == 0) sm90::tma_prefetch_descriptor(&map_a);
    int stage = 0;
    uint32_t phase = 0;
    int slot = 0;
    uint32_t slot_phase = 0;
    Chunks sets[kLoadAhead][kDecodePasses];  // the packed words of the next kLoadAhead K steps
    auto load = [&](Chunks (&chunks)[kDecodePasses], const Tile& tile, int s) {
#pragma unroll
      for (int pass = 0; pass < kDecodePasses; ++pass) {
        const ChunkPlace<kKMajorB, kBN> place(thread + pass * kProducerThreads);
        load_chunks<kKMajorB, kBN>(chunks[pass], p, tile, s * kBK, place);
      }
    };
    // One K step into the next free stage: A by TMA, B decoded from `chunks`.
    auto produce = [&](const Chunks (&chunks)[kDecodePasses], const Tile& tile, int s) {
      sm90::barrier_wait(&empty[stage], phase ^ 1);
      if (thread == 0) {
        sm90::barrier_arrive_expect_bytes(&full[stage], T::kABytes);
        sm90::tma_load_2d(a_stages + stage * T::kABytes, &map_a, &full[stage], s * kBK, tile.m0);
      }
      unsigned char* b_tile = b_stages + stage * T::kBBytes;
#pragma unroll
      for (int pass = 0; pass < kDecodePasses; ++pass) {
        const ChunkPlace<kKMajorB, kBN> place(thread + pass * kProducerThreads);
        store_chunks<kKMajorB, kBN>(b_tile, chunks[pass], place);
      }
      sm90::fence_proxy_async_shared();
      sm90::barrier_arrive(&full[stage]);
      if (++stage == T::kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    for (;;) {
      if (thread == 0) {
        sm90::barrier_wait(&tile_empty[slot], slot_phase ^ 1);
        const int next = atomicAdd(p.tile_counter, 1);
        tile_slot[slot] = next;
        sm90::barrier_arrive(&tile_full[slot]);
      }
      sm90::named_barrier_sync(kProducerBarrier, kProducerThreads);  // the tile index is in tile_slot
      const int t = tile_slot[slot];
      if (++slot == kTileSlots) {
        slot = 0;
        slot_phase ^= 1;
      }
      if (t >= total_tiles) break;
      const Tile tile = decode_tile<kBM, kBN>(t, p, table);
      const int steps = tile.k_steps;
#pragma unroll
      for (int i = 0; i < kLoadAhead; ++i) {
        if (i < steps) load(sets[i], tile, i);
      }
      for (int s0 = 0; s0 < steps; s0 += kLoadAhead) {
#pragma unroll
        for (int i = 0; i < kLoadAhead; ++i) {
          const int s = s0 + i;
          if (s < steps) {
            produce(sets[i], tile, s);
            if (s + kLoadAhead < steps) load(sets[i], tile, s + kLoadAhead);
          }
        }
      }
    }
    // Every CTA fetches past the end exactly once; the last one to finish fetching puts the
    // counters back to zero for the next launch on the stream.
    if (thread == 0) {
      __threadfence();
      if (atomicAdd(p.tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        p.tile_counter[0] = 0;
        p.tile_counter[1] = 0;
      }
    }
    return;
  }

  const int warpgroup = warp / 4 - 1;  // rows [64 w, 64 w + 64) of the tile
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
    const Tile tile = decode_tile<kBM, kBN>(t, p, table);
    // A warpgroup whose 64 rows all lie past the group's end multiplies nothing.
    const bool active = tile.m0 + warpgroup * 64 < tile.m_end;
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;
    int previous_stage = 0;
    for (int s = 0; s < tile.k_steps; ++s) {
      sm90::barrier_wait(&full[stage], phase);
      const uint32_t a_address = sm90::smem_address(a_stages + stage * T::kABytes) + warpgroup * 64 * 128;
      const uint32_t b_address = sm90::smem_address(b_stages + stage * T::kBBytes);
      sm90::fence_registers(acc);
      sm90::wgmma_fence();
      if (active) {
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t desc_a = sm90::matrix_descriptor(a_address + kk * 32, 16, 1024, sm90::swizzle_code(128));
          const uint64_t desc_b =
              kKMajorB ? sm90::matrix_descriptor(b_address + kk * 32, 16, 1024, sm90::swizzle_code(128))
                       : sm90::matrix_descriptor(b_address + kk * 16 * 128, kBK * 128, 1024, sm90::swizzle_code(128));
          sm90::Wgmma<kBN>::template mma<0, kKMajorB ? 0 : 1>(acc, desc_a, desc_b, 1);
        }
      }
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
    if (tile.k_steps > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);

    const int row_in_tile = warpgroup * 64 + warp % 4 * 16 + lane / 4;
    const int column_in_tile = 2 * (lane % 4);
    if (p.c_f32) {
      store_tile<float, kBN>(acc, p, tile, row_in_tile, column_in_tile);
    } else {
      store_tile<bf16, kBN>(acc, p, tile, row_in_tile, column_in_tile);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The forward (x W^T, k a multiple of 32) with the weight as wgmma's register operand
//
// sm90_mxfp4_forward_kernel computes c^T = W . x^T tile by tile: the expert's weight rows (the
// columns of c) are wgmma's M and its activation rows wgmma's N. A tile is 128 weight rows (two
// consumer warpgroups x 64) by up to 256 rows of one group, and N is those rows rounded up to 32:
// a K3 expert (~146 rows) is one tile column of N = 160 instead of two 128-row tiles.
//   - The producer warpgroup's thread 0 only issues TMA copies: per K step of 64, the packed
//     weight tile (128 rows x 32 bytes, unswizzled: the 16-byte loads below meet at most 2-way
//     bank conflicts, a few per K step) and the activation rows in boxes of 32
//     (128-byte swizzle, the K-major B operand). No thread decodes into shared memory.
//   - The consumers decode the packed bytes from shared memory straight into wgmma's A register
//     fragment: a thread's fragment rows are weight rows g and g + 8 of its warp's 16, its k pairs
//     (2c, 2c + 1) and (2c + 8, 2c + 9) of each k16, i.e. byte c of every 4-byte word of the row's
//     32 bytes (two 16-byte loads, then a byte permute per k16 gathers the two bytes). Decoding
//     is decode4 below (byte permutes from 8-entry tables, then one bf16x2 multiply by the
//     power-of-two scale: exact). The scales come from global memory (L1), two K steps ahead.
//   - Pipelining: the fragment of K step s + 1 is decoded while the wgmmas of step s run (two
//     fragment register sets); wait_group 1 after issuing step s frees step s - 1's registers and
//     stage.
//   - c is written transposed: lanes g and g ^ 1 swap one value so each stores two adjacent
//     columns of one row of c.
namespace forward_rs {

constexpr int kWeightRows = 128;  // per tile: two consumer warpgroups x 64
constexpr int kTokenRows = 256;   // rows of a per tile at most: wgmma's largest N
constexpr int kBox = 32;          // rows of a per TMA box, and the step of N
constexpr int kThreads = 128 * 3;
constexpr int kABytes = kTokenRows * kBK * 2;
constexpr int kBoxBytes = kBox * kBK * 2;
constexpr int kWBytes = kWeightRows * kBK / 2;
constexpr int kStages = std::min(kMaxStages, kStageBudgetBytes / (kABytes + kWBytes));
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;  // 128 x 40 + 256 x 232 <= 64K
static_assert(kStages >= 3, "too few stages to overlap loads with the math");
static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0, "tiles must start on a whole swizzle pattern");

__device__ __forceinline__ int boxes_of(const Tile& tile) {
  return (min(kTokenRows, tile.m_end - tile.m0) + kBox - 1) / kBox;
}

// 4 codes (the low 16 bits of `codes`: nibble i is value i) to BF16 pairs (v0, v1) and (v2, v3)
// times the power-of-two `scale`. The magnitudes' high and low bytes come from 8-entry tables,
// the signs as in decode_chunk.
__device__ __forceinline__ void decode4(uint32_t codes, __nv_bfloat162 scale, uint32_t& v01, uint32_t& v23) {
  const uint32_t magnitudes = codes & 0x7777u;
  const uint32_t high = byte_permute(kHighBytes0, kHighBytes1, magnitudes) |
                        ((byte_permute(0x80808080u, 0x80808080u, codes) << 1) & 0x80808080u);
  const uint32_t low = byte_permute(kLowBytes0, kLowBytes1, magnitudes);
  uint32_t pair[2] = {byte_permute(low, high, 0x5140u), byte_permute(low, high, 0x7362u)};
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[0]), scale);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[1]), scale);
  v01 = *reinterpret_cast<const uint32_t*>(&a);
  v23 = *reinterpret_cast<const uint32_t*>(&b);
}

template <int kCount>
__device__ __forceinline__ void fence_words(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// One K step (four k16) of a warpgroup: acc (64 x kN) += fragment f[0 .. 16) . B tile.
template <int kN, int kRegisters>
__device__ __forceinline__ void k_step(float (&acc)[kRegisters], const uint32_t* f, uint32_t b_address) {
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t desc_b = sm90::matrix_descriptor(b_address + kk * 32, 16, 1024, sm90::swizzle_code(128));
    sm90::WgmmaRsPrefix<kN>::mma(acc, f[4 * kk], f[4 * kk + 1], f[4 * kk + 2], f[4 * kk + 3], desc_b);
  }
}

// The K step with N = 32 boxes (boxes warp-uniform, 1 .. kRegisters / 16).
template <int kRegisters>
__device__ __forceinline__ void k_step_n(int boxes, float (&acc)[kRegisters], const uint32_t* f, uint32_t b_address) {
  switch (boxes) {
    case 1: k_step<32>(acc, f, b_address); break;
    case 2: k_step<64>(acc, f, b_address); break;
    case 3: k_step<96>(acc, f, b_address); break;
    default:
      if constexpr (kRegisters == 64) {
        k_step<128>(acc, f, b_address);
      } else {
        switch (boxes) {
          case 4: k_step<128>(acc, f, b_address); break;
          case 5: k_step<160>(acc, f, b_address); break;
          case 6: k_step<192>(acc, f, b_address); break;
          case 7: k_step<224>(acc, f, b_address); break;
          default: k_step<256>(acc, f, b_address); break;
        }
      }
      break;
  }
}

// c[m0 + token][n0 + column] for the thread's accumulators: column = weight row `row` (+ 8 for the
// second half), token = 8 j + 2 (lane % 4) + {0, 1}. Lanes g and g ^ 1 (lane ^ 4) trade one value
// so that each holds two adjacent columns of one token; columns past n and rows past m_end are
// not stored (n is even, so a column pair is all in or all out).
template <typename OutT>
__device__ __forceinline__ void store_transposed(const float (&acc)[128], const Params& p, const Tile& tile, int boxes,
                                                 int row, int lane) {
  const int odd = (lane / 4) & 1;
  const int c = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int column = tile.n0 + row + 8 * h - odd;
    const bool column_ok = column < p.n;
#pragma unroll
    for (int j = 0; j < kTokenRows / 8; ++j) {
      if (j >= boxes * (kBox / 8)) break;
      const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      const float other = __shfl_xor_sync(kAllLanes, odd ? v0 : v1, 4);
      float lo = p.alpha * (odd ? other : v0), hi = p.alpha * (odd ? v1 : other);
      const int token = tile.m0 + 8 * j + 2 * c + odd;
      if (!column_ok || token >= tile.m_end) continue;
      OutT* out = static_cast<OutT*>(p.c) + static_cast<int64_t>(token) * p.n + column;
      if constexpr (std::is_same_v<OutT, float>) {
        float2* dst = reinterpret_cast<float2*>(out);
        if (p.beta != 0.0f) {
          const float2 old = *dst;
          lo += p.beta * old.x;
          hi += p.beta * old.y;
        }
        *dst = make_float2(lo, hi);
      } else {
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out);
        if (p.beta != 0.0f) {
          const float2 old = __bfloat1622float2(*dst);
          lo += p.beta * old.x;
          hi += p.beta * old.y;
        }
        *dst = __floats2bfloat162_rn(lo, hi);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    sm90_mxfp4_forward_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                              const Params p) {
  extern __shared__ __align__(1024) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + kStages;
  uint64_t* tile_full = empty + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_slot = reinterpret_cast<int*>(tile_empty + kTileSlots);
  GroupTable table{tile_slot + kTileSlots, nullptr};
  table.tiles = table.rows + p.groups + 1;
  const uintptr_t table_end = reinterpret_cast<uintptr_t>(table.tiles + p.groups + 1);
  unsigned char* a_stages = reinterpret_cast<unsigned char*>((table_end + 1023) & ~uintptr_t{1023});
  unsigned char* w_stages = a_stages + kStages * kABytes;

  const int warp = __shfl_sync(kAllLanes, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::barrier_init(&full[s], 1);
      sm90::barrier_init(&empty[s], 2 * 4);  // lane 0 of every consumer warp
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::barrier_init(&tile_full[s], 1);
      sm90::barrier_init(&tile_empty[s], 2 * 4);
    }
    sm90::fence_barrier_init();
  }
  if (warp == 1) build_group_table(p, table, lane, kTokenRows);
  __syncthreads();
  const int total_tiles = table.tiles[p.groups];

  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_w);
    int stage = 0, slot = 0;
    uint32_t phase = 0, slot_phase = 0;
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
      const Tile tile = decode_tile<kTokenRows, kWeightRows>(t, p, table);
      const int boxes = boxes_of(tile);
      const int w_row = tile.group * p.n + tile.n0;
      for (int s = 0; s < tile.k_steps; ++s) {
        sm90::barrier_wait(&empty[stage], phase ^ 1);
        sm90::barrier_arrive_expect_bytes(&full[stage], kWBytes + boxes * kBoxBytes);
        sm90::tma_load_2d(w_stages + stage * kWBytes, &map_w, &full[stage], s * kBK / 2, w_row);
        for (int b = 0; b < boxes; ++b) {
          sm90::tma_load_2d(a_stages + stage * kABytes + b * kBoxBytes, &map_a, &full[stage], s * kBK,
                            tile.m0 + b * kBox);
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    // As in the other kernel: the last CTA to finish fetching resets the counters.
    __threadfence();
    if (atomicAdd(p.tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      p.tile_counter[0] = 0;
      p.tile_counter[1] = 0;
    }
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;
  // The thread's weight rows in the tile: row and row + 8.
  const int row = warpgroup * 64 + warp % 4 * 16 + lane / 4;
  const uint32_t gather = (lane % 4) | ((lane % 4) + 4) << 4;  // byte c of two words
  const int scale_width = p.k / 32;
  int stage = 0, slot = 0;
  uint32_t phase = 0, slot_phase = 0;
  float acc[128];
  uint32_t frag0[16], frag1[16];
  uint32_t scales0[4], scales1[4];  // E8M0 bytes: row, group 2s; row, 2s + 1; row + 8, 2s; row + 8, 2s + 1
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
    const Tile tile = decode_tile<kTokenRows, kWeightRows>(t, p, table);
    const int boxes = boxes_of(tile);
    const int steps = tile.k_steps;
    // A warpgroup whose 64 weight rows all lie past n decodes and multiplies nothing.
    const bool active = tile.n0 + warpgroup * 64 < p.n;
    const bool valid0 = tile.n0 + row < p.n, valid1 = tile.n0 + row + 8 < p.n;
    const uint8_t* scale_row = p.scales + (static_cast<int64_t>(tile.group) * p.n + tile.n0 + row) * scale_width;
    auto load_scales = [&](uint32_t (&sc)[4], int s) {
      const int q = 2 * s;
      const bool second = q + 1 < scale_width;  // k % 64 == 32: the last step has one group
      sc[0] = valid0 ? __ldg(scale_row + q) : 127u;
      sc[1] = valid0 && second ? __ldg(scale_row + q + 1) : 127u;
      sc[2] = valid1 ? __ldg(scale_row + 8 * scale_width + q) : 127u;
      sc[3] = valid1 && second ? __ldg(scale_row + 8 * scale_width + q + 1) : 127u;
    };
    auto decode = [&](uint32_t (&f)[16], const uint32_t (&sc)[4], int st) {
      const unsigned char* w = w_stages + st * kWBytes + row * 32;
      const uint4 r0 = *reinterpret_cast<const uint4*>(w);
      const uint4 r1 = *reinterpret_cast<const uint4*>(w + 16);
      const uint4 r2 = *reinterpret_cast<const uint4*>(w + 8 * 32);
      const uint4 r3 = *reinterpret_cast<const uint4*>(w + 8 * 32 + 16);
      const uint32_t words0[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
      const uint32_t words1[8] = {r2.x, r2.y, r2.z, r2.w, r3.x, r3.y, r3.z, r3.w};
      const __nv_bfloat162 s00 = scale_pair(sc[0]), s01 = scale_pair(sc[1]);
      const __nv_bfloat162 s10 = scale_pair(sc[2]), s11 = scale_pair(sc[3]);
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        decode4(byte_permute(words0[2 * kk], words0[2 * kk + 1], gather), kk < 2 ? s00 : s01, f[4 * kk],
                f[4 * kk + 2]);
        decode4(byte_permute(words1[2 * kk], words1[2 * kk + 1], gather), kk < 2 ? s10 : s11, f[4 * kk + 1],
                f[4 * kk + 3]);
      }
    };
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    load_scales(scales0, 0);
    if (steps > 1) load_scales(scales1, 1);
    sm90::barrier_wait(&full[stage], phase);
    if (active) decode(frag0, scales0, stage);
    if (steps > 2) load_scales(scales0, 2);
    int previous_stage = stage;
    auto step = [&](uint32_t (&current)[16], uint32_t (&next)[16], uint32_t (&next_scales)[4], int s) {
      sm90::fence_registers(acc);
      fence_words(current);
      sm90::wgmma_fence();
      if (active) k_step_n(boxes, acc, current, sm90::smem_address(a_stages + stage * kABytes));
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // step s - 1 is done: its registers and stage are free
      sm90::fence_registers(acc);
      fence_words(next);
      if (s > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
      previous_stage = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
      if (s + 1 < steps) {
        sm90::barrier_wait(&full[stage], phase);
        if (active) decode(next, next_scales, stage);
        if (s + 3 < steps) load_scales(next_scales, s + 3);
      }
    };
    for (int s = 0; s < steps; s += 2) {
      step(frag0, frag1, scales1, s);
      if (s + 1 < steps) step(frag1, frag0, scales0, s + 1);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_registers(acc);
    if (lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
    if (p.c_f32) {
      store_transposed<float>(acc, p, tile, boxes, row, lane);
    } else {
      store_transposed<bf16>(acc, p, tile, boxes, row, lane);
    }
  }
}

}  // namespace forward_rs

// ---------------------------------------------------------------------------------------------
// The input gradient (dy W, n a multiple of 256) with the weight as wgmma's register operand
//
// sm90_mxfp4_input_grad_kernel computes c^T = W^T . dy^T: the columns of c (W's packed dimension)
// are wgmma's M, dy's rows N, W's rows K. A tile is 256 columns of c by up to 128 rows of a group
// (N = the rows rounded up to 32). Each consumer warpgroup owns 128 columns as two m64 blocks,
// because a thread's fragment rows cannot come from one packed byte otherwise:
//   - W's tile, 64 k rows x 128 bytes, arrives by TMA (3-D over [G, k, n / 2]: rows past k arrive
//     as zeros) with the 128-byte swizzle. ldmatrix.x4.trans, in 16-bit units of 4 codes, gives
//     a thread the codes of columns 4g .. 4g + 3 of its warp's 32 (g = lane / 4) at k rows 2c and
//     2c + 1 (c = lane % 4) of each 8-row matrix: exactly wgmma's k pairs. Fragment row g of block
//     b is column 4g + 2b, row g + 8 column 4g + 2b + 1, so the two blocks together use all four.
//     A nibble interleave pairs each column's two k values, then decode4 as in the forward.
//   - The scales, one per (k row, 32 columns), differ along K, so each fragment register needs
//     its own pair. Producer warps 1 and 2 read them from global memory and write, per stage, the
//     BF16 pair (k 2p, 2p + 1) for every 32 columns in the order the consumers load them (two
//     16-byte loads per K step), then arrive on the stage's 'full' barrier beside the TMA bytes.
//   - c is written directly: a thread's accumulators of both blocks are four adjacent columns.
namespace input_grad_rs {

constexpr int kColumns = 256;    // columns of c per tile: two consumer warpgroups x two m64 blocks
constexpr int kTokenRows = 128;  // rows of dy per tile at most (two 64-column accumulators)
constexpr int kBox = 32;
constexpr int kThreads = 128 * 3;
constexpr int kABytes = kTokenRows * kBK * 2;
constexpr int kBoxBytes = kBox * kBK * 2;
constexpr int kWBytes = kBK * kColumns / 2;
constexpr int kScaleStride = 68;  // words per c: 8 groups x 8 pairs, + 4 so the four c's of a warp's loads miss each other's banks
constexpr int kSBytes = 4 * kScaleStride * 4 + 64;  // padded to a multiple of 128
constexpr int kStageBytes = kABytes + kWBytes + kSBytes;
constexpr int kStages = std::min(kMaxStages, kStageBudgetBytes / kStageBytes);
constexpr int kConverters = 64;  // threads 32 .. 95 of the producer warpgroup
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kStages >= 3, "too few stages to overlap loads with the math");
static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0 && kSBytes % 128 == 0, "stage alignment");

__device__ __forceinline__ int boxes_of(const Tile& tile) {
  return (min(kTokenRows, tile.m_end - tile.m0) + kBox - 1) / kBox;
}

__device__ __forceinline__ uint32_t scale_bits(uint32_t s) { return s == 0 ? 0x0040u : s == 255 ? 0x7FC0u : s << 7; }

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
#else
  __trap();
#endif
}

// Nibbles 0..7 of x to the order 0 4 1 5 2 6 3 7.
__device__ __forceinline__ uint32_t interleave_nibbles(uint32_t x) {
  const uint32_t y = byte_permute(x, x, 0x3120u);  // bytes 0 2 1 3: nibbles 0 1 4 5 2 3 6 7
  return (y & 0xF00FF00Fu) | ((y << 4) & 0x0F000F00u) | ((y >> 4) & 0x00F000F0u);
}

__global__ void __launch_bounds__(kThreads, 1)
    sm90_mxfp4_input_grad_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                                 const Params p) {
  extern __shared__ __align__(1024) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + kStages;
  uint64_t* tile_full = empty + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_slot = reinterpret_cast<int*>(tile_empty + kTileSlots);
  GroupTable table{tile_slot + kTileSlots, nullptr};
  table.tiles = table.rows + p.groups + 1;
  const uintptr_t table_end = reinterpret_cast<uintptr_t>(table.tiles + p.groups + 1);
  unsigned char* a_stages = reinterpret_cast<unsigned char*>((table_end + 1023) & ~uintptr_t{1023});
  unsigned char* w_stages = a_stages + kStages * kABytes;
  unsigned char* s_stages = w_stages + kStages * kWBytes;

  const int warp = __shfl_sync(kAllLanes, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::barrier_init(&full[s], 1 + kConverters);
      sm90::barrier_init(&empty[s], 2 * 4);  // lane 0 of every consumer warp
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::barrier_init(&tile_full[s], 1);
      sm90::barrier_init(&tile_empty[s], 2 * 4 + kConverters / 32);  // consumer and converter warps
    }
    sm90::fence_barrier_init();
  }
  if (warp == 1) build_group_table(p, table, lane, kTokenRows);
  __syncthreads();
  const int total_tiles = table.tiles[p.groups];
  const int group_words = p.n / 32;  // scale bytes per k row

  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x == 0) {
      sm90::tma_prefetch_descriptor(&map_a);
      sm90::tma_prefetch_descriptor(&map_w);
      int stage = 0, slot = 0;
      uint32_t phase = 0, slot_phase = 0;
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
        const Tile tile = decode_tile<kTokenRows, kColumns>(t, p, table);
        const int boxes = boxes_of(tile);
        for (int s = 0; s < tile.k_steps; ++s) {
          sm90::barrier_wait(&empty[stage], phase ^ 1);
          sm90::barrier_arrive_expect_bytes(&full[stage], kWBytes + boxes * kBoxBytes);
          sm90::tma_load_3d(w_stages + stage * kWBytes, &map_w, &full[stage], tile.n0 / 2, s * kBK, tile.group);
          for (int b = 0; b < boxes; ++b) {
            sm90::tma_load_2d(a_stages + stage * kABytes + b * kBoxBytes, &map_a, &full[stage], s * kBK,
                              tile.m0 + b * kBox);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      __threadfence();
      if (atomicAdd(p.tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        p.tile_counter[0] = 0;
        p.tile_counter[1] = 0;
      }
    } else if (warp == 1 || warp == 2) {
      // Converter i: k rows 2 pr, 2 pr + 1 of each K step (pr = i / 2), 4 of the tile's 8 column
      // groups (from 4 (i % 2)); the pair's word goes where consumer c = pr % 4 loads it, as its
      // pair j = pr / 4 (= 2 kk + upper half) of group q.
      const int i = threadIdx.x - 32;
      const int pr = i / 2, first_group = (i % 2) * 4;
      uint32_t* words_base = reinterpret_cast<uint32_t*>(s_stages) + (pr % 4) * kScaleStride + first_group * 8 + pr / 4;
      int stage = 0, slot = 0;
      uint32_t phase = 0, slot_phase = 0;
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
        const Tile tile = decode_tile<kTokenRows, kColumns>(t, p, table);
        // n % 256 == 0: the tile's 8 groups lie inside the row, 4-byte aligned.
        const uint8_t* scale_rows =
            p.scales + static_cast<int64_t>(tile.group) * p.k * group_words + tile.n0 / 32 + first_group;
        for (int s = 0; s < tile.k_steps; ++s) {
          const int k_even = s * kBK + 2 * pr;
          // Rows past k multiply zero codes: any finite scale.
          const uint32_t even = k_even < p.k
                                    ? __ldg(reinterpret_cast<const uint32_t*>(scale_rows + static_cast<int64_t>(k_even) * group_words))
                                    : 0x7F7F7F7Fu;
          const uint32_t odd =
              k_even + 1 < p.k
                  ? __ldg(reinterpret_cast<const uint32_t*>(scale_rows + static_cast<int64_t>(k_even + 1) * group_words))
                  : 0x7F7F7F7Fu;
          sm90::barrier_wait(&empty[stage], phase ^ 1);
          uint32_t* words = reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(words_base) + stage * kSBytes);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            words[q * 8] = scale_bits((even >> (8 * q)) & 0xFFu) | scale_bits((odd >> (8 * q)) & 0xFFu) << 16;
          }
          sm90::barrier_arrive(&full[stage]);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;
  const int c = lane % 4;
  const int unit = warpgroup * 4 + warp % 4;  // the warp's 16-byte unit of a packed row; also its scale group
  // ldmatrix q: lane l addresses k row 32 q + l of the stage (matrix l / 8, row l % 8).
  const uint32_t row_offset = lane * 128 + ((unit ^ (lane % 8)) << 4);
  const uint32_t scale_offset = (c * kScaleStride + unit * 8) * 4;
  int stage = 0, slot = 0;
  uint32_t phase = 0, slot_phase = 0;
  float acc0[64], acc1[64];
  uint32_t frag0[32], frag1[32];  // block 0's 16 registers, then block 1's
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
    const Tile tile = decode_tile<kTokenRows, kColumns>(t, p, table);
    const int boxes = boxes_of(tile);
    const int steps = tile.k_steps;
    const bool active = tile.n0 + warpgroup * 128 < p.n;
    auto decode = [&](uint32_t (&f)[32], int st) {
      const uint32_t w_base = sm90::smem_address(w_stages + st * kWBytes) + row_offset;
      uint32_t x[2][4];
      ldmatrix_x4_trans(x[0], w_base);
      ldmatrix_x4_trans(x[1], w_base + 32 * 128);
      const unsigned char* scale_base = s_stages + st * kSBytes + scale_offset;
      const uint4 s_lo = *reinterpret_cast<const uint4*>(scale_base);
      const uint4 s_hi = *reinterpret_cast<const uint4*>(scale_base + 16);
      const uint32_t scale_words[8] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // j = 2 kk + upper: k rows 16 kk + 8 upper + 2c, + 1
        const int kk = j / 2, upper = j % 2;
        const uint32_t codes = interleave_nibbles(x[j / 4][j % 4]);
        const __nv_bfloat162 scale = *reinterpret_cast<const __nv_bfloat162*>(&scale_words[j]);
        forward_rs::decode4(codes, scale, f[4 * kk + 2 * upper], f[4 * kk + 2 * upper + 1]);
        forward_rs::decode4(codes >> 16, scale, f[16 + 4 * kk + 2 * upper], f[16 + 4 * kk + 2 * upper + 1]);
      }
    };
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      acc0[i] = 0.0f;
      acc1[i] = 0.0f;
    }
    sm90::barrier_wait(&full[stage], phase);
    if (active) decode(frag0, stage);
    int previous_stage = stage;
    auto step = [&](uint32_t (&current)[32], uint32_t (&next)[32], int s) {
      sm90::fence_registers(acc0);
      sm90::fence_registers(acc1);
      forward_rs::fence_words(current);
      sm90::wgmma_fence();
      if (active) {
        const uint32_t b_address = sm90::smem_address(a_stages + stage * kABytes);
        forward_rs::k_step_n(boxes, acc0, current, b_address);
        forward_rs::k_step_n(boxes, acc1, current + 16, b_address);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_registers(acc0);
      sm90::fence_registers(acc1);
      forward_rs::fence_words(next);
      if (s > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
      previous_stage = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
      if (s + 1 < steps) {
        sm90::barrier_wait(&full[stage], phase);
        if (active) decode(next, stage);
      }
    };
    for (int s = 0; s < steps; s += 2) {
      step(frag0, frag1, s);
      if (s + 1 < steps) step(frag1, frag0, s + 1);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_registers(acc0);
    sm90::fence_registers(acc1);
    if (lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
    // Columns n0 + 128 w + 32 (warp % 4) + 4 g .. + 3 (all in or all out: n % 4 == 0), rows
    // m0 + 8 j + 2c + e.
    const int column = tile.n0 + warpgroup * 128 + warp % 4 * 32 + (lane / 4) * 4;
    if (column < p.n) {
#pragma unroll
      for (int j = 0; j < kTokenRows / 8; ++j) {
        if (j >= boxes * (kBox / 8)) break;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = tile.m0 + 8 * j + 2 * c + e;
          if (token >= tile.m_end) continue;
          float v[4] = {p.alpha * acc0[4 * j + e], p.alpha * acc0[4 * j + 2 + e], p.alpha * acc1[4 * j + e],
                        p.alpha * acc1[4 * j + 2 + e]};
          const int64_t offset = static_cast<int64_t>(token) * p.n + column;
          if (p.c_f32) {
            float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.c) + offset);
            if (p.beta != 0.0f) {
              const float4 old = *dst;
              v[0] += p.beta * old.x;
              v[1] += p.beta * old.y;
              v[2] += p.beta * old.z;
              v[3] += p.beta * old.w;
            }
            *dst = make_float4(v[0], v[1], v[2], v[3]);
          } else {
            uint2* dst = reinterpret_cast<uint2*>(static_cast<bf16*>(p.c) + offset);
            if (p.beta != 0.0f) {
              const uint2 old = *dst;
              const float2 o01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old.x));
              const float2 o23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old.y));
              v[0] += p.beta * o01.x;
              v[1] += p.beta * o01.y;
              v[2] += p.beta * o23.x;
              v[3] += p.beta * o23.y;
            }
            const __nv_bfloat162 v01 = __floats2bfloat162_rn(v[0], v[1]), v23 = __floats2bfloat162_rn(v[2], v[3]);
            uint2 out;
            out.x = *reinterpret_cast<const uint32_t*>(&v01);
            out.y = *reinterpret_cast<const uint32_t*>(&v23);
            *dst = out;
          }
        }
      }
    }
  }
}

}  // namespace input_grad_rs

// ---------------------------------------------------------------------------------------------
// The fallback: one thread per output element, F32 sums in order, weights decoded on the fly.

struct FallbackParams {
  void* c;
  int c_f32;
  const bf16* a;
  const uint8_t* packed;
  const uint8_t* scales;
  const int32_t* offsets;
  int64_t groups, rows, n, k;
  int transpose_b;
  float alpha, beta;
};

// Element (row, col) of b viewed as [G * outer, width], packed along width.
__device__ __forceinline__ float mxfp4_element(const uint8_t* packed, const uint8_t* scales, int64_t row, int64_t col,
                                               int64_t width) {
  const uint8_t byte = packed[row * (width / 2) + col / 2];
  const int code = col % 2 == 0 ? byte & 0xf : byte >> 4;
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float value = code & 8 ? -magnitudes[code & 7] : magnitudes[code & 7];
  const int s = scales[row * (width / 32) + col / 32];
  return s == 255 ? __int_as_float(0x7fc00000) : value * ldexpf(1.0f, s - 127);
}

__global__ void mxfp4_fallback_kernel(const FallbackParams p) {
  const int64_t total = p.rows * p.n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.n, j = i % p.n;
    if (r < p.offsets[0] || r >= p.offsets[p.groups]) continue;
    int64_t lo = 0, hi = p.groups;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.offsets[mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (!(p.offsets[lo] <= r && r < p.offsets[lo + 1])) continue;  // offsets out of order
    const bf16* a = p.a + r * p.k;
    float sum = 0.0f;
    for (int64_t q = 0; q < p.k; ++q) {
      const float w = p.transpose_b ? mxfp4_element(p.packed, p.scales, lo * p.n + j, q, p.k)
                                    : mxfp4_element(p.packed, p.scales, lo * p.k + q, j, p.n);
      sum += __bfloat162float(a[q]) * w;
    }
    float v = p.alpha * sum;
    if (p.c_f32) {
      float* c = static_cast<float*>(p.c) + i;
      if (p.beta != 0.0f) v += p.beta * *c;
      *c = v;
    } else {
      bf16* c = static_cast<bf16*>(p.c) + i;
      if (p.beta != 0.0f) v += p.beta * __bfloat162float(*c);
      *c = __float2bfloat16_rn(v);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side (the device queries, tensor map and tile counters as in grouped_gemm.cu)

constexpr int kMaxDevices = 64;

struct DeviceInfo {
  int multiprocessors = 0;
  bool hopper = false;
};

DeviceInfo device_info() {
  static DeviceInfo cache[kMaxDevices];
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  DeviceInfo& info = cache[device % kMaxDevices];
  if (info.multiprocessors == 0) {
    int major = 0, minor = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    info.hopper = major == 9 && minor == 0;
  }
  return info;
}

bool have_sm90a_code() {
  static const bool have = [] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, sm90_grouped_gemm_mxfp4_kernel<true, 64>) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion == 90;
  }();
  return have;
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol, 12000, cudaEnableDefault, &found));
    MOETRAIN_CHECK(found == cudaDriverEntryPointSuccess && symbol != nullptr, ExitCode::kInternal,
                   "grouped_gemm_mxfp4: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiledFn>(symbol);
  }();
  return fn;
}

// A 2-D tensor map: `outer` rows of `inner` elements (row stride inner * element bytes), boxes of
// box_rows x box_inner.
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int element_bytes, int64_t outer, int64_t inner,
                          int box_rows, int box_inner, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                         CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOETRAIN_CHECK(status == CUDA_SUCCESS, ExitCode::kInternal,
                 "grouped_gemm_mxfp4: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(status)) + ")");
  return map;
}

// A's tensor map: [rows, k] BF16, boxes of box_rows x 64 columns, 128-byte swizzle.
CUtensorMap a_tensor_map(const void* a, int64_t rows, int64_t k, int box_rows) {
  return tensor_map_2d(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, k, box_rows, kBK, CU_TENSOR_MAP_SWIZZLE_128B);
}

int* tile_counters(cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int*> counters;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int*& counter = counters[{device, stream}];
  if (counter == nullptr) {
    CUDA_CHECK(cudaMalloc(&counter, 2 * sizeof(int)));
    CUDA_CHECK(cudaMemsetAsync(counter, 0, 2 * sizeof(int), stream));
  }
  return counter;
}

template <bool kKMajorB, int kBN>
size_t shared_bytes(int64_t groups) {
  using T = Tiling<kKMajorB, kBN>;
  return (2 * T::kStages + 2 * kTileSlots) * sizeof(uint64_t) + kTileSlots * sizeof(int) +
         2 * static_cast<size_t>(groups + 1) * sizeof(int) + 1024 +
         static_cast<size_t>(T::kStages) * T::kStageBytes;
}

template <bool kKMajorB, int kBN>
void launch_sm90(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  Params params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.offsets = p.group_offsets;
  params.groups = static_cast<int>(p.groups);
  params.rows = static_cast<int>(p.rows);
  params.n = static_cast<int>(p.n);
  params.k = static_cast<int>(p.k);
  params.n_tiles = static_cast<int>((p.n + kBN - 1) / kBN);
  params.alpha = p.alpha;
  params.beta = p.beta;
  params.tile_counter = tile_counters(stream);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  const CUtensorMap map_a = a_tensor_map(p.a, p.rows, p.k, kBM);
  static bool attribute_set[kMaxDevices] = {};  // per instantiation and device
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!attribute_set[device % kMaxDevices]) {
    CUDA_CHECK(cudaFuncSetAttribute(sm90_grouped_gemm_mxfp4_kernel<kKMajorB, kBN>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kStageBudgetBytes + kTableBudgetBytes + 2048)));
    attribute_set[device % kMaxDevices] = true;
  }
  // Each group adds at most one partial m-tile.
  const int64_t max_tiles = ((p.rows + kBM - 1) / kBM + p.groups) * params.n_tiles;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(device_info().multiprocessors, max_tiles)));
  sm90_grouped_gemm_mxfp4_kernel<kKMajorB, kBN>
      <<<grid, kThreads, shared_bytes<kKMajorB, kBN>(p.groups), stream>>>(map_a, params);
  CUDA_CHECK_LAUNCH();
}

// The forward kernel: b [G, n, k / 2] seen as [G * n, k / 2] bytes, boxes of 128 rows x 32 bytes
// (one K step), unswizzled; k % 32 == 0 keeps the row stride a multiple of 16 bytes.
void launch_forward_rs(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  using namespace forward_rs;
  Params params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.offsets = p.group_offsets;
  params.groups = static_cast<int>(p.groups);
  params.rows = static_cast<int>(p.rows);
  params.n = static_cast<int>(p.n);
  params.k = static_cast<int>(p.k);
  params.n_tiles = static_cast<int>((p.n + kWeightRows - 1) / kWeightRows);
  params.alpha = p.alpha;
  params.beta = p.beta;
  params.tile_counter = tile_counters(stream);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  const CUtensorMap map_a = a_tensor_map(p.a, p.rows, p.k, kBox);
  const CUtensorMap map_w = tensor_map_2d(p.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.groups * p.n, p.k / 2, kWeightRows,
                                          kBK / 2, CU_TENSOR_MAP_SWIZZLE_NONE);
  static bool attribute_set[kMaxDevices] = {};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!attribute_set[device % kMaxDevices]) {
    CUDA_CHECK(cudaFuncSetAttribute(sm90_mxfp4_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kStageBudgetBytes + kTableBudgetBytes + 2048)));
    attribute_set[device % kMaxDevices] = true;
  }
  const size_t shared = (2 * kStages + 2 * kTileSlots) * sizeof(uint64_t) + kTileSlots * sizeof(int) +
                        2 * static_cast<size_t>(p.groups + 1) * sizeof(int) + 1024 +
                        static_cast<size_t>(kStages) * (kABytes + kWBytes);
  const int64_t max_tiles = ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * params.n_tiles;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(device_info().multiprocessors, max_tiles)));
  sm90_mxfp4_forward_kernel<<<grid, forward_rs::kThreads, shared, stream>>>(map_a, map_w, params);
  CUDA_CHECK_LAUNCH();
}

// The input-gradient kernel: b [G, k, n / 2] as a 3-D map (rows past a group's k arrive as
// zeros), boxes of 64 rows x 128 bytes, 128-byte swizzle.
void launch_input_grad_rs(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  using namespace input_grad_rs;
  Params params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.offsets = p.group_offsets;
  params.groups = static_cast<int>(p.groups);
  params.rows = static_cast<int>(p.rows);
  params.n = static_cast<int>(p.n);
  params.k = static_cast<int>(p.k);
  params.n_tiles = static_cast<int>((p.n + kColumns - 1) / kColumns);
  params.alpha = p.alpha;
  params.beta = p.beta;
  params.tile_counter = tile_counters(stream);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  const CUtensorMap map_a = a_tensor_map(p.a, p.rows, p.k, kBox);
  CUtensorMap map_w;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.n / 2), static_cast<cuuint64_t>(p.k),
                              static_cast<cuuint64_t>(p.groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.n / 2), static_cast<cuuint64_t>(p.k * (p.n / 2))};
  const cuuint32_t box[3] = {kColumns / 2, kBK, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status = encode_tiled()(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(p.b), dims,
                                         strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOETRAIN_CHECK(status == CUDA_SUCCESS, ExitCode::kInternal,
                 "grouped_gemm_mxfp4: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(status)) + ")");
  static bool attribute_set[kMaxDevices] = {};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!attribute_set[device % kMaxDevices]) {
    CUDA_CHECK(cudaFuncSetAttribute(sm90_mxfp4_input_grad_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kStageBudgetBytes + kTableBudgetBytes + 2048)));
    attribute_set[device % kMaxDevices] = true;
  }
  const size_t shared = (2 * kStages + 2 * kTileSlots) * sizeof(uint64_t) + kTileSlots * sizeof(int) +
                        2 * static_cast<size_t>(p.groups + 1) * sizeof(int) + 1024 +
                        static_cast<size_t>(kStages) * kStageBytes;
  const int64_t max_tiles = ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * params.n_tiles;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(device_info().multiprocessors, max_tiles)));
  sm90_mxfp4_input_grad_kernel<<<grid, input_grad_rs::kThreads, shared, stream>>>(map_a, map_w, params);
  CUDA_CHECK_LAUNCH();
}

template <bool kKMajorB>
void launch_sm90_bn(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  if (p.n <= 64) {
    launch_sm90<kKMajorB, 64>(p, b_scale, stream);
  } else {
    launch_sm90<kKMajorB, kMaxBN>(p, b_scale, stream);
  }
}

void launch_fallback(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  FallbackParams params{};
  params.c = p.c;
  params.c_f32 = p.c_dtype == DType::kF32;
  params.a = static_cast<const bf16*>(p.a);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  params.offsets = p.group_offsets;
  params.groups = p.groups;
  params.rows = p.rows;
  params.n = p.n;
  params.k = p.k;
  params.transpose_b = p.transpose_b ? 1 : 0;
  params.alpha = p.alpha;
  params.beta = p.beta;
  constexpr int kFallbackThreads = 256;
  mxfp4_fallback_kernel<<<grid_for(p.rows * p.n, kFallbackThreads), kFallbackThreads, 0, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

GroupedGemmPath grouped_gemm_mxfp4_path(const GroupedGemmProblem& p, const void* b_scale) {
  (void)b_scale;  // read a byte at a time: any alignment
  const bool shapes = p.kind == GroupedGemmKind::kMGrouped && p.k > 0 && p.k % 8 == 0 && p.n % 8 == 0;
  const bool fits = std::max({p.rows, p.n, p.k}) < (int64_t{1} << 30) && p.groups * 2 * 4 + 8 <= kTableBudgetBytes &&
                    ((p.rows + kBM - 1) / kBM + p.groups) * ((p.n + 63) / 64) < (int64_t{1} << 30) &&
                    p.groups * std::max(p.n, p.k) < (int64_t{1} << 31);
  const bool aligned = aligned_16(p.a) && aligned_16(p.b) && aligned_16(p.c);
  if (shapes && fits && aligned && device_info().hopper && have_sm90a_code()) return GroupedGemmPath::kSm90;
  return GroupedGemmPath::kFallback;
}

void launch_grouped_gemm_mxfp4(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  if (p.groups == 0 || p.rows == 0 || p.n == 0) return;
  if (grouped_gemm_mxfp4_path(p, b_scale) == GroupedGemmPath::kFallback) {
    launch_fallback(p, b_scale, stream);  // also k == 0: c = beta * c
    return;
  }
  if (p.transpose_b && p.k % 32 == 0) {
    launch_forward_rs(p, b_scale, stream);
  } else if (p.transpose_b) {
    launch_sm90_bn<true>(p, b_scale, stream);
  } else if (p.n % input_grad_rs::kColumns == 0 && reinterpret_cast<uintptr_t>(b_scale) % 4 == 0) {
    launch_input_grad_rs(p, b_scale, stream);
  } else {
    launch_sm90_bn<false>(p, b_scale, stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
