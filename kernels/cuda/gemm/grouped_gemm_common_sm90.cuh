// What the two Hopper grouped GEMMs (grouped_gemm_sm90.cu: BF16 b; grouped_gemm_mxfp4.cu: MXFP4 b)
// share: the persistent tile scheduler and its host side.
//
// Scheduler: every CTA builds, from the device offsets, the per-group table in shared memory
// (clamped row offsets, and for m-grouped tiles a prefix of tiles per group); the tiles are listed
// by group, then column tile, then row tile, and handed out in that order through a counter in
// device memory: the producer thread takes the next one and passes it to the other warps through
// a two-slot ring, so the tiles in flight are always a contiguous run of the list. The last CTA
// to finish fetching puts the counter back to zero for the next launch on the stream.
// Device helpers keep each kernel's own expressions (templated on its params and tile types) so
// the generated code is the same as when each file had its own copy.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "core/base/tensor.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/common/primitives_sm90.cuh"
#include "kernels/cuda/gemm/grouped_gemm_tiling.h"

namespace moetrain::kernels::cuda_ops::grouped_sm90 {

namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;

constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kBK = 64;        // K step: one 128-byte swizzle row of BF16
constexpr int kTileSlots = 2;  // tiles fetched ahead by the producer for the other warps
constexpr int kStageBudgetBytes = 200 * 1024;  // of the 227 KB a CTA may have
constexpr int kMaxStages = 8;
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;  // 128 x 40 + 256 x 232 <= 64K registers
// What a launch may ask for: 227 KB, all the shared memory a CTA can have. It holds the stages
// (at most kStageBudgetBytes), the group table (at most kTableBudgetBytes), the barriers and, for
// grouped_gemm_sm90.cu's rows-as-N tiles, 8 KB of epilogue buffers (that kernel checks its sum).
constexpr int kMaxDynamicSharedBytes = 227 * 1024;
constexpr int kMaxDevices = 64;  // per-device host caches

// Stages of `stage_bytes` that fit the budget.
constexpr int stage_count(int stage_bytes) { return std::min(kMaxStages, kStageBudgetBytes / stage_bytes); }

// ---------------------------------------------------------------------------------------------
// Device: the scheduler

// The shared-memory table every CTA derives from the offsets.
struct GroupTable {
  int* rows;   // [groups + 1] clamped offsets
  int* tiles;  // [groups + 1] m-grouped: tiles before each group
};

// Warp-wide: rows[i] = min(rows, max(0, offsets[0..i])), a non-decreasing sequence inside the
// tensor whatever the offsets hold; with kTileCounts, tiles[g] = the tiles of groups before g
// (a group has ceil(its rows / kTileRows) x p.n_tiles).
template <int kTileRows, bool kTileCounts, typename Params>
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
  if (!kTileCounts) return;
  __syncwarp();
  if (lane == 0) table.tiles[0] = 0;
  int running_tiles = 0;
  for (int base = 0; base < p.groups; base += 32) {
    const int g = base + lane;
    const int count =
        g < p.groups ? (table.rows[g + 1] - table.rows[g] + kTileRows - 1) / kTileRows * p.n_tiles : 0;
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

// m-grouped tile t: its group (the one whose tile range holds t, tiles[lo] <= t < tiles[lo + 1];
// empty groups have an empty range, so the search never stops on one), its rows
// [m0, min(m0 + kTileRows, m_end)) and its first column n0. kBalanced: the group's ceil(rows /
// kTileRows) tiles split its rows evenly instead (sizes differ by at most one row; m_end is the
// tile's own end), so that 1792 rows make 7 tiles of 256, not 6 of 288 and one of 64.
template <int kTileRows, int kTileColumns, bool kBalanced = false, typename Tile>
__device__ __forceinline__ void locate_m_grouped_tile(int t, int groups, GroupTable table, Tile& tile) {
  int lo = 0, hi = groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (table.tiles[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  tile.group = lo;
  const int local = t - table.tiles[lo];
  const int row0 = table.rows[lo], row_end = table.rows[lo + 1];
  const int m_tiles = (row_end - row0 + kTileRows - 1) / kTileRows;
  const int m_tile = local % m_tiles;
  if constexpr (kBalanced) {
    const int64_t rows = row_end - row0;
    tile.m0 = row0 + static_cast<int>(m_tile * rows / m_tiles);
    tile.m_end = row0 + static_cast<int>((m_tile + 1) * rows / m_tiles);
  } else {
    tile.m0 = row0 + m_tile * kTileRows;
    tile.m_end = row_end;
  }
  tile.n0 = local / m_tiles * kTileColumns;
}

// The producer thread, after fetching past the end: every CTA does so exactly once, and the last
// one puts the counters back to zero for the next launch on the stream.
__device__ __forceinline__ void release_tile_counter(int* tile_counter) {
  __threadfence();
  if (atomicAdd(tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    tile_counter[0] = 0;
    tile_counter[1] = 0;
  }
}

// Two adjacent output values (alpha already applied) into dst: + beta * dst when beta != 0.
template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* out, float v0, float v1, float beta) {
  if constexpr (std::is_same_v<OutT, float>) {
    float2* dst = reinterpret_cast<float2*>(out);
    if (beta != 0.0f) {
      const float2 old = *dst;
      v0 += beta * old.x;
      v1 += beta * old.y;
    }
    *dst = make_float2(v0, v1);
  } else {
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out);
    if (beta != 0.0f) {
      const float2 old = __bfloat1622float2(*dst);
      v0 += beta * old.x;
      v1 += beta * old.y;
    }
    *dst = __floats2bfloat162_rn(v0, v1);
  }
}

// A consumer warpgroup's accumulators of a tile whose rows are wgmma's N (the MXFP4 kernel's
// forward, the BF16 kernel's rows-as-N tiles) into c: wgmma's M is 64 of c's columns, this
// thread's fragment rows g and g + 8 (g = lane / 4) being columns `column` and `column` + 8; its
// N is `n_rows` (a multiple of 8) of c's rows from tile.m0. Accumulator 4 j + 2 h + e is fragment
// row g + 8 h, row tile.m0 + 8 j + 2 c + e (c = lane % 4). Lanes g and g ^ 1 (lane ^ 4) trade one
// value so that each holds two adjacent columns of one row, stored as a pair; columns past p.n
// (n is even: both or neither) and rows past tile.m_end are not stored.
template <typename OutT, int kMaxRows, typename Params, typename Tile>
__device__ __forceinline__ void store_rows_as_n(const float (&acc)[kMaxRows / 2], const Params& p, const Tile& tile,
                                                int n_rows, int column, int lane) {
  const int c = lane % 4, odd = (lane / 4) & 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pair_column = column + 8 * h - odd;
#pragma unroll
    for (int j = 0; j < kMaxRows / 8; ++j) {
      if (8 * j >= n_rows) break;
      const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      const float other = __shfl_xor_sync(kAllLanes, odd ? v0 : v1, 4);
      const int row = tile.m0 + 8 * j + 2 * c + odd;
      if (pair_column < p.n && row < tile.m_end) {
        OutT* out = static_cast<OutT*>(p.c) + static_cast<int64_t>(row) * p.n + pair_column;
        store_pair(out, (odd ? other : v0) * p.alpha, (odd ? v1 : other) * p.alpha, p.beta);
      }
    }
  }
}

// Calls step(std::integral_constant<int, 32 * boxes>{}) for boxes = 1 .. 8 (warp-uniform): the
// wgmma N of a tile whose rows are N, which the prefix wrappers (wgmma_bf16_sm90.cuh) need at compile
// time.
template <typename Step>
__device__ __forceinline__ void with_row_boxes(int boxes, Step&& step) {
  switch (boxes) {
    case 1: step(std::integral_constant<int, 32>{}); break;
    case 2: step(std::integral_constant<int, 64>{}); break;
    case 3: step(std::integral_constant<int, 96>{}); break;
    case 4: step(std::integral_constant<int, 128>{}); break;
    case 5: step(std::integral_constant<int, 160>{}); break;
    case 6: step(std::integral_constant<int, 192>{}); break;
    case 7: step(std::integral_constant<int, 224>{}); break;
    default: step(std::integral_constant<int, 256>{}); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Device: the fallbacks

// c[index] = alpha * sum + beta * c[index] (c not read when beta is 0), c F32 or BF16. (The
// fallbacks' group search of a row stays in each file: shared, it changed how their loops compile.)
template <typename FallbackParams>
__device__ __forceinline__ void store_output(const FallbackParams& p, int64_t index, float sum) {
  float v = p.alpha * sum;
  if (p.c_f32) {
    float* c = static_cast<float*>(p.c) + index;
    if (p.beta != 0.0f) v += p.beta * *c;
    *c = v;
  } else {
    __nv_bfloat16* c = static_cast<__nv_bfloat16*>(p.c) + index;
    if (p.beta != 0.0f) v += p.beta * __bfloat162float(*c);
    *c = __float2bfloat16_rn(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

struct DeviceInfo {
  int multiprocessors = 0;
  bool hopper = false;  // compute capability 9.0: the sm_90a code runs
};

inline DeviceInfo device_info() {
  static DeviceInfo cache[kMaxDevices];
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  DeviceInfo& info = cache[device % kMaxDevices];
  if (info.multiprocessors == 0) {
    int major = 0, minor = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    info.multiprocessors = ::moetrain::cuda::multiprocessor_count();
    info.hopper = major == 9 && minor == 0;
  }
  return info;
}

// Whether this binary holds sm_90a code for `kernel` (a build for other architectures has only
// the trapping body): the kernel's binary version is 90 then. Asked once per kernel.
template <auto kKernel>
bool have_sm90a_code() {
  static const bool have = [] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, kKernel) != cudaSuccess) {
      cudaGetLastError();  // no image for this device: clear the error, use the fallback
      return false;
    }
    return attributes.binaryVersion == 90;
  }();
  return have;
}

// Sets `kKernel`'s dynamic shared-memory limit (kMaxDynamicSharedBytes) once per device.
template <auto kKernel>
void allow_shared_memory() {
  static bool attribute_set[kMaxDevices] = {};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!attribute_set[device % kMaxDevices]) {
    CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kMaxDynamicSharedBytes));
    attribute_set[device % kMaxDevices] = true;
  }
}

// Dynamic shared memory of a launch: `stage_barriers` mbarriers per stage and the tile ring's,
// the ring's indices, the group table, then the stages from a 1024-byte boundary.
inline size_t shared_bytes(int stage_barriers, int stages, int stage_bytes, int64_t groups) {
  return (stage_barriers * stages + 2 * kTileSlots) * sizeof(uint64_t) + kTileSlots * sizeof(int) +
         2 * static_cast<size_t>(groups + 1) * sizeof(int) + 1024 + static_cast<size_t>(stages) * stage_bytes;
}

// The persistent grid: a CTA per multiprocessor, no more than there are tiles.
inline int persistent_grid(int64_t max_tiles) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(device_info().multiprocessors, max_tiles)));
}

inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// `op` names the caller in the error messages.
inline EncodeTiledFn encode_tiled(const char* op) {
  static const EncodeTiledFn fn = [op] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol, 12000, cudaEnableDefault, &found));
    MOETRAIN_CHECK(found == cudaDriverEntryPointSuccess && symbol != nullptr, ExitCode::kInternal,
                   std::string(op) + ": the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiledFn>(symbol);
  }();
  return fn;
}

// A tensor map of `rank` dims (innermost first; strides in bytes of dims 1..; box in elements),
// unit element strides, 256-byte L2 promotion, zeros out of bounds.
inline CUtensorMap encode_map(const char* op, CUtensorMapDataType type, int rank, const void* base,
                              const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                              CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status = encode_tiled(op)(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims,
                                           strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOETRAIN_CHECK(status == CUDA_SUCCESS, ExitCode::kInternal,
                 std::string(op) + ": cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(status)) +
                     ")");
  return map;
}

// The tile counters of the grouped GEMM kernels on one stream (launches on a stream run one after
// the other, and each leaves its counters at zero): allocated on first use, kept for the process.
inline int* tile_counters(cudaStream_t stream) {
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

}  // namespace moetrain::kernels::cuda_ops::grouped_sm90
