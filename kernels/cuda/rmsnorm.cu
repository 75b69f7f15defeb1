// RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// Backward: dx (=|+=) rstd * w * dy - (sum_j dy_j w_j x_j) * rstd^3 / dim * x,
//           dweight = sum_rows dy * x * rstd (overwritten).
// Rows up to 32K elements forward, 16K backward (vector path; 4K/2K scalar) take the
// register-resident kernels: a row is read from device memory once into the registers of
// `row_threads` threads (16-byte loads on the vector path), its sum is reduced by warp shuffles
// (or block_sum when a row needs more than a warp), and the same registers produce the output.
// A thread writes only the chunks it read, and only after the row's reduction (which needs every
// thread's loads), so y/dx aliasing x/dy is safe. Longer rows take the two-pass kernels (one
// block per row, the row read twice).
// All sums use fixed trees: deterministic.
#include "kernels/cuda/rmsnorm.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

// Sum over a row's `row_threads` consecutive threads, every one of them getting the total, in a
// fixed order. row_threads is a power of two up to 32 (a segment of a warp: xor offsets below it
// stay inside the segment), or the whole block (a multiple of 32). Every thread of the block
// must call it.
__device__ __forceinline__ float row_sum(float value, int row_threads, float* scratch) {
  if (row_threads > 32) return block_sum(value, scratch);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < row_threads) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Where a thread's row and chunks are: the block holds blockDim.x / row_threads rows; the thread
// owns chunks lane, lane + row_threads, ... (coalesced across the row's threads).
struct RowSlot {
  int64_t row;
  int lane;
  bool valid;
};
__device__ __forceinline__ RowSlot row_slot(int64_t rows, int row_threads) {
  RowSlot slot;
  slot.lane = static_cast<int>(threadIdx.x) % row_threads;
  slot.row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  slot.valid = slot.row < rows;
  return slot;
}

constexpr int kMaxRowThreads = 512;

// 16-byte stores on the vector path, even where the compiler would split store_chunk<8>.
template <int kChunk>
__device__ __forceinline__ void store_row_chunk(MutOperand dst, int64_t i, const float (&v)[kChunk]) {
  if constexpr (kChunk == 8) {
    store_chunk8_wide(dst, i, v);
  } else {
    store_chunk<kChunk>(dst, i, v);
  }
}

template <int kChunk, int kPerThread>
__global__ void __launch_bounds__(kMaxRowThreads)
    rmsnorm_forward_rows_kernel(MutOperand y, float* __restrict__ rstd, ConstOperand x, ConstOperand weight,
                                int64_t rows, int64_t dim, int row_threads, float eps) {
  __shared__ float reduce[32];
  const RowSlot slot = row_slot(rows, row_threads);
  const int64_t chunks = dim / kChunk, base = slot.row * dim;
  // Every load before the reduction (the weights too: the wide stores are compiler barriers, so
  // loads left between them would wait one by one).
  float v[kPerThread][kChunk], w[kPerThread][kChunk];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t c = slot.lane + static_cast<int64_t>(k) * row_threads;
    if (slot.valid && c < chunks) {
      load_chunk<kChunk>(v[k], x, base + c * kChunk);
      load_chunk<kChunk>(w[k], weight, c * kChunk);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[k][e] = w[k][e] = 0.0f;
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
#pragma unroll
    for (int e = 0; e < kChunk; ++e) sum_sq += v[k][e] * v[k][e];
  const float total = row_sum(sum_sq, row_threads, reduce);
  if (!slot.valid) return;  // after the last collective
  const float s = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  if (slot.lane == 0) rstd[slot.row] = s;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t c = slot.lane + static_cast<int64_t>(k) * row_threads;
    if (c >= chunks) break;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[k][e] = v[k][e] * s * w[k][e];
    store_row_chunk<kChunk>(y, base + c * kChunk, v[k]);
  }
}

