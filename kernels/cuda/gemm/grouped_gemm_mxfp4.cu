// The MXFP4 grouped GEMM (see grouped_gemm_mxfp4.h): a Hopper kernel and a plain fallback.
//
// grouped_gemm_sm90_mxfp4_kernel<kInputGrad> computes c^T = W . a^T: the expert weight is wgmma's A operand,
// from registers, and the activations (x, or dy for the input gradient) its B operand, from shared
// memory. The M of a tile is 128 of W's output rows (the columns of c; two consumer warpgroups x
// 64), its N up to 256 rows of one group, the group's rows rounded up to 32: a K3 expert (~146
// rows) is one tile of N = 160 (wgmma_bf16_sm90.cuh, WgmmaRsPrefix: every N accumulates into the same
// registers). K steps of 64. N is chosen once per tile and the K loop, decode included, is
// compiled for each of the 8 values: choosing before every K step cost 6-25% at K3's shapes (H200).
//   Tiles are listed by group, then 128-column block, then 256-row block and handed out in that
//   order through a device counter (grouped_gemm_common_sm90.cuh, as grouped_gemm_sm90.cu: the tiles in
//   flight share W[g] and rows of a in L2); the per-group table is built from the device offsets. Rows past a group's end are
//   computed from the next group's rows (or TMA zeros) and never stored; so are W's rows past n.
//   Warpgroup 0, the producer (40 registers):
//     - thread 0 issues the TMA copies of a stage: the packed W tile (4 KB: the forward's
//       b [G, n, k / 2] as [G * n, k / 2] bytes, 128 rows x 32 bytes; the input gradient's
//       b [G, k, n / 2] as 3-D, 64 k rows x 64 bytes, 64-byte swizzle, k rows past the group's
//       arriving as zeros) and a's rows in boxes of 32 x 64 (128-byte swizzle, the K-major B).
//       Input gradient with n % 512 == 0: also the stage's scale bytes, 64 k rows x 16 groups.
//     - warps 1 and 2 convert the stage's E8M0 scales (from that TMA box, else byte loads from
//       global memory) to BF16 in the order the consumers read them, then arrive on the stage's
//       'full' barrier beside the TMA.
//   Warpgroups 1 and 2, the consumers (232 registers): each thread decodes, per K step, its 16
//   A-fragment registers (rows g and g + 8 of its warp's 16, k pairs (2c, 2c + 1) and
//   (2c + 8, 2c + 9) of each k16, g = lane / 4, c = lane % 4) straight from the packed tile while
//   the wgmmas of the previous K step run (two fragment sets; wait_group 1 after issuing step s
//   frees step s - 1's registers and stage):
//     - forward: a fragment row is a W row; its k pairs are byte c of each 4-byte word of the
//       row's 32 bytes: two 16-byte loads per row, a byte permute per k16.
//     - input gradient: a fragment row is a W column, whose codes are nibbles of bytes along n.
//       ldmatrix.x4.trans in 16-bit units (4 columns) gives a thread columns 4g .. 4g + 3 of a
//       32-column chunk at k rows 2c, 2c + 1 of each 8-row matrix: wgmma's k pairs. The chunk's
//       two warps each take two of the four (warp parity e: columns 4g + 2e, 4g + 2e + 1 are
//       fragment rows g, g + 8), a byte permute and decode4's strided pairs give each column's
//       k pairs.
//       The scales differ along K, so each register has its own pair.
//     decode4: E2M1 magnitudes by byte permutes from 8-entry tables, the sign by a permute's
//     sign-replicate mode, then a bf16x2 multiply by the power-of-two scale (exact).
//   c is written from the accumulators: forward transposed (lanes g and g ^ 1 trade one value so
//   each stores two adjacent columns of one row); input gradient directly (fragment rows g, g + 8
//   are adjacent columns).
#include "kernels/cuda/gemm/grouped_gemm_mxfp4.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"
#include "kernels/cuda/common/primitives_sm90.cuh"
#include "kernels/cuda/common/warp_mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_bf16_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;
namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;
using grouped::GroupTable;
using grouped::kAllLanes;
using grouped::kBK;  // one 128-byte swizzle row of BF16 activations
using grouped::kConsumerRegisters;
using grouped::kProducerRegisters;
using grouped::kTileSlots;

