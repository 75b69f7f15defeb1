// The Hopper m-grouped GEMM whose weight is decoded inside the mainloop, shared by the formats
// that keep frozen weights compressed: MXFP4 (grouped_gemm_mxfp4.cu) and FP8 E4M3 with 128 x 128
// block scales (grouped_gemm_fp8.cu). A format supplies its stage sizes, its scale handling and
// the consumers' decoder; this file holds the kernel, its pipeline and its launch.
//
// grouped_gemm_sm90_decode_kernel<Format, kInputGrad> computes c^T = W . a^T: the expert weight is
// wgmma's A operand, from registers, and the activations (x, or dy for the input gradient) its B
// operand, from shared memory. The M of a tile is 128 of W's output rows (the columns of c; two
// consumer warpgroups x 64), its N up to 256 rows of one group, the group's rows rounded up to 32:
// a K3 expert (~146 rows) is one tile of N = 160 (wgmma_bf16_sm90.cuh, WgmmaRsPrefix: every N
// accumulates into the same registers). K steps of 64. N is chosen once per tile and the K loop,
// decode included, is compiled for each of the 8 values, so that no K step branches on it.
//   Tiles are listed by group, then 128-column block, then 256-row block and handed out in that
//   order through a device counter (grouped_gemm_common_sm90.cuh, as grouped_gemm_sm90.cu: the
//   tiles in flight share W[g] and rows of a in L2); the per-group table is built from the device
//   offsets, or is one group of all rows when there are none (a dense GEMM). Rows past a group's
//   end are computed from the next group's rows (or TMA zeros) and never stored; so are W's rows
//   past n.
//   Warpgroup 0, the producer (40 registers):
//     - thread 0 issues the TMA copies of a stage: the W tile (Format::kWBytes of codes; the
//       forward's b [G, n, ...] as 2-D rows of W, the input gradient's b [G, k, ...] as 3-D, k rows
//       past the group's arriving as zeros; Format::w_tensor_map) and a's rows in boxes of 32 x 64
//       (128-byte swizzle, the K-major B); with Format::raw_bytes, also raw scale bytes.
//     - warps 1 and 2 (the converters) write the stage's scale words (Format::load_scales /
//       store_scales, loaded two K steps ahead) in the order the consumers read them, then arrive
//       on the stage's 'full' barrier beside the TMA.
//   Warpgroups 1 and 2, the consumers (232 registers): each thread decodes, per K step, its 16
//   A-fragment registers (rows g and g + 8 of its warp's 16, k pairs (2c, 2c + 1) and
//   (2c + 8, 2c + 9) of each k16, g = lane / 4, c = lane % 4; Format::Decoder) straight from the
//   stage's codes while the wgmmas of the previous K step run (two fragment sets; wait_group 1
//   after issuing step s frees step s - 1's registers and stage).
//   c is written from the accumulators: forward transposed (lanes g and g ^ 1 trade one value so
//   each stores two adjacent columns of one row); input gradient directly (the decoder makes
//   fragment rows g, g + 8 adjacent columns).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/primitives_sm90.cuh"
#include "kernels/cuda/common/warp_mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_bf16_sm90.cuh"
#include "kernels/cuda/gemm/grouped_gemm.h"
#include "kernels/cuda/gemm/grouped_gemm_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops::decode_sm90 {

namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
namespace grouped = ::moetrain::kernels::cuda_ops::grouped_sm90;
using grouped::GroupTable;
using grouped::kAllLanes;
using grouped::kBK;  // one 128-byte swizzle row of BF16 activations
using grouped::kTileSlots;

constexpr int kWeightRows = 128;   // W rows (columns of c) per tile: two consumer warpgroups x 64
constexpr int kTokenRows = 256;    // rows of a per tile at most: wgmma's largest N
constexpr int kBox = 32;           // rows of a per TMA box, and the step of N
constexpr int kThreads = 128 * 3;  // the producer warpgroup and two consumers
constexpr int kABytes = kTokenRows * kBK * 2;
constexpr int kBoxBytes = kBox * kBK * 2;
constexpr int kConverters = 64;  // threads 32 .. 95: the scale converters

