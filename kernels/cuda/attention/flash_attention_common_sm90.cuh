// Pieces shared by the Hopper flash attention kernels (flash_attention_forward_sm90.cu,
// flash_attention_backward_sm90.cu): the shared-tile geometry and its wgmma descriptors, register
// fragment helpers, and the host side of the TMA tensor maps.
//
// Every tile lives in shared memory as the tensor copy engine (TMA) writes it with a 128-byte
// swizzle: a [rows x dim] BF16 tile is dim / 64 "chunks" of [rows x 64 columns], each row 128 bytes
// (one swizzle row), each chunk 1024-byte aligned. The same bytes serve wgmma two ways:
//   K-major (the contraction runs along the columns: Q, K, V, dO as the left factor of S = Q K^T
//     or as its right factor): k-step kk is chunk kk / 4, 32 bytes into each row; 8-row groups
//     1024 bytes apart.
//   MN-major (the contraction runs along the rows: V in O += P V, K in dQ += dS K, Q and dO in
//     dK += dS^T Q, dV += P^T dO): k-step kk starts 16 rows (2048 bytes) in; the N columns step
//     from chunk to chunk (the leading byte offset), 8-row groups 1024 bytes apart.
// grouped_gemm.cu uses the same two layouts (its K-major and N-major B tiles).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/base/tensor.h"

#include "kernels/cuda/attention/attention_segments.cuh"
#include "kernels/cuda/attention/flash_attention_dispatch_sm90.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/common/primitives_sm90.cuh"
#include "kernels/cuda/common/warp_mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_bf16_sm90.cuh"

namespace moetrain::kernels::cuda_ops::flash_sm90 {

namespace sm90 = ::moetrain::kernels::cuda_ops::sm90;
using bf16 = __nv_bfloat16;

// Threads: warpgroup 0 produces (one thread issues every TMA copy), warpgroups 1 and 2 consume,
// each owning 64 rows of the CTA's block (the wgmma M).
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kWarpgroupRows = 64;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;  // each releases a stage (lane 0 arrives)
// setmaxnreg: 128 x 24 + 256 x 240 = 64512 of the 65536 registers (the entry cap is 168).
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
constexpr int kChunkColumns = 64;  // BF16 columns per 128-byte swizzle row
constexpr int kSwizzleBytes = 128;
constexpr int kSmemAlignment = 1024;  // a whole swizzle pattern; the dynamic base is rounded up
constexpr int kMaxSmemBytes = 227 * 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int kRows, int kDim>
struct SwizzledTile {
  static_assert(kDim % kChunkColumns == 0, "a tile is whole 64-column chunks");
  static_assert(kRows % 8 == 0, "a tile is whole 8-row swizzle groups");
  static constexpr int kChunks = kDim / kChunkColumns;
  static constexpr int kChunkBytes = kRows * kSwizzleBytes;
  static constexpr int kBytes = kChunks * kChunkBytes;
  static_assert(kChunkBytes % kSmemAlignment == 0, "chunks start on a whole swizzle pattern");