constexpr int kWeightRows = 128;   // W rows (columns of c) per tile: two consumer warpgroups x 64
constexpr int kTokenRows = 256;    // rows of a per tile at most: wgmma's largest N
constexpr int kBox = 32;           // rows of a per TMA box, and the step of N
constexpr int kThreads = 128 * 3;  // the producer warpgroup and two consumers
constexpr int kABytes = kTokenRows * kBK * 2;
constexpr int kBoxBytes = kBox * kBK * 2;
constexpr int kWBytes = kWeightRows * kBK / 2;
constexpr int kSBytes = 1024;  // a stage's scales as BF16: 256 words
// Input gradient with TMA scales: a stage's E8M0 bytes as copied, 64 k rows x 16 groups.
constexpr int kRawGroups = 16;
constexpr int kRawBytes = kBK * kRawGroups;
// A stage: a, W, the scale words and (input gradient) the raw scale bytes.
template <bool kInputGrad>
struct StageLayout {
  static constexpr int kBytes = kABytes + kWBytes + kSBytes + (kInputGrad ? kRawBytes : 0);
  static constexpr int kCount = grouped::stage_count(kBytes);
  static_assert(kCount >= 3, "too few stages to overlap loads with the math");
};
constexpr int kConverters = 64;  // threads 32 .. 95: the scale converters
// Input gradient: a stage's scale words per c (4 chunks x 8 k pairs), + 4 so the four c's of a
// warp's 16-byte loads fall in different banks.
constexpr int kScaleStride = 36;
static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0 && kSBytes % 1024 == 0 && kRawBytes % 1024 == 0,
              "stages on whole swizzle patterns");
static_assert(4 * kScaleStride * 4 <= kSBytes && 2 * kWeightRows * 4 <= kSBytes, "a stage's scale words");

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
  int scale_tma;          // input gradient: the scales arrive by TMA (map_s), not by loads
};

struct Tile {
  int group;
  int m0, m_end;  // rows [m0, min(m0 + tile rows, m_end)) of c
  int n0;
  int k_steps;
};

__device__ __forceinline__ Tile decode_tile(int t, const Params& p, GroupTable table) {
  Tile tile;
  grouped::locate_m_grouped_tile<kTokenRows, kWeightRows>(t, p.groups, table, tile);
  tile.k_steps = (p.k + kBK - 1) / kBK;
  return tile;
}


__device__ __forceinline__ int boxes_of(const Tile& tile) {
  return (min(kTokenRows, tile.m_end - tile.m0) + kBox - 1) / kBox;
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

// The E8M0 scale 2^(s - 127) as BF16 bits (s = 0: the subnormal 2^-127; 255: NaN).
__device__ __forceinline__ uint32_t scale_bits(uint32_t s) { return s == 0 ? 0x0040u : s == 255 ? 0x7FC0u : s << 7; }

// 4 codes (the low 16 bits of `codes`: nibble i is value i) to BF16 pairs times `scale` (a pair
// of powers of two): (v0, v1) and (v2, v3), or with kStrided (v0, v2) and (v1, v3). The sign: a
// selector nibble with bit 3 set replicates the chosen byte's top bit (0x80: 0xFF), otherwise
// copies it (0x80); shifted left, bit 7 tells.
template <bool kStrided>
__device__ __forceinline__ void decode4(uint32_t codes, uint32_t scale, uint32_t& v01, uint32_t& v23) {
  const uint32_t magnitudes = codes & 0x7777u;
  const uint32_t high = byte_permute(kHighBytes0, kHighBytes1, magnitudes) |
                        ((byte_permute(0x80808080u, 0x80808080u, codes) << 1) & 0x80808080u);
  const uint32_t low = byte_permute(kLowBytes0, kLowBytes1, magnitudes);
  // Value i is byte i of `low` (selector nibble i) and of `high` (4 + i).
  uint32_t pair[2] = {byte_permute(low, high, kStrided ? 0x6240u : 0x5140u),
                      byte_permute(low, high, kStrided ? 0x7351u : 0x7362u)};
  const __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&scale);
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[0]), s);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[1]), s);
  v01 = *reinterpret_cast<const uint32_t*>(&a);
  v23 = *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  sm80::ldmatrix_x4_trans(r, address);