// A stage: a, W, the scale words and the format's raw scale bytes.
template <typename Format, bool kInputGrad>
struct StageLayout {
  static constexpr int kRawBytes = Format::raw_bytes(kInputGrad);
  static constexpr int kBytes = kABytes + Format::kWBytes + Format::kSBytes + kRawBytes;
  static constexpr int kCount = grouped::stage_count(kBytes);
  static_assert(kCount >= 3, "too few stages to overlap loads with the math");
  static_assert(kABytes % 1024 == 0 && Format::kWBytes % 1024 == 0 && Format::kSBytes % 1024 == 0 &&
                    kRawBytes % 1024 == 0,
                "stages on whole swizzle patterns");
};

struct Params {
  void* c;
  int c_f32;
  const int32_t* offsets;  // null: one group of all rows (a dense GEMM)
  int groups;
  int rows;
  int n;  // columns of c
  int k;  // the inner dimension
  int n_tiles;
  float alpha;
  float beta;
  int* tile_counter;    // [2], zero between launches: the next tile, the CTAs done fetching
  const void* scales;   // b's scales, in the format's dtype
  int scale_tma;        // the raw scale bytes arrive by TMA (map_s), not by loads
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

// Warp 1: the group table from the offsets, or without them one group of all rows.
__device__ __forceinline__ void build_table(const Params& p, GroupTable table, int lane) {
  if (p.offsets != nullptr) {
    grouped::build_group_table<kTokenRows, true>(p, table, lane);
  } else if (lane == 0) {
    table.rows[0] = 0;
    table.rows[1] = p.rows;
    table.tiles[0] = 0;
    table.tiles[1] = (p.rows + kTokenRows - 1) / kTokenRows * p.n_tiles;
  }
}

// The producer warpgroup: thread 0 fetches tiles and issues the stages' copies, the converters
// write the scale words. The caller's ring state (stage, phase, the tile slot) advances here.
template <typename Format, bool kInputGrad, typename NextTile, typename Advance>
__device__ __forceinline__ void run_producer(const CUtensorMap& map_a, const CUtensorMap& map_w,
                                             const CUtensorMap& map_s, const Params& p, GroupTable table,
                                             int total_tiles, int warp, uint64_t* full, uint64_t* empty, uint64_t* raw_full,
                                             uint64_t* tile_full, uint64_t* tile_empty, int* tile_slot,
                                             unsigned char* a_stages, unsigned char* w_stages,
                                             unsigned char* s_stages, unsigned char* raw_stages, int& stage,
                                             uint32_t& phase, int& slot, uint32_t& slot_phase, NextTile&& next_tile,
                                             Advance&& advance) {
  using Stages = StageLayout<Format, kInputGrad>;
  constexpr bool kRaw = Stages::kRawBytes > 0;
  constexpr int kWBytes = Format::kWBytes, kSBytes = Format::kSBytes;
  if (threadIdx.x == 0) {
    sm90::tma_prefetch_descriptor(&map_a);
    sm90::tma_prefetch_descriptor(&map_w);
    if (kRaw && p.scale_tma) sm90::tma_prefetch_descriptor(&map_s);
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
        if constexpr (kRaw) {
          if (p.scale_tma) {  // first: the converters wait for these bytes
            sm90::barrier_arrive_expect_bytes(&raw_full[stage], Stages::kRawBytes);
            Format::load_raw_scales(raw_stages + stage * Stages::kRawBytes, &map_s, &raw_full[stage], tile, s);
          }
        }
        sm90::barrier_arrive_expect_bytes(&full[stage], kWBytes + boxes * kBoxBytes);
        if constexpr (kInputGrad) {
          sm90::tma_load_3d(w_stages + stage * kWBytes, &map_w, &full[stage], tile.n0 / Format::kCodesPerByte,
                            s * kBK, tile.group);
        } else {
          sm90::tma_load_2d(w_stages + stage * kWBytes, &map_w, &full[stage], s * kBK / Format::kCodesPerByte,
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
      if constexpr (kRaw) {
        if (p.scale_tma) {
          // raw_full's phase completing means thread 0 saw the stage empty: the words are free.
          for (int s = 0; s < tile.k_steps; ++s) {
            sm90::barrier_wait(&raw_full[stage], phase);
            const auto current = Format::raw_scales(raw_stages + stage * Stages::kRawBytes, tile, i);
            Format::template store_scales<kInputGrad>(reinterpret_cast<uint32_t*>(s_stages + stage * kSBytes),
                                                      current, i);
            sm90::barrier_arrive(&full[stage]);
            advance();
          }
          continue;
        }
      }
      auto next = Format::template load_scales<kInputGrad>(p, tile, 0, i);
      auto after = next;
      if (tile.k_steps > 1) after = Format::template load_scales<kInputGrad>(p, tile, 1, i);
      for (int s = 0; s < tile.k_steps; ++s) {
        const auto current = next;
        next = after;
        if (s + 2 < tile.k_steps) after = Format::template load_scales<kInputGrad>(p, tile, s + 2, i);
        sm90::barrier_wait(&empty[stage], phase ^ 1);
        Format::template store_scales<kInputGrad>(reinterpret_cast<uint32_t*>(s_stages + stage * kSBytes), current,
                                                  i);
        sm90::barrier_arrive(&full[stage]);
        advance();
      }
    }
  }
}

template <typename Format, bool kInputGrad>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_decode_kernel(const __grid_constant__ CUtensorMap map_a,
                                    const __grid_constant__ CUtensorMap map_w,
                                    const __grid_constant__ CUtensorMap map_s, const Params p) {
  using Stages = StageLayout<Format, kInputGrad>;
  constexpr int kStages = Stages::kCount;
  constexpr int kWBytes = Format::kWBytes, kSBytes = Format::kSBytes;
  extern __shared__ __align__(1024) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + kStages;
  uint64_t* raw_full = empty + kStages;  // the raw scale bytes landed (TMA scales)
  uint64_t* tile_full = raw_full + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_slot = reinterpret_cast<int*>(tile_empty + kTileSlots);
  GroupTable table{tile_slot + kTileSlots, nullptr};
  table.tiles = table.rows + p.groups + 1;
  const uintptr_t table_end = reinterpret_cast<uintptr_t>(table.tiles + p.groups + 1);
  unsigned char* a_stages = reinterpret_cast<unsigned char*>((table_end + 1023) & ~uintptr_t{1023});
  unsigned char* w_stages = a_stages + kStages * kABytes;
  unsigned char* s_stages = w_stages + kStages * kWBytes;
  unsigned char* raw_stages = s_stages + kStages * kSBytes;  // with Stages::kRawBytes only

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
  if (warp == 1) build_table(p, table, lane);
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
    sm90::registers_release<grouped::kProducerRegisters>();
    run_producer<Format, kInputGrad>(map_a, map_w, map_s, p, table, total_tiles, warp, full, empty, raw_full, tile_full,
                                     tile_empty, tile_slot, a_stages, w_stages, s_stages, raw_stages, stage, phase,
                                     slot, slot_phase, next_tile, advance);
    return;
  }

  sm90::registers_claim<grouped::kConsumerRegisters>();
  const int warpgroup = warp / 4 - 1;
  const typename Format::template Decoder<kInputGrad> decoder(warpgroup, warp % 4, lane);
  float acc[128];
  uint32_t frag0[16], frag1[16];
  auto decode = [&](uint32_t (&f)[16], int st) { decoder(f, w_stages + st * kWBytes, s_stages + st * kSBytes); };
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
      store_tile<kInputGrad, float>(acc, p, tile, boxes, tile.n0 + decoder.column0, lane);
    } else {
      store_tile<kInputGrad, __nv_bfloat16>(acc, p, tile, boxes, tile.n0 + decoder.column0, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// A 2-D tensor map: `outer` rows of `inner` elements (row stride inner * element bytes), boxes of
// box_rows x box_inner.
inline CUtensorMap tensor_map_2d(const char* op, const void* base, CUtensorMapDataType type, int element_bytes,
                                 int64_t outer, int64_t inner, int box_rows, int box_inner,
                                 CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows)};
  return grouped::encode_map(op, type, 2, base, dims, strides, box, swizzle);
}

// The weight's tensor map, `row_bytes` bytes per row of b. Forward: b [G, n, ...] as [G * n, row
// bytes], boxes of 128 rows x one K step of codes. Input gradient: b [G, k, ...] as 3-D (k rows
// past a group's arrive as zeros), boxes of 64 k rows x 128 columns of codes.
inline CUtensorMap w_tensor_map(const char* op, const GroupedGemmProblem& p, int64_t row_bytes, int box_row_bytes,
                                CUtensorMapSwizzle swizzle) {
  const bool input_grad = !p.transpose_b;
  const int64_t outer = input_grad ? p.k : p.n;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes),
                              static_cast<cuuint64_t>(input_grad ? outer : p.groups * outer),
                              static_cast<cuuint64_t>(input_grad ? p.groups : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(row_bytes * outer)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_row_bytes),
                             static_cast<cuuint32_t>(input_grad ? kBK : kWeightRows), 1};
  return grouped::encode_map(op, CU_TENSOR_MAP_DATA_TYPE_UINT8, input_grad ? 3 : 2, p.b, dims, strides, box,
                             swizzle);
}