// kAccumulate: dx += (a template argument: the non-accumulating kernel needs no registers for dx).
template <int kChunk, int kPerThread, bool kAccumulate>
__global__ void __launch_bounds__(kMaxRowThreads)
    rmsnorm_backward_dx_rows_kernel(MutOperand dx, ConstOperand dy, ConstOperand x, ConstOperand weight,
                                    const float* __restrict__ rstd, int64_t rows, int64_t dim, int row_threads) {
  __shared__ float reduce[32];
  const RowSlot slot = row_slot(rows, row_threads);
  const int64_t chunks = dim / kChunk, base = slot.row * dim;
  // Every load before the reduction (the wide stores are compiler barriers, so loads left
  // between them would wait one by one). g becomes s * w * dy once the dot has used it.
  float g[kPerThread][kChunk], v[kPerThread][kChunk], acc[kPerThread][kChunk];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t c = slot.lane + static_cast<int64_t>(k) * row_threads;
    const bool here = slot.valid && c < chunks;
    if (here) {
      load_chunk<kChunk>(g[k], dy, base + c * kChunk);
      load_chunk<kChunk>(v[k], x, base + c * kChunk);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) g[k][e] = v[k][e] = 0.0f;
    }
    if (here && kAccumulate) {
      load_chunk<kChunk>(acc[k], dx, base + c * kChunk);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) acc[k][e] = 0.0f;
    }
  }
  const float s = slot.valid ? rstd[slot.row] : 0.0f;
  float dot = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t c = slot.lane + static_cast<int64_t>(k) * row_threads;
    if (slot.valid && c < chunks) {
      float w[kChunk];
      load_chunk<kChunk>(w, weight, c * kChunk);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        dot += g[k][e] * w[e] * v[k][e];
        g[k][e] = s * w[e] * g[k][e];
      }
    }
  }
  const float total = row_sum(dot, row_threads, reduce);
  if (!slot.valid) return;  // after the last collective
  const float coef = total * s * s * s / static_cast<float>(dim);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t c = slot.lane + static_cast<int64_t>(k) * row_threads;
    if (c >= chunks) break;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) acc[k][e] += g[k][e] - coef * v[k][e];
    store_row_chunk<kChunk>(dx, base + c * kChunk, acc[k]);
  }
}

// How a row is spread over threads for the register-resident kernels: `per_thread` chunks per
// thread (1, 4 or 8), `row_threads` threads per row (a power of two up to 32, else a multiple of
// 32 up to kMaxRowThreads, one row per block), `block` threads per block. per_thread == 0: the
// row is too long, use the two-pass kernels.
struct RowPlan {
  int per_thread = 0, row_threads = 0, block = 0;
  int64_t rows_per_block = 1;
};
// max_per_thread: 8, or 4 where eight chunks of two operands would spill registers (backward).
RowPlan plan_rows(int64_t chunks, int max_per_thread) {
  RowPlan plan;
  // Four 16-byte loads in flight per thread (per operand) keep the memory system busy; longer
  // rows take eight before a row needs more than kMaxRowThreads threads.
  if (chunks <= 32) {
    plan.per_thread = 1;
  } else if (chunks <= 4 * int64_t{kMaxRowThreads}) {
    plan.per_thread = 4;
  } else if (max_per_thread >= 8 && chunks <= 8 * int64_t{kMaxRowThreads}) {
    plan.per_thread = 8;
  } else {
    return plan;
  }
  const int64_t needed = (chunks + plan.per_thread - 1) / plan.per_thread;
  if (needed <= 32) {
    int threads = 1;
    while (threads < needed) threads *= 2;
    plan.row_threads = threads;
    plan.block = 128;  // several rows per block
    plan.rows_per_block = plan.block / threads;
  } else {
    plan.row_threads = static_cast<int>((needed + 31) / 32 * 32);
    plan.block = plan.row_threads;
    plan.rows_per_block = 1;
  }
  return plan;
}

unsigned int row_blocks(int64_t rows, const RowPlan& plan) {
  return static_cast<unsigned int>((rows + plan.rows_per_block - 1) / plan.rows_per_block);
}

template <int kChunk>
bool launch_forward_rows(MutOperand y, float* rstd, ConstOperand x, ConstOperand w, int64_t rows, int64_t dim,
                         float eps, cudaStream_t stream) {
  const RowPlan plan = plan_rows(dim / kChunk, 8);
  const unsigned int blocks = row_blocks(rows, plan);
  switch (plan.per_thread) {
    case 1:
      rmsnorm_forward_rows_kernel<kChunk, 1><<<blocks, plan.block, 0, stream>>>(y, rstd, x, w, rows, dim,
                                                                                plan.row_threads, eps);
      return true;
    case 4:
      rmsnorm_forward_rows_kernel<kChunk, 4><<<blocks, plan.block, 0, stream>>>(y, rstd, x, w, rows, dim,
                                                                                plan.row_threads, eps);
      return true;
    case 8:
      rmsnorm_forward_rows_kernel<kChunk, 8><<<blocks, plan.block, 0, stream>>>(y, rstd, x, w, rows, dim,
                                                                                plan.row_threads, eps);
      return true;
    default:
      return false;
  }
}