#else
  __trap();
#endif
}

template <int kCount>
__device__ __forceinline__ void fence_words(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// One K step (four k16) of a warpgroup: acc (64 x kN) += fragment f . B tile.
template <int kN>
__device__ __forceinline__ void k_step(float (&acc)[128], const uint32_t (&f)[16], uint32_t b_address) {
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t desc_b = sm90::matrix_descriptor(b_address + kk * 32, 16, 1024, sm90::swizzle_code(128));
    sm90::WgmmaRsPrefix<kN>::mma(acc, f[4 * kk], f[4 * kk + 1], f[4 * kk + 2], f[4 * kk + 3], desc_b);
  }
}

// The thread's accumulators into c. Accumulator 4 j + 2 h + e is fragment row g + 8 h, token
// 8 j + 2c + e. Forward: fragment row = column `column0` + 8 h (grouped::store_rows_as_n). Input
// gradient: fragment rows g and g + 8 are columns `column0` and `column0` + 1.
template <bool kInputGrad, typename OutT>
__device__ __forceinline__ void store_tile(const float (&acc)[128], const Params& p, const Tile& tile, int boxes,
                                           int column0, int lane) {
  if constexpr (kInputGrad) {
    if (column0 >= p.n) return;
    const int c = lane % 4;
#pragma unroll
    for (int j = 0; j < kTokenRows / 8; ++j) {
      if (j >= boxes * (kBox / 8)) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = tile.m0 + 8 * j + 2 * c + e;
        if (token < tile.m_end) {
          OutT* out = static_cast<OutT*>(p.c) + static_cast<int64_t>(token) * p.n + column0;
          grouped::store_pair(out, acc[4 * j + e] * p.alpha, acc[4 * j + 2 + e] * p.alpha, p.beta);
        }
      }
    }
  } else {
    grouped::store_rows_as_n<OutT, kTokenRows>(acc, p, tile, boxes * kBox, column0, lane);
  }
}

// Converter i's share of one K step's scales: four E8M0 bytes, written as BF16 into the stage's
// words (store_scales) in the order the consumers read them. They come from global memory
// (load_scales, issued two K steps ahead), or for the input gradient when n % 512 == 0 from the
// stage's raw bytes (raw_scales): thread 0 copies the step's 64 k rows x 16 groups (the tile's 4
// and their neighbours: TMA boxes are whole 16-byte pieces) by TMA with the stage's other loads,
// so their latency hides behind the whole ring instead of two K steps (each k row is a new L2
// line: the input gradient's scales are L1 misses, the forward's L1 hits).
//   Forward: W rows 2i, 2i + 1 of the tile, groups 2s, 2s + 1: word 2 row + group holds the
//     scale twice (both halves of a fragment register share it).
//   Input gradient: k rows 2 pr, 2 pr + 1 (pr = i / 2) of the step, chunks 2 (i % 2) and + 1:
//     word c * kScaleStride + chunk * 8 + j (c = pr % 4, j = pr / 4) holds (scale of k row 2 pr,
//     of 2 pr + 1), the pair a fragment register of consumer lane c, k16 j / 2, half j % 2 needs.
// Missing scales (rows past n or k, groups past the row) read as 1: their codes are zeros or
// their products are never stored.
struct ScaleBytes {
  uint32_t b[2][2];
};

