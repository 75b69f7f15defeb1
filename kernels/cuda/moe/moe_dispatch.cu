// MoE dispatch and combine on CUDA; kernels/cpu/moe.cpp is the spec.
//
// moe_permutation: a stable counting sort of the tokens * top_k pairs by expert, in three
// kernels, deterministic by construction (each pair's row depends only on the input):
//   1. count: one warp per chunk of kChunkPairs consecutive pairs counts its pairs per expert
//      (32 pairs per step; __match_any_sync groups the lanes of one expert, the group's lowest
//      lane adds the group size), writing chunk_counts[chunk, expert];
//   2. scan: one block turns the counts into expert_offsets (exclusive scan over experts) and
//      each chunk's first row per expert (exclusive scan over chunks, in chunk order);
//   3. scatter: each warp walks its chunk again in pair order; a pair's row is its chunk's base
//      for the expert plus the number of earlier pairs of that expert in the chunk, so ties stay
//      in token order (stable).
//   Work O(pairs + chunks * experts); the scan is serial over chunks per expert thread
//   (chunks = pairs / 1024, e.g. 64 for 8192 tokens at top-8) and over experts on one thread.
// moe_permute / moe_unpermute_sum / moe_combine / moe_combine_backward: one block per output
// row (token or sorted row), threads across the row; sums over slots j in order 0, 1, ...
#include "kernels/cuda/moe/moe_dispatch.h"

#include <climits>
#include <string>

#include "kernels/arg_checks.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kSortWarpsPerBlock = 4;
constexpr int kChunkPairs = 1024;  // pairs per warp in the count and scatter kernels
constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 256;
static_assert(kChunkPairs % kWarpSize == 0, "a chunk is whole warp steps");

// ---------------------------------------------------------------------------------------------
// moe_permutation

__device__ __forceinline__ bool valid_expert(int e, int experts) { return e >= 0 && e < experts; }

// chunk_counts[chunk, e] = #pairs of expert e in the chunk.
__global__ void __launch_bounds__(kSortWarpsPerBlock * kWarpSize)
    moe_permutation_count_kernel(int32_t* chunk_counts, const int32_t* expert_of, int64_t pairs, int64_t chunks,
                                 int experts) {
  extern __shared__ int32_t sort_smem[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kSortWarpsPerBlock + warp;
  if (chunk >= chunks) return;  // whole warps leave; no block-wide barrier follows
  int32_t* count = sort_smem + static_cast<size_t>(warp) * experts;
  for (int e = lane; e < experts; e += kWarpSize) count[e] = 0;
  __syncwarp();
  const int64_t first = chunk * kChunkPairs;
  for (int step = 0; step < kChunkPairs / kWarpSize; ++step) {
    const int64_t pair = first + step * kWarpSize + lane;
    const int e = pair < pairs ? expert_of[pair] : -1;
    const bool valid = valid_expert(e, experts);
    const unsigned active = __ballot_sync(kFullMask, valid);
    if (valid) {
      const unsigned same = __match_any_sync(active, e);
      if (lane == __ffs(same) - 1) count[e] += __popc(same);
    }
    __syncwarp();
  }
  for (int e = lane; e < experts; e += kWarpSize) chunk_counts[chunk * experts + e] = count[e];
}

// chunk_counts -> chunk_base[chunk, e] (in place): the first row of expert e's pairs in the
// chunk; expert_offsets [experts + 1].
__global__ void __launch_bounds__(kScanThreads)
    moe_permutation_scan_kernel(int32_t* expert_offsets, int32_t* chunk_counts, int64_t chunks, int experts) {
  extern __shared__ int32_t offsets[];  // [experts + 1]
  for (int e = threadIdx.x; e < experts; e += kScanThreads) {
    int32_t running = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t n = chunk_counts[c * experts + e];
      chunk_counts[c * experts + e] = running;
      running += n;
    }
    offsets[e + 1] = running;  // the expert's total for now
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= experts; e += kScanThreads) expert_offsets[e] = offsets[e];
  for (int e = threadIdx.x; e < experts; e += kScanThreads) {
    for (int64_t c = 0; c < chunks; ++c) chunk_counts[c * experts + e] += offsets[e];
  }
}