// Whether the problem's sizes fit the kernel's int indexing and group table, and its pointers TMA.
inline bool decode_sm90_fits(const GroupedGemmProblem& p) {
  const int64_t max_tiles = ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * ((p.n + kWeightRows - 1) / kWeightRows);
  return p.kind == GroupedGemmKind::kMGrouped && p.k > 0 && std::max({p.rows, p.n, p.k}) < (int64_t{1} << 30) &&
         grouped::group_table_fits(p.groups) && max_tiles < (int64_t{1} << 30) &&
         p.groups * std::max(p.n, p.k) < (int64_t{1} << 31) && grouped::aligned_16(p.a) &&
         grouped::aligned_16(p.b) && grouped::aligned_16(p.c) && grouped::device_info().hopper;
}

// The launch: p.group_offsets null is one group of all p.rows rows (p.groups 1).
template <typename Format, bool kInputGrad>
void launch_decode_sm90(const GroupedGemmProblem& p, const void* b_scale, cudaStream_t stream) {
  using Stages = StageLayout<Format, kInputGrad>;
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
  params.scales = b_scale;
  const CUtensorMap map_a = tensor_map_2d(Format::kOp, p.a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p.rows, p.k, kBox,
                                          kBK, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap map_w = Format::w_map(p);
  CUtensorMap map_s{};  // unused unless params.scale_tma
  params.scale_tma = Format::scale_map(p, b_scale, &map_s) ? 1 : 0;
  constexpr auto kKernel = grouped_gemm_sm90_decode_kernel<Format, kInputGrad>;
  grouped::allow_shared_memory<kKernel>();
  // Barriers per stage: full, empty and raw_full.
  const size_t shared = grouped::shared_bytes(3, Stages::kCount, Stages::kBytes, p.groups);
  // Each group adds at most one partial row block.
  const int64_t max_tiles = ((p.rows + kTokenRows - 1) / kTokenRows + p.groups) * params.n_tiles;
  kKernel<<<grouped::persistent_grid(max_tiles), kThreads, shared, stream>>>(map_a, map_w, map_s, params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops::decode_sm90