template <bool kInputGrad>
__device__ __forceinline__ ScaleBytes load_scales(const Params& p, const Tile& tile, int s, int i) {
  const int group_words = (kInputGrad ? p.n : p.k) / 32;
  ScaleBytes out;
#pragma unroll
  for (int d = 0; d < 2; ++d) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // Input gradient: d the k row, e the chunk. Forward: d the W row, e the group.
      const int outer = kInputGrad ? s * kBK + 2 * (i / 2) + d : tile.n0 + 2 * i + d;
      const int group = kInputGrad ? tile.n0 / 32 + (i % 2) * 2 + e : 2 * s + e;
      const bool valid = outer < (kInputGrad ? p.k : p.n) && group < group_words;
      const int64_t at =
          (static_cast<int64_t>(tile.group) * (kInputGrad ? p.k : p.n) + outer) * group_words + group;
      out.b[d][e] = valid ? __ldg(p.scales + at) : 127u;
    }
  }
  return out;
}

// Input gradient, TMA scales: the bytes load_scales<true> reads, from the stage's raw box
// (row r, group column x at r * kRawGroups + x; k rows past k arrive as zeros, read as scale 2^-127:
// their codes are zeros too). The tile's 4 groups start at column (n0 / 32) % 16, a multiple of
// 4: each k row's two chunk bytes are one aligned 16-bit load.
__device__ __forceinline__ ScaleBytes raw_scales(const unsigned char* raw, const Tile& tile, int i) {
  const unsigned char* at = raw + 2 * (i / 2) * kRawGroups + (tile.n0 / 32) % kRawGroups + 2 * (i % 2);
  ScaleBytes out;
#pragma unroll
  for (int d = 0; d < 2; ++d) {
    const uint32_t two = *reinterpret_cast<const uint16_t*>(at + d * kRawGroups);
    out.b[d][0] = two & 0xFFu;
    out.b[d][1] = two >> 8;
  }
  return out;
}