template <int kChunk, bool kAccumulate>
bool launch_backward_dx_rows_as(MutOperand dx, ConstOperand dy, ConstOperand x, ConstOperand w, const float* rstd,
                             int64_t rows, int64_t dim, cudaStream_t stream) {
  const RowPlan plan = plan_rows(dim / kChunk, 4);
  const unsigned int blocks = row_blocks(rows, plan);
  switch (plan.per_thread) {
    case 1:
      rmsnorm_backward_dx_rows_kernel<kChunk, 1, kAccumulate><<<blocks, plan.block, 0, stream>>>(
          dx, dy, x, w, rstd, rows, dim, plan.row_threads);
      return true;
    case 4:
      rmsnorm_backward_dx_rows_kernel<kChunk, 4, kAccumulate><<<blocks, plan.block, 0, stream>>>(
          dx, dy, x, w, rstd, rows, dim, plan.row_threads);
      return true;
    default:
      return false;
  }
}

template <int kChunk>
bool launch_backward_dx_rows(MutOperand dx, ConstOperand dy, ConstOperand x, ConstOperand w, const float* rstd,
                             int64_t rows, int64_t dim, bool accumulate, cudaStream_t stream) {
  return accumulate ? launch_backward_dx_rows_as<kChunk, true>(dx, dy, x, w, rstd, rows, dim, stream)
                    : launch_backward_dx_rows_as<kChunk, false>(dx, dy, x, w, rstd, rows, dim, stream);
}

// The two-pass kernels, for rows too long for registers: one block per row, a sum pass, then
// the output pass (the block barrier in between makes y/dx aliasing x/dy safe).
template <int kChunk>
__global__ void rmsnorm_forward_kernel(MutOperand y, float* __restrict__ rstd, ConstOperand x, ConstOperand weight,
                                       int64_t dim, float eps) {
  __shared__ float reduce[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t chunks = dim / kChunk;
  float sum_sq = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk];
    load_chunk<kChunk>(v, x, base + c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) sum_sq += v[e] * v[e];
  }
  const float total = block_sum(sum_sq, reduce);
  const float s = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = s;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk], w[kChunk];
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = v[e] * s * w[e];
    store_chunk<kChunk>(y, base + c * kChunk, v);
  }
}

template <int kChunk>
__global__ void rmsnorm_backward_dx_kernel(MutOperand dx, ConstOperand dy, ConstOperand x, ConstOperand weight,
                                           const float* __restrict__ rstd, int64_t dim, bool accumulate) {
  __shared__ float reduce[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t chunks = dim / kChunk;
  const float s = rstd[blockIdx.x];
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float g[kChunk], v[kChunk], w[kChunk];
    load_chunk<kChunk>(g, dy, base + c * kChunk);
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) dot += g[e] * w[e] * v[e];
  }
  const float coef = block_sum(dot, reduce) * s * s * s / static_cast<float>(dim);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float g[kChunk], v[kChunk], w[kChunk], out[kChunk];
    load_chunk<kChunk>(g, dy, base + c * kChunk);
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
    if (accumulate) {
      load_chunk<kChunk>(out, dx, base + c * kChunk);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) out[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kChunk; ++e) out[e] += s * w[e] * g[e] - coef * v[e];
    store_chunk<kChunk>(dx, base + c * kChunk, out);
  }
}

// Stage 1: partial[chunk, j] = sum over rows [chunk * rows_per_chunk, ...) of dy * x * rstd.
// One thread per column: row reads are coalesced across the block.
__global__ void rmsnorm_dweight_partial_kernel(float* __restrict__ partial, ConstOperand dy, ConstOperand x,
                                               const float* __restrict__ rstd, int64_t rows, int64_t dim,
                                               int64_t rows_per_chunk) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = row_begin; r < row_end; ++r) acc += load_one(dy, r * dim + j) * load_one(x, r * dim + j) * rstd[r];
  partial[static_cast<int64_t>(blockIdx.y) * dim + j] = acc;
}