__global__ void __launch_bounds__(kSortWarpsPerBlock * kWarpSize)
    moe_permutation_scatter_kernel(int32_t* sorted_pair, int32_t* pair_row, const int32_t* chunk_base,
                                   const int32_t* expert_of, int64_t pairs, int64_t chunks, int experts) {
  extern __shared__ int32_t sort_smem[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kSortWarpsPerBlock + warp;
  if (chunk >= chunks) return;
  int32_t* next_row = sort_smem + static_cast<size_t>(warp) * experts;
  for (int e = lane; e < experts; e += kWarpSize) next_row[e] = chunk_base[chunk * experts + e];
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t first = chunk * kChunkPairs;
  for (int step = 0; step < kChunkPairs / kWarpSize; ++step) {
    const int64_t pair = first + step * kWarpSize + lane;
    const int e = pair < pairs ? expert_of[pair] : -1;
    const bool valid = valid_expert(e, experts);
    const unsigned active = __ballot_sync(kFullMask, valid);
    unsigned same = 0;
    if (valid) {
      same = __match_any_sync(active, e);
      const int row = next_row[e] + __popc(same & lanes_below);
      sorted_pair[row] = static_cast<int32_t>(pair);
      pair_row[pair] = row;
    } else if (pair < pairs) {
      pair_row[pair] = -1;  // an expert outside [0, experts): a bug upstream, left out of the sort
    }
    __syncwarp();  // every lane has read next_row before it moves on
    if (valid && lane == __ffs(same) - 1) next_row[e] += __popc(same);
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------
// Row kernels

// out[p, :] = x[sorted_pair[p] / top_k, :]; a row index outside x gives a zero row.
template <int kChunk>
__global__ void __launch_bounds__(kRowThreads)
    moe_permute_gather_kernel(MutOperand out, ConstOperand x, const int32_t* sorted_pair, int64_t rows,
                              int64_t x_rows, int64_t top_k, int64_t width) {
  for (int64_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const int32_t pair = sorted_pair[p];
    const int64_t src = pair >= 0 ? pair / top_k : -1;
    const bool ok = src >= 0 && src < x_rows;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * kChunk; c < width; c += static_cast<int64_t>(kRowThreads) * kChunk) {
      float v[kChunk];
      if (ok) {
        load_chunk<kChunk>(v, x, src * width + c);
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = 0.0f;
      }
      store_chunk<kChunk>(out, p * width + c, v);
    }
  }
}

// dx[t, :] (+)= sum_j drows[pair_row[t * top_k + j], :], slots in order.
template <int kChunk>
__global__ void __launch_bounds__(kRowThreads)
    moe_unpermute_sum_kernel(MutOperand dx, ConstOperand drows, const int32_t* pair_row, int64_t tokens,
                             int64_t drow_count, int64_t top_k, int64_t width, bool accumulate) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * kChunk; c < width; c += static_cast<int64_t>(kRowThreads) * kChunk) {
      float sum[kChunk];
      if (accumulate) {
        load_chunk<kChunk>(sum, dx, t * width + c);
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) sum[e] = 0.0f;
      }
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = pair_row[t * top_k + j];
        if (row < 0 || row >= drow_count) continue;
        float v[kChunk];
        load_chunk<kChunk>(v, drows, row * width + c);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) sum[e] += v[e];
      }
      store_chunk<kChunk>(dx, t * width + c, sum);
    }
  }
}

// out[t, :] = sum_j weight[t, j] * rows[pair_row[t * top_k + j], :], slots in order.
template <int kChunk>
__global__ void __launch_bounds__(kRowThreads)
    moe_combine_kernel(MutOperand out, ConstOperand rows, const float* weight, const int32_t* pair_row, int64_t tokens,
                       int64_t row_count, int64_t top_k, int64_t width) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * kChunk; c < width; c += static_cast<int64_t>(kRowThreads) * kChunk) {
      float sum[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) sum[e] = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = pair_row[t * top_k + j];
        if (row < 0 || row >= row_count) continue;
        const float w = weight[t * top_k + j];
        float v[kChunk];
        load_chunk<kChunk>(v, rows, row * width + c);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) sum[e] = fmaf(w, v[e], sum[e]);
      }
      store_chunk<kChunk>(out, t * width + c, sum);
    }
  }
}