template <bool kInputGrad>
__device__ __forceinline__ void store_scales(uint32_t* words, const ScaleBytes& in, int i) {
  if constexpr (kInputGrad) {
    const int pr = i / 2;
    uint32_t* out = words + (pr % 4) * kScaleStride + (i % 2) * 2 * 8 + pr / 4;
    out[0] = scale_bits(in.b[0][0]) | scale_bits(in.b[1][0]) << 16;
    out[8] = scale_bits(in.b[0][1]) | scale_bits(in.b[1][1]) << 16;
  } else {
    uint32_t bits[2][2];
#pragma unroll
    for (int d = 0; d < 2; ++d) {
#pragma unroll
      for (int e = 0; e < 2; ++e) bits[d][e] = scale_bits(in.b[d][e]) * 0x10001u;
    }
    *reinterpret_cast<uint4*>(words + 4 * i) = make_uint4(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
  }
}

template <bool kInputGrad>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_mxfp4_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                      const __grid_constant__ CUtensorMap map_s, const Params p) {
  constexpr int kStages = StageLayout<kInputGrad>::kCount;
  extern __shared__ __align__(1024) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + kStages;
  uint64_t* raw_full = empty + kStages;  // the raw scale bytes landed (input gradient, TMA scales)
  uint64_t* tile_full = raw_full + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_slot = reinterpret_cast<int*>(tile_empty + kTileSlots);
  GroupTable table{tile_slot + kTileSlots, nullptr};
  table.tiles = table.rows + p.groups + 1;
  const uintptr_t table_end = reinterpret_cast<uintptr_t>(table.tiles + p.groups + 1);
  unsigned char* a_stages = reinterpret_cast<unsigned char*>((table_end + 1023) & ~uintptr_t{1023});
  unsigned char* w_stages = a_stages + kStages * kABytes;
  unsigned char* s_stages = w_stages + kStages * kWBytes;
  unsigned char* raw_stages = s_stages + kStages * kSBytes;  // input gradient only

  // Warp-uniform in the compiler's eyes too (a broadcast), so the wgmma paths are not divergent.
  const int warp = __shfl_sync(kAllLanes, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::barrier_init(&full[s], 1 + kConverters);  // thread 0's arrival arming the TMA bytes, the converters'
      sm90::barrier_init(&empty[s], 2 * 4);           // lane 0 of every consumer warp
      sm90::barrier_init(&raw_full[s], 1);            // thread 0 arming the raw scale bytes
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::barrier_init(&tile_full[s], 1);
      sm90::barrier_init(&tile_empty[s], 2 * 4 + kConverters / 32);  // consumer and converter warps
    }
    sm90::fence_barrier_init();
  }
  if (warp == 1) grouped::build_group_table<kTokenRows, true>(p, table, lane);
  __syncthreads();
  const int total_tiles = table.tiles[p.groups];
  int stage = 0, slot = 0;
  uint32_t phase = 0, slot_phase = 0;
  // Consumers and converters: the next tile index from the ring thread 0 fills.
  auto next_tile = [&]() {
    sm90::barrier_wait(&tile_full[slot], slot_phase);
    const int t = __shfl_sync(kAllLanes, tile_slot[slot], 0);
    __syncwarp();
    if (lane == 0) sm90::barrier_arrive(&tile_empty[slot]);
    if (++slot == kTileSlots) {
      slot = 0;
      slot_phase ^= 1;
    }
    return t;
  };
  auto advance = [&]() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  };

  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x == 0) {
      sm90::tma_prefetch_descriptor(&map_a);
      sm90::tma_prefetch_descriptor(&map_w);
      if (kInputGrad && p.scale_tma) sm90::tma_prefetch_descriptor(&map_s);
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
        const Tile tile = decode_tile(t, p, table);
        const int boxes = boxes_of(tile);
        for (int s = 0; s < tile.k_steps; ++s) {
          sm90::barrier_wait(&empty[stage], phase ^ 1);
          if (kInputGrad && p.scale_tma) {  // first: the converters wait for these bytes
            sm90::barrier_arrive_expect_bytes(&raw_full[stage], kRawBytes);
            sm90::tma_load_3d(raw_stages + stage * kRawBytes, &map_s, &raw_full[stage],
                              tile.n0 / 32 / kRawGroups * kRawGroups, s * kBK, tile.group);
          }
          sm90::barrier_arrive_expect_bytes(&full[stage], kWBytes + boxes * kBoxBytes);
          if constexpr (kInputGrad) {
            sm90::tma_load_3d(w_stages + stage * kWBytes, &map_w, &full[stage], tile.n0 / 2, s * kBK, tile.group);
          } else {
            sm90::tma_load_2d(w_stages + stage * kWBytes, &map_w, &full[stage], s * kBK / 2,
                              tile.group * p.n + tile.n0);
          }
          for (int b = 0; b < boxes; ++b) {
            sm90::tma_load_2d(a_stages + stage * kABytes + b * kBoxBytes, &map_a, &full[stage], s * kBK,
                              tile.m0 + b * kBox);
          }
          advance();
        }
      }
      grouped::release_tile_counter(p.tile_counter);
    } else if (warp == 1 || warp == 2) {
      const int i = threadIdx.x - 32;
      for (;;) {
        const int t = next_tile();
        if (t >= total_tiles) break;
        const Tile tile = decode_tile(t, p, table);
        if (kInputGrad && p.scale_tma) {
          // raw_full's phase completing means thread 0 saw the stage empty: the words are free.
          for (int s = 0; s < tile.k_steps; ++s) {
            sm90::barrier_wait(&raw_full[stage], phase);
            const ScaleBytes current = raw_scales(raw_stages + stage * kRawBytes, tile, i);
            store_scales<kInputGrad>(reinterpret_cast<uint32_t*>(s_stages + stage * kSBytes), current, i);
            sm90::barrier_arrive(&full[stage]);
            advance();
          }
          continue;
        }
        ScaleBytes next = load_scales<kInputGrad>(p, tile, 0, i), after = next;
        if (tile.k_steps > 1) after = load_scales<kInputGrad>(p, tile, 1, i);
        for (int s = 0; s < tile.k_steps; ++s) {
          const ScaleBytes current = next;
          next = after;
          if (s + 2 < tile.k_steps) after = load_scales<kInputGrad>(p, tile, s + 2, i);
          sm90::barrier_wait(&empty[stage], phase ^ 1);
          store_scales<kInputGrad>(reinterpret_cast<uint32_t*>(s_stages + stage * kSBytes), current, i);
          sm90::barrier_arrive(&full[stage]);
          advance();
        }
      }
    }
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int warpgroup = warp / 4 - 1, warp_in_group = warp % 4;
  const int g = lane / 4, c = lane % 4;
  // Forward: the thread's W rows in the tile (fragment rows g, g + 8). Input gradient: its
  // 32-column chunk of the tile's 128 columns, its half e of it, and its first column.
  const int row = warpgroup * 64 + warp_in_group * 16 + g;
  const int chunk = warpgroup * 2 + warp_in_group / 2, half = warp_in_group % 2;
  const int column0 = kInputGrad ? chunk * 32 + 4 * g + 2 * half : row;
  // Forward: byte c of two words. Input gradient: bytes e and 2 + e of two words (a ldmatrix
  // register holds k row 2c's bytes 2g, 2g + 1, then k row 2c + 1's), and the ldmatrix row of
  // this lane (k row 32 q + lane; 64-byte swizzle: unit u of row r at u ^ ((r / 2) % 4)).
  const uint32_t selector = kInputGrad ? (half ? 0x7531u : 0x6420u) : (c | (c + 4) << 4);
  const uint32_t ldmatrix_offset = lane * 64 + ((chunk ^ ((lane / 2) % 4)) << 4);
  float acc[128];
  uint32_t frag0[16], frag1[16];
  auto decode = [&](uint32_t (&f)[16], int st) {
    const unsigned char* scales = s_stages + st * kSBytes;
    if constexpr (kInputGrad) {
      uint32_t x[2][4];
      const uint32_t w_base = sm90::smem_address(w_stages + st * kWBytes) + ldmatrix_offset;
      ldmatrix_x4_trans(x[0], w_base);
      ldmatrix_x4_trans(x[1], w_base + 32 * 64);
      const uint4* pairs = reinterpret_cast<const uint4*>(scales + (c * kScaleStride + chunk * 8) * 4);
      const uint4 p0 = pairs[0], p1 = pairs[1];
      const uint32_t scale[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        // Registers 2 kk and 2 kk + 1: k rows 16 kk + 2c (+ 1) and 16 kk + 8 + 2c (+ 1). Per 16
        // bits, the nibbles are (k even: column lo, hi; k odd: lo, hi): decode4's strided pairs
        // are each column's (k even, k odd).
        const uint32_t codes = byte_permute(x[kk / 2][(kk % 2) * 2], x[kk / 2][(kk % 2) * 2 + 1], selector);
        decode4<true>(codes, scale[2 * kk], f[4 * kk], f[4 * kk + 1]);
        decode4<true>(codes >> 16, scale[2 * kk + 1], f[4 * kk + 2], f[4 * kk + 3]);
      }
    } else {
      const unsigned char* w = w_stages + st * kWBytes + row * 32;
      const uint4 r0 = *reinterpret_cast<const uint4*>(w);
      const uint4 r1 = *reinterpret_cast<const uint4*>(w + 16);
      const uint4 r2 = *reinterpret_cast<const uint4*>(w + 8 * 32);
      const uint4 r3 = *reinterpret_cast<const uint4*>(w + 8 * 32 + 16);
      const uint32_t words0[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
      const uint32_t words1[8] = {r2.x, r2.y, r2.z, r2.w, r3.x, r3.y, r3.z, r3.w};
      const uint2 s0 = *reinterpret_cast<const uint2*>(scales + row * 8);  // row g: groups 2s, 2s + 1
      const uint2 s1 = *reinterpret_cast<const uint2*>(scales + (row + 8) * 8);
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        decode4<false>(byte_permute(words0[2 * kk], words0[2 * kk + 1], selector), kk < 2 ? s0.x : s0.y, f[4 * kk],
                       f[4 * kk + 2]);
        decode4<false>(byte_permute(words1[2 * kk], words1[2 * kk + 1], selector), kk < 2 ? s1.x : s1.y,
                       f[4 * kk + 1], f[4 * kk + 3]);
      }
    }
  };
  for (;;) {
    const int t = next_tile();
    if (t >= total_tiles) break;
    const Tile tile = decode_tile(t, p, table);
    const int boxes = boxes_of(tile);
    const int steps = tile.k_steps;
    // A warpgroup whose 64 rows (columns of c) all lie past n decodes and multiplies nothing.
    const bool active = tile.n0 + warpgroup * 64 < p.n;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    sm90::barrier_wait(&full[stage], phase);
    if (active) decode(frag0, stage);
    int previous_stage = stage;
    // wgmma's N is chosen once per tile, with the K loop compiled for each (as the BF16 kernel);
    // the last step's wgmmas complete inside each copy (see grouped_gemm_sm90.cu, run_k_steps).
    grouped::with_row_boxes(active ? boxes : 1, [&](auto n) {
      auto step = [&](uint32_t (&current)[16], uint32_t (&next)[16], int s) {
        sm90::fence_registers(acc);
        fence_words(current);
        sm90::wgmma_fence();
        if (active) k_step<decltype(n)::value>(acc, current, sm90::smem_address(a_stages + stage * kABytes));
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();  // step s - 1 is done: its registers and stage are free
        sm90::fence_registers(acc);
        fence_words(next);
        if (s > 0 && lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
        previous_stage = stage;
        advance();
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
      sm90::fence_registers(acc);
    });
    if (lane == 0) sm90::barrier_arrive(&empty[previous_stage]);
    if (p.c_f32) {
      store_tile<kInputGrad, float>(acc, p, tile, boxes, tile.n0 + column0, lane);
    } else {
      store_tile<kInputGrad, bf16>(acc, p, tile, boxes, tile.n0 + column0, lane);
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
    grouped::store_output(p, i, sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

constexpr const char* kOp = "grouped_gemm_mxfp4";  // names this file's errors

// A 2-D tensor map: `outer` rows of `inner` elements (row stride inner * element bytes), boxes of
// box_rows x box_inner.
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int element_bytes, int64_t outer, int64_t inner,
                          int box_rows, int box_inner, CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows)};
  return grouped::encode_map(kOp, type, 2, base, dims, strides, box, swizzle);
}

// A's tensor map: [rows, k] BF16, boxes of box_rows x 64 columns, 128-byte swizzle.
CUtensorMap a_tensor_map(const void* a, int64_t rows, int64_t k, int box_rows) {
  return tensor_map_2d(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, k, box_rows, kBK, CU_TENSOR_MAP_SWIZZLE_128B);
}

// W's tensor map. Forward: b [G, n, k / 2] as [G * n, k / 2] bytes, boxes of 128 rows x 32 bytes
// (one K step), unswizzled: the consumers' 16-byte loads meet at most 2-way bank conflicts.
// Input gradient: b [G, k, n / 2] as 3-D (k rows past a group's arrive as zeros), boxes of 64 k
// rows x 64 bytes (128 columns), 64-byte swizzle for the conflict-free ldmatrix. The packed
// dimension is whole groups of 32, so the row stride is a multiple of 16 bytes.
CUtensorMap w_tensor_map(const GroupedGemmProblem& p) {
  const bool input_grad = !p.transpose_b;
  const int64_t outer = input_grad ? p.k : p.n, row_bytes = (input_grad ? p.n : p.k) / 2;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(input_grad ? outer : p.groups * outer),
                              static_cast<cuuint64_t>(input_grad ? p.groups : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(row_bytes * outer)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(input_grad ? kWeightRows / 2 : kBK / 2),
                             static_cast<cuuint32_t>(input_grad ? kBK : kWeightRows), 1};
  return grouped::encode_map(kOp, CU_TENSOR_MAP_DATA_TYPE_UINT8, input_grad ? 3 : 2, p.b, dims, strides, box,
                             input_grad ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE);
}

// The input gradient's scales [G, k, n / 32] bytes as 3-D (k rows past a group's arrive as zeros),
// boxes of 64 k rows x 16 bytes, when TMA can take them: rows a multiple of 16 bytes (n % 512 == 0,
// so a 128-column tile's 4 groups never straddle two boxes), 16-byte aligned. Otherwise false and
// the converters load the bytes themselves.
bool scale_tensor_map(const GroupedGemmProblem& p, const void* b_scale, CUtensorMap* map) {
  const int64_t row_bytes = p.n / 32;
  if (p.transpose_b || row_bytes % kRawGroups != 0 || reinterpret_cast<uintptr_t>(b_scale) % 16 != 0) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(p.k),
                              static_cast<cuuint64_t>(p.groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(row_bytes * p.k)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kRawGroups), static_cast<cuuint32_t>(kBK), 1};
  *map = grouped::encode_map(kOp, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, b_scale, dims, strides, box,
                             CU_TENSOR_MAP_SWIZZLE_NONE);
  return true;
}

template <bool kInputGrad>
void launch_sm90(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  using Stages = StageLayout<kInputGrad>;
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
  params.tile_counter = grouped::tile_counters(stream);
  params.packed = static_cast<const uint8_t*>(p.b);
  params.scales = static_cast<const uint8_t*>(b_scale);
  const CUtensorMap map_a = a_tensor_map(p.a, p.rows, p.k, kBox);
  const CUtensorMap map_w = w_tensor_map(p);
  CUtensorMap map_s{};  // unused unless params.scale_tma
  params.scale_tma = scale_tensor_map(p, b_scale, &map_s) ? 1 : 0;
  grouped::allow_shared_memory<grouped_gemm_sm90_mxfp4_kernel<kInputGrad>>();
  // Barriers per stage: full, empty and raw_full.
  const size_t shared = grouped::shared_bytes(3, Stages::kCount, Stages::kBytes, p.groups);
  // Each group adds at most one partial row block.
  const int64_t max_tiles = ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * params.n_tiles;
  grouped_gemm_sm90_mxfp4_kernel<kInputGrad><<<grouped::persistent_grid(max_tiles), kThreads, shared, stream>>>(map_a, map_w, map_s,
                                                                                                  params);
  CUDA_CHECK_LAUNCH();
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

}  // namespace

GroupedGemmPath grouped_gemm_mxfp4_path(const GroupedGemmProblem& p, const void* b_scale) {
  (void)b_scale;  // read a byte at a time: any alignment
  const bool shapes = p.kind == GroupedGemmKind::kMGrouped && p.k > 0 && p.k % 8 == 0 && p.n % 8 == 0;
  const bool fits = std::max({p.rows, p.n, p.k}) < (int64_t{1} << 30) && grouped::group_table_fits(p.groups) &&
                    ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * ((p.n + kWeightRows - 1) / kWeightRows) <
                        (int64_t{1} << 30) &&
                    p.groups * std::max(p.n, p.k) < (int64_t{1} << 31);
  using grouped::aligned_16;
  const bool aligned = aligned_16(p.a) && aligned_16(p.b) && aligned_16(p.c);
  if (shapes && fits && aligned && grouped::device_info().hopper && grouped::have_sm90a_code<grouped_gemm_sm90_mxfp4_kernel<false>>())
    return GroupedGemmPath::kSm90;
  return GroupedGemmPath::kFallback;
}

void launch_grouped_gemm_mxfp4(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  if (p.groups == 0 || p.rows == 0 || p.n == 0) return;
  if (grouped_gemm_mxfp4_path(p, b_scale) == GroupedGemmPath::kFallback) {
    launch_fallback(p, b_scale, stream);  // also k == 0: c = beta * c
    return;
  }
  if (p.transpose_b) {
    launch_sm90<false>(p, b_scale, stream);
  } else {
    launch_sm90<true>(p, b_scale, stream);
  }
}

}  // namespace moetrain::kernels::cuda_ops