  // K-major operand: rows [row0, row0 + 64) (or all rows as a wgmma B of N = kRows), k-step kk.
  __device__ static __forceinline__ uint64_t k_major(uint32_t base, int row0, int kk) {
    return sm90::matrix_descriptor(base + (kk / 4) * kChunkBytes + row0 * kSwizzleBytes + (kk % 4) * 32, 16,
                                   8 * kSwizzleBytes, sm90::swizzle_code(kSwizzleBytes));
  }
  // MN-major operand: k-step kk (rows [16 kk, 16 kk + 16)), N from column chunk 0 on.
  __device__ static __forceinline__ uint64_t mn_major(uint32_t base, int kk) {
    return sm90::matrix_descriptor(base + kk * 16 * kSwizzleBytes, kChunkBytes, 8 * kSwizzleBytes,
                                   sm90::swizzle_code(kSwizzleBytes));
  }
};

__device__ __forceinline__ unsigned char* align_to_swizzle(unsigned char* p) {
  const uint32_t address = sm90::smem_address(p);
  return p + ((kSmemAlignment - (address & (kSmemAlignment - 1))) & (kSmemAlignment - 1));
}

// TMA copies of a tile's chunks: rows [row0, row0 + kRows) of head `head` of a [tokens, heads, dim]
// tensor (rows past the tensor arrive as zeros and still count towards the barrier's bytes).
template <typename Tile>
__device__ __forceinline__ void load_tile(unsigned char* dst, const CUtensorMap* map, uint64_t* bar, int head,
                                          int row0) {
#pragma unroll
  for (int c = 0; c < Tile::kChunks; ++c) sm90::tma_load_3d(dst + c * Tile::kChunkBytes, map, bar, c * kChunkColumns, head, row0);
}

// The producer's wait for a stage to be given back (sm90::barrier_wait, with a deadline). No wait
// in these kernels legitimately lasts more than microseconds; one that lasts seconds means a lost
// TMA transaction or a miscounted barrier (a bug), and traps so that the launch fails with an error
// instead of hanging the process. Only the producer thread waits this way (a trap in the consumer
// warpgroups' code makes ptxas spill their accumulators); it also waits for the last stages at the
// end (drain_ring), so a consumer stuck on a 'full' barrier is caught too.
__device__ __forceinline__ void producer_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t address = sm90::smem_address(bar);
  uint64_t first_miss = 0;
  for (;;) {
    if (sm90::barrier_try_wait(address, parity) != 0) return;
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (first_miss == 0) {
      first_miss = now;
    } else if (now - first_miss > 4000000000ull) {  // 4 s
      __trap();
    }
  }
}

// Ring position of a pipelined stage: the slot and the parity of its current use.
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// After the producer's last load: waits until the consumers gave back every stage (the uses before
// the first kStages find fresh barriers and pass at once).
template <int kStages>
__device__ __forceinline__ void drain_ring(uint64_t* empty, RingPosition<kStages> ring) {
  for (int s = 0; s < kStages; ++s) {
    producer_wait(&empty[ring.stage], ring.phase ^ 1);
    ring.advance();
  }
}

// Arrives on named barrier `id` (counted among `threads`) without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  MOETRAIN_SM90_ASM("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A consumer warp gives a stage back (after its warpgroup's wgmma reading it completed and its
// lanes' own reads of it are done).
__device__ __forceinline__ void release_stage(uint64_t* empty, int lane) {
  __syncwarp();
  if (lane == 0) sm90::barrier_arrive(empty);
}

// ---------------------------------------------------------------------------------------------
// Register fragments

using sm80::pack_bf16x2;

// A wgmma accumulator (64 x N, F32: acc[4j + 2h + e] = row g + 8h, column 8j + 2c + e of the
// warp's 16 rows) packed to BF16 as the A fragments of the k-steps over its N columns.
template <int kN>
__device__ __forceinline__ void accumulator_to_fragments(uint32_t (&f)[kN / 16][4], const float (&acc)[kN / 2]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) f[kk][r] = pack_bf16x2(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
  }
}

// Element idx of the accumulator accumulator_to_fragments packed into f, as F32 (its BF16 value).
template <int kSteps>
__device__ __forceinline__ float fragment_value(const uint32_t (&f)[kSteps][4], int idx) {
  const uint32_t bits = f[idx / 8][(idx % 8) / 2];
  return __uint_as_float(idx % 2 == 0 ? bits << 16 : bits & 0xffff0000u);
}

// Keeps fragment registers alive and in place across an asynchronous wgmma that reads them (the
// compiler sees the read at the issue only).
template <int kSteps>
__device__ __forceinline__ void fence_fragments(uint32_t (&f)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(f[kk][r])::"memory");
}

template <int kCount>
__device__ __forceinline__ void zero(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) acc[i] = 0.0f;
}

// 2^x by the MUFU unit (about 2 ulp; exp2(-inf) = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Max and sum over the 4 lanes (a quad) that hold one accumulator row.
using sm80::quad_max;
using sm80::quad_sum;