// drows[pair_row[t, j], :] = weight[t, j] * dout[t, :]; dweight[t, j] = dout[t, :] . rows[...],
// a per-thread partial in column order then block_sum's fixed tree.
template <int kChunk>
__global__ void __launch_bounds__(kRowThreads)
    moe_combine_backward_kernel(MutOperand drows, float* dweight, ConstOperand dout, ConstOperand rows,
                                const float* weight, const int32_t* pair_row, int64_t tokens, int64_t row_count,
                                int64_t top_k, int64_t width) {
  __shared__ float reduce_scratch[32];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = pair_row[t * top_k + j];
      const bool ok = row >= 0 && row < row_count;
      const float w = weight[t * top_k + j];
      float partial = 0.0f;
      if (ok) {
        for (int64_t c = static_cast<int64_t>(threadIdx.x) * kChunk; c < width; c += static_cast<int64_t>(kRowThreads) * kChunk) {
          float g[kChunk], r[kChunk], dr[kChunk];
          load_chunk<kChunk>(g, dout, t * width + c);
          load_chunk<kChunk>(r, rows, row * width + c);
#pragma unroll
          for (int e = 0; e < kChunk; ++e) {
            partial = fmaf(g[e], r[e], partial);
            dr[e] = w * g[e];
          }
          store_chunk<kChunk>(drows, row * width + c, dr);
        }
      }
      const float dot = block_sum(partial, reduce_scratch);  // uniform: every thread calls it
      if (threadIdx.x == 0) dweight[t * top_k + j] = ok ? dot : 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// The launchers check again what they rely on (kernels/arg_checks.h), as the backend does.
void expect_device(const char* op, const char* name, const TensorView& t) { expect_on(op, name, t, Device::kCUDA); }
void expect_dtype(const char* op, const char* name, const TensorView& t, DType dtype) {
  expect_device(op, name, t);
  expect_dtype_is(op, name, t, dtype);
}
ConstOperand row_in(const char* op, const char* name, const TensorView& t) {
  expect_device(op, name, t);
  expect(t.ndim() >= 1, op, std::string(name) + " " + t.shape.str() + " needs a row dimension");
  return ConstOperand{t.data, elem_kind(op, name, t.dtype)};
}
MutOperand row_out(const char* op, const char* name, const TensorView& t) {
  const ConstOperand in = row_in(op, name, t);
  return MutOperand{t.data, in.kind};
}
int64_t row_width(const TensorView& t) { return t.size(0) == 0 ? 0 : t.numel() / t.size(0); }

// pair_row: int32, one entry per (token, slot).
void expect_pair_row(const char* op, const TensorView& pair_row, int64_t tokens, int64_t top_k) {
  expect_dtype(op, "pair_row", pair_row, DType::kI32);
  expect(pair_row.numel() == tokens * top_k, op, "pair_row is " + pair_row.shape.str() + ", expected " +
                                                     std::to_string(tokens * top_k) + " entries");
}

// The combine weights: F32 [tokens, top_k].
void expect_combine_weight(const char* op, const TensorView& weight) {
  expect_dtype(op, "weight", weight, DType::kF32);
  expect(weight.ndim() == 2, op, "weight is " + weight.shape.str() + ", expected [tokens, top_k]");
}

// The 16-byte chunk path when every row operand allows it, else scalars.
template <typename F>
void dispatch_chunk(int64_t width, std::initializer_list<const void*> pointers, F&& f) {
  bool vector = width % 8 == 0;
  for (const void* p : pointers) vector = vector && aligned16(p);
  if (vector) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

unsigned row_blocks(int64_t rows) { return grid_for(rows, 1, 65535); }

size_t sort_smem_bytes(const char* op, const void* kernel, size_t bytes) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  expect(bytes <= static_cast<size_t>(optin), op, "needs " + std::to_string(bytes) +
                                                      " bytes of shared memory, the device allows " + std::to_string(optin));
  if (bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return bytes;
}

}  // namespace

void moe_permutation(const MoePermutationArgs& args, cudaStream_t stream) {
  const char* op = "moe_permutation";
  const TensorView& topk = args.topk_index;
  expect_dtype(op, "topk_index", topk, DType::kI32);
  expect(topk.ndim() == 2, op, "topk_index is " + topk.shape.str() + ", expected [tokens, top_k]");
  const int64_t pairs = topk.numel();
  const int64_t experts = args.num_experts;
  expect(experts >= 1 && experts <= INT_MAX / 2, op, "num_experts is " + std::to_string(experts));
  expect(pairs <= INT_MAX, op, std::to_string(pairs) + " pairs do not fit int32 rows");
  expect_dtype(op, "expert_offsets", args.expert_offsets, DType::kI32);
  expect(args.expert_offsets.numel() == experts + 1, op,
         "expert_offsets is " + args.expert_offsets.shape.str() + ", expected [" + std::to_string(experts + 1) + "]");
  expect_dtype(op, "sorted_pair", args.sorted_pair, DType::kI32);
  expect(args.sorted_pair.numel() == pairs, op,
         "sorted_pair is " + args.sorted_pair.shape.str() + ", expected " + std::to_string(pairs) + " entries");
  expect_dtype(op, "pair_row", args.pair_row, DType::kI32);
  expect(args.pair_row.numel() == pairs, op,
         "pair_row is " + args.pair_row.shape.str() + ", expected " + std::to_string(pairs) + " entries");

  const int E = static_cast<int>(experts);
  const int64_t chunks = (pairs + kChunkPairs - 1) / kChunkPairs;
  int32_t* chunk_counts = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&chunk_counts),
                             sizeof(int32_t) * static_cast<size_t>(chunks * experts + 1), stream));
  const auto* expert_of = static_cast<const int32_t*>(topk.data);
  const unsigned sort_blocks = static_cast<unsigned>((chunks + kSortWarpsPerBlock - 1) / kSortWarpsPerBlock);
  const size_t per_block = sizeof(int32_t) * kSortWarpsPerBlock * static_cast<size_t>(experts);
  if (chunks > 0) {
    const size_t smem = sort_smem_bytes(op, reinterpret_cast<const void*>(moe_permutation_count_kernel), per_block);
    moe_permutation_count_kernel<<<sort_blocks, kSortWarpsPerBlock * kWarpSize, smem, stream>>>(chunk_counts, expert_of,
                                                                                                 pairs, chunks, E);
    CUDA_CHECK_LAUNCH();
  }
  const size_t scan_smem = sort_smem_bytes(op, reinterpret_cast<const void*>(moe_permutation_scan_kernel),
                                           sizeof(int32_t) * static_cast<size_t>(experts + 1));
  moe_permutation_scan_kernel<<<1, kScanThreads, scan_smem, stream>>>(static_cast<int32_t*>(args.expert_offsets.data),
                                                                      chunk_counts, chunks, E);
  CUDA_CHECK_LAUNCH();
  if (chunks > 0) {
    const size_t smem = sort_smem_bytes(op, reinterpret_cast<const void*>(moe_permutation_scatter_kernel), per_block);
    moe_permutation_scatter_kernel<<<sort_blocks, kSortWarpsPerBlock * kWarpSize, smem, stream>>>(
        static_cast<int32_t*>(args.sorted_pair.data), static_cast<int32_t*>(args.pair_row.data), chunk_counts,
        expert_of, pairs, chunks, E);
    CUDA_CHECK_LAUNCH();
  }
  CUDA_CHECK(cudaFreeAsync(chunk_counts, stream));
}

