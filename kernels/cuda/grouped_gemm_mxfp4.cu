// The MXFP4 grouped GEMM (see grouped_gemm_mxfp4.h): a Hopper kernel and a plain fallback.
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
__device__ void build_group_table(const Params& p, GroupTable table, int lane) {
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
    const int count = g < p.groups ? (table.rows[g + 1] - table.rows[g] + kBM - 1) / kBM * p.n_tiles : 0;
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
  int m0, m_end;  // rows [m0, min(m0 + 128, m_end)) of c
  int n0;
  int k_steps;
};

template <int kBN>
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
  const int m_tiles = (row_end - row0 + kBM - 1) / kBM;
  tile.m0 = row0 + local % m_tiles * kBM;
  tile.m_end = row_end;
  tile.n0 = local / m_tiles * kBN;
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
  if (warp == 1) build_group_table(p, table, lane);
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
      const Tile tile = decode_tile<kBN>(t, p, table);
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
    const Tile tile = decode_tile<kBN>(t, p, table);
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

// A's tensor map: [rows, k] BF16, boxes of 128 rows x 64 columns, 128-byte swizzle.
CUtensorMap a_tensor_map(const void* a, int64_t rows, int64_t k) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {kBK, kBM};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(a), dims, strides,
                                         box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOETRAIN_CHECK(status == CUDA_SUCCESS, ExitCode::kInternal,
                 "grouped_gemm_mxfp4: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(status)) + ")");
  return map;
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
  const CUtensorMap map_a = a_tensor_map(p.a, p.rows, p.k);
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
  if (p.transpose_b) {
    launch_sm90_bn<true>(p, b_scale, stream);
  } else {
    launch_sm90_bn<false>(p, b_scale, stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