// Stores row `row` (this thread's columns 8j + 2c, + 1 of a 64 x kN accumulator, half h) times
// `factor` as BF16 into a [tokens, heads, kN] tensor.
template <int kN>
__device__ __forceinline__ void store_row_bf16(bf16* dst, const float (&acc)[kN / 2], int h, float factor, int quad) {
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j + 2 * quad) =
        __floats2bfloat162_rn(acc[4 * j + 2 * h] * factor, acc[4 * j + 2 * h + 1] * factor);
  }
}

// The order in which a causal pass takes its (block, head) works, whose blocks differ in length:
// work `linear` of one numbering, heads in groups of `group`, and within a group the blocks by
// rank (0, the longest, first), each rank over the group's heads in turn. Heads one after another
// (group 1) keep one head's K and V in L2 but end with the last head's longest blocks starting
// late (a tail); a group of heads ends on the group's shortest blocks.
struct OrderedBlock {
  int rank;  // 0 for the longest block of its head
  int head;
};
__device__ __forceinline__ OrderedBlock ordered_block(int linear, int blocks_per_head, int heads, int group) {
  const int per_group = blocks_per_head * group;
  const int first_head = linear / per_group * group;
  const int in_group = min(group, heads - first_head);
  const int r = linear % per_group;
  return {r / in_group, first_head + r % in_group};
}

// A work of the passes over query blocks (the forward and the dQ pass): rank 0 is a head's last
// block, which sees the most keys, so that it goes first. Its queries are [m0, m0 + kBlockM) of
// head `head`; its keys run from the segment start of its first query (starts are monotone in t,
// so the first row's is the earliest) in n_tiles tiles of kBlockN.
struct QueryBlock {
  int head, m0, kv_begin, n_tiles;
};
template <int kBlockM, int kBlockN, typename Params>
__device__ __forceinline__ QueryBlock query_block(int work, const Params& p) {
  const OrderedBlock ob = ordered_block(work, p.blocks_per_head, p.heads, p.order_group);
  QueryBlock b;
  b.head = ob.head;
  b.m0 = (p.blocks_per_head - 1 - ob.rank) * kBlockM;
  b.kv_begin = segment_start(p.cu_seqlens, p.num_segments, b.m0);
  b.n_tiles = (min(b.m0 + kBlockM, p.tokens) - b.kv_begin + kBlockN - 1) / kBlockN;
  return b;
}

// The persistent passes run a CTA per multiprocessor, each taking works (ordered_block's numbers)
// one after another, so that a work's first loads overlap the last work's end (its last matmuls
// and its stores) instead of waiting for a new CTA to start. On one H200 (one binary, three
// alternations against one work per CTA; T 8192, 32 heads) the forward took 2% less time and
// forward + backward 1.5-4% less (D128: 0.97 against 0.99 ms, 4.06 against 4.19 ms).
// Works go out in order, each to the first CTA that asks (the longest first, as the hardware's
// block scheduler would): a CTA's first work is its blockIdx.x, its later ones come from `counter`
// (zero before the launch) past the grid. The producer thread takes each work and hands it to the
// consumer warps through a two-slot ring in shared memory; work -1 means none is left.
struct WorkRing {
  uint64_t* full;   // [2]: one arrival, the producer's
  uint64_t* empty;  // [2]: kConsumerWarps arrivals
  int* slot;        // [2]
  RingPosition<2> position;

  static constexpr int kBarriers = 4;
  static constexpr int kBytes = 2 * sizeof(int);
  // `barriers` points at kBarriers free mbarriers, `slots` at kBytes of shared memory.
  __device__ WorkRing(uint64_t* barriers, void* slots)
      : full(barriers), empty(barriers + 2), slot(static_cast<int*>(slots)) {}

  // Before the launch's __syncthreads, by one thread.
  __device__ void init() {
    for (int s = 0; s < 2; ++s) {
      sm90::barrier_init(&full[s], 1);
      sm90::barrier_init(&empty[s], kConsumerWarps);
    }
  }

  // The producer thread: takes the CTA's next work, publishes it, and returns it (-1: none left).
  __device__ int produce(int* counter, int total, bool first) {
    producer_wait(&empty[position.stage], position.phase ^ 1);
    int work = first ? static_cast<int>(blockIdx.x) : static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
    if (work >= total) work = -1;
    slot[position.stage] = work;
    sm90::barrier_arrive(&full[position.stage]);  // release: the slot's store is seen by its waiters
    position.advance();
    return work;
  }