void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k,
                 cudaStream_t stream) {
  const char* op = "moe_permute";
  expect(top_k >= 1, op, "top_k is " + std::to_string(top_k));
  const MutOperand out_op = row_out(op, "out", out);
  const ConstOperand x_op = row_in(op, "x", x);
  const int64_t rows = out.size(0), width = row_width(x);
  expect(row_width(out) == width || rows == 0, op, "out " + out.shape.str() + " and x " + x.shape.str() + " rows differ in width");
  expect_dtype(op, "sorted_pair", sorted_pair, DType::kI32);
  expect(sorted_pair.numel() == rows, op, "sorted_pair is " + sorted_pair.shape.str() + " for " + std::to_string(rows) + " rows");
  if (rows == 0 || width == 0) return;
  dispatch_chunk(width, {out.data, x.data}, [&](auto chunk) {
    moe_permute_gather_kernel<decltype(chunk)::value><<<row_blocks(rows), kRowThreads, 0, stream>>>(
        out_op, x_op, static_cast<const int32_t*>(sorted_pair.data), rows, x.size(0), top_k, width);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                       bool accumulate, cudaStream_t stream) {
  const char* op = "moe_unpermute_sum";
  expect(top_k >= 1, op, "top_k is " + std::to_string(top_k));
  const MutOperand dx_op = row_out(op, "dx", dx);
  const ConstOperand drows_op = row_in(op, "drows", drows);
  const int64_t tokens = dx.size(0), width = row_width(dx);
  expect(row_width(drows) == width || drows.size(0) == 0, op,
         "dx " + dx.shape.str() + " and drows " + drows.shape.str() + " rows differ in width");
  expect_pair_row(op, pair_row, tokens, top_k);
  if (tokens == 0 || width == 0) return;
  dispatch_chunk(width, {dx.data, drows.data}, [&](auto chunk) {
    moe_unpermute_sum_kernel<decltype(chunk)::value><<<row_blocks(tokens), kRowThreads, 0, stream>>>(
        dx_op, drows_op, static_cast<const int32_t*>(pair_row.data), tokens, drows.size(0), top_k, width, accumulate);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_combine(const MoeCombineArgs& args, cudaStream_t stream) {
  const char* op = "moe_combine";
  expect_combine_weight(op, args.weight);
  const int64_t tokens = args.weight.size(0), top_k = args.weight.size(1);
  const MutOperand out = row_out(op, "out", args.out);
  const ConstOperand rows = row_in(op, "rows", args.rows);
  const int64_t width = row_width(args.out);
  expect(args.out.size(0) == tokens && (row_width(args.rows) == width || args.rows.size(0) == 0), op,
         "out " + args.out.shape.str() + ", rows " + args.rows.shape.str() + ", weight " + args.weight.shape.str() +
             " do not fit together");
  expect_pair_row(op, args.pair_row, tokens, top_k);
  if (tokens == 0 || width == 0) return;
  dispatch_chunk(width, {args.out.data, args.rows.data}, [&](auto chunk) {
    moe_combine_kernel<decltype(chunk)::value><<<row_blocks(tokens), kRowThreads, 0, stream>>>(
        out, rows, static_cast<const float*>(args.weight.data), static_cast<const int32_t*>(args.pair_row.data), tokens,
        args.rows.size(0), top_k, width);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_combine_backward(const MoeCombineBackwardArgs& args, cudaStream_t stream) {
  const char* op = "moe_combine_backward";
  expect_combine_weight(op, args.weight);
  const int64_t tokens = args.weight.size(0), top_k = args.weight.size(1);
  expect_dtype(op, "dweight", args.dweight, DType::kF32);
  const MutOperand drows = row_out(op, "drows", args.drows);
  const ConstOperand dout = row_in(op, "dout", args.dout);
  const ConstOperand rows = row_in(op, "rows", args.rows);
  const int64_t width = row_width(args.dout);
  expect(args.dout.size(0) == tokens && (row_width(args.rows) == width || args.rows.size(0) == 0) &&
             args.drows.shape == args.rows.shape && args.dweight.shape == args.weight.shape,
         op, "dout " + args.dout.shape.str() + ", rows " + args.rows.shape.str() + ", drows " + args.drows.shape.str() +
                 ", weight " + args.weight.shape.str() + ", dweight " + args.dweight.shape.str() + " do not fit together");
  expect_pair_row(op, args.pair_row, tokens, top_k);
  // With exactly one row per pair, pair_row (from moe_permutation) is a bijection and every row
  // is written below; otherwise rows no pair maps to must read as zero gradient.
  if (args.drows.size(0) != tokens * top_k && args.drows.nbytes() > 0) {
    CUDA_CHECK(cudaMemsetAsync(args.drows.data, 0, args.drows.nbytes(), stream));  // zero bits: 0.0 in F32 and BF16
  }
  if (tokens == 0 || top_k == 0) return;
  dispatch_chunk(width, {args.drows.data, args.dout.data, args.rows.data}, [&](auto chunk) {
    moe_combine_backward_kernel<decltype(chunk)::value><<<row_blocks(tokens), kRowThreads, 0, stream>>>(
        drows, static_cast<float*>(args.dweight.data), dout, rows, static_cast<const float*>(args.weight.data),
        static_cast<const int32_t*>(args.pair_row.data), tokens, args.rows.size(0), top_k, width);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace moetrain::kernels::cuda_ops