// Stage 2: dweight[j] = sum over chunks in order.
__global__ void rmsnorm_dweight_total_kernel(float* __restrict__ dweight, const float* __restrict__ partial,
                                             int64_t chunks, int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[c * dim + j];
  dweight[j] = acc;
}

// Two-pass kernels, threads per row block: enough for the row's chunks, a multiple of 32, at most 512.
int two_pass_threads(int64_t chunks) {
  int64_t threads = (chunks + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  if (threads > 512) threads = 512;
  return static_cast<int>(threads);
}

}  // namespace

void rmsnorm_forward(const RmsNormArgs& args, cudaStream_t stream) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = dim == 0 ? 0 : args.x.numel() / dim;
  if (rows == 0) return;
  const MutOperand y{args.y.data, kind_of(args.y.dtype)};
  const ConstOperand x{args.x.data, kind_of(args.x.dtype)}, w{args.weight.data, kind_of(args.weight.dtype)};
  auto* rstd = static_cast<float*>(args.rstd.data);
  const float eps = static_cast<float>(args.eps);
  const bool vector = dim % 8 == 0 && aligned16(y.data) && aligned16(x.data) && aligned16(w.data);
  const bool in_registers = vector ? launch_forward_rows<8>(y, rstd, x, w, rows, dim, eps, stream)
                                   : launch_forward_rows<1>(y, rstd, x, w, rows, dim, eps, stream);
  if (!in_registers && vector) {
    rmsnorm_forward_kernel<8><<<static_cast<unsigned int>(rows), two_pass_threads(dim / 8), 0, stream>>>(y, rstd, x, w,
                                                                                                         dim, eps);
  } else if (!in_registers) {
    rmsnorm_forward_kernel<1><<<static_cast<unsigned int>(rows), two_pass_threads(dim), 0, stream>>>(y, rstd, x, w, dim,
                                                                                                     eps);
  }
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(const RmsNormBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = dim == 0 ? 0 : args.x.numel() / dim;
  const MutOperand dx{args.dx.data, kind_of(args.dx.dtype)};
  const ConstOperand dy{args.dy.data, kind_of(args.dy.dtype)}, x{args.x.data, kind_of(args.x.dtype)},
      w{args.weight.data, kind_of(args.weight.dtype)};
  const auto* rstd = static_cast<const float*>(args.rstd.data);
  if (rows > 0) {
    const bool vector =
        dim % 8 == 0 && aligned16(dx.data) && aligned16(dy.data) && aligned16(x.data) && aligned16(w.data);
    const bool accumulate = args.accumulate;
    const bool in_registers = vector ? launch_backward_dx_rows<8>(dx, dy, x, w, rstd, rows, dim, accumulate, stream)
                                     : launch_backward_dx_rows<1>(dx, dy, x, w, rstd, rows, dim, accumulate, stream);
    if (!in_registers && vector) {
      rmsnorm_backward_dx_kernel<8><<<static_cast<unsigned int>(rows), two_pass_threads(dim / 8), 0, stream>>>(
          dx, dy, x, w, rstd, dim, args.accumulate);
    } else if (!in_registers) {
      rmsnorm_backward_dx_kernel<1><<<static_cast<unsigned int>(rows), two_pass_threads(dim), 0, stream>>>(
          dx, dy, x, w, rstd, dim, args.accumulate);
    }
    CUDA_CHECK_LAUNCH();
  }
  if (args.dweight.data == nullptr || dim == 0) return;
  // At most 512 chunks of at least 64 rows: the chunking depends on `rows` only (reproducible).
  int64_t rows_per_chunk = (rows + 511) / 512;
  if (rows_per_chunk < 64) rows_per_chunk = 64;
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int threads = 256;
  const unsigned int column_blocks = static_cast<unsigned int>((dim + threads - 1) / threads);
  float* partial = chunks > 0 ? static_cast<float*>(scratch.reserve(sizeof(float) * chunks * dim)) : nullptr;
  if (chunks > 0) {
    rmsnorm_dweight_partial_kernel<<<dim3(column_blocks, static_cast<unsigned int>(chunks)), threads, 0, stream>>>(
        partial, dy, x, rstd, rows, dim, rows_per_chunk);
    CUDA_CHECK_LAUNCH();
  }
  rmsnorm_dweight_total_kernel<<<column_blocks, threads, 0, stream>>>(static_cast<float*>(args.dweight.data), partial,
                                                                      chunks, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