  // Every consumer thread: the CTA's next work (-1: none left).
  __device__ int consume(int lane) {
    sm90::barrier_wait(&full[position.stage], position.phase);
    const int work = *static_cast<volatile int*>(&slot[position.stage]);
    release_stage(&empty[position.stage], lane);
    position.advance();
    return work;
  }
};

// ---------------------------------------------------------------------------------------------
// Host side

// The Hopper kernels run on a compute capability 9.0 device from an sm_90a build (the kernel's
// binary version is 90); `probe` is one of the kernels.
template <typename Kernel>
bool sm90_kernel_runs_here(Kernel probe) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return false;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, probe) != cudaSuccess) {
    cudaGetLastError();  // no image for this device: clear the error, use another path
    return false;
  }
  return attributes.binaryVersion == 90;
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol, 12000, cudaEnableDefault, &found));
    MOETRAIN_CHECK(found == cudaDriverEntryPointSuccess && symbol != nullptr, ExitCode::kInternal,
                   "flash attention: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiledFn>(symbol);
  }();
  return fn;
}

inline CUtensorMap encode_map(CUtensorMapDataType type, int rank, const void* base, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status = encode_tiled()(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims,
                                         strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOETRAIN_CHECK(status == CUDA_SUCCESS, ExitCode::kInternal,
                 "flash attention: cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(status)) + ")");
  return map;
}

// A BF16 [tokens, heads, dim] tensor read as tiles of `rows` tokens x 64 columns of one head
// (coordinates: column, head, token), 128-byte swizzled.
inline CUtensorMap token_tile_map(const void* base, int64_t tokens, int64_t heads, int64_t dim, int rows) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(dim) * 2, static_cast<cuuint64_t>(heads * dim) * 2};
  const cuuint32_t box[3] = {kChunkColumns, 1, static_cast<cuuint32_t>(rows)};
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

// An F32 [heads][row_stride] array (tokens valid per head) read as `rows` tokens of one head
// (coordinates: token, head).
inline CUtensorMap head_row_map(const float* base, int64_t tokens, int64_t heads, int64_t row_stride, int rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(tokens), static_cast<cuuint64_t>(heads)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(rows), 1};
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
}

// (qk_dim, v_dim) -> the kernels' instantiation: 64 / 64, 128 / 128 or MLA's 192 / 128
// (flash_head_dims admits these only).
template <typename F>
void dispatch_dims(int qk_dim, F&& f) {
  if (qk_dim == 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else if (qk_dim == 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  }
}

// Launches kKernel(maps..., p) as a persistent pass (WorkRing) over one work per (block of
// `block_rows` tokens, head), numbered for ordered_block: sets p.blocks_per_head, p.order_group,
// p.works and p.work_counter (`counter`, which must read zero when the kernel starts), and gives
// the kernel `smem_bytes` of dynamic shared memory: its limit is raised once per device, after
// checking the device has that much.
template <auto kKernel, typename Params, typename... Maps>
void launch_persistent(size_t smem_bytes, int block_rows, int* counter, Params& p, cudaStream_t stream,
                       const Maps&... maps) {
  static bool allowed[64] = {};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!allowed[device % 64]) {
    int optin = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    MOETRAIN_CHECK(smem_bytes <= static_cast<size_t>(optin), ExitCode::kInternal,
                   "flash attention needs " + std::to_string(smem_bytes) +
                       " bytes of shared memory, the device allows " + std::to_string(optin));
    CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
    allowed[device % 64] = true;
  }
  p.blocks_per_head = (p.tokens + block_rows - 1) / block_rows;
  p.order_group = launch_order_group(p.blocks_per_head, p.heads);
  p.works = p.blocks_per_head * p.heads;  // < 2^30: flash_shape_fits
  p.work_counter = counter;
  const unsigned grid = static_cast<unsigned>(std::min(p.works, ::moetrain::cuda::multiprocessor_count()));
  kKernel<<<grid, kThreads, smem_bytes, stream>>>(maps..., p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops::flash_sm90
