// RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// Backward: dx (=|+=) rstd * w * dy - (sum_j dy_j w_j x_j) * rstd^3 / dim * x,
//           dweight = sum_rows dy * x * rstd (overwritten).
// Each row is read by one block (sum pass, then the output pass; the block barrier in between
// makes y/dx aliasing x/dy safe). Sums use block_sum's fixed tree: deterministic.
#include "kernels/cuda/rmsnorm.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

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

// Threads per row block: enough for the row's chunks, a multiple of 32, at most 512.
int row_threads(int64_t chunks) {
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
  if (dim % 8 == 0 && aligned16(y.data) && aligned16(x.data) && aligned16(w.data)) {
    rmsnorm_forward_kernel<8><<<static_cast<unsigned int>(rows), row_threads(dim / 8), 0, stream>>>(y, rstd, x, w, dim, eps);
  } else {
    rmsnorm_forward_kernel<1><<<static_cast<unsigned int>(rows), row_threads(dim), 0, stream>>>(y, rstd, x, w, dim, eps);
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
    if (dim % 8 == 0 && aligned16(dx.data) && aligned16(dy.data) && aligned16(x.data) && aligned16(w.data)) {
      rmsnorm_backward_dx_kernel<8><<<static_cast<unsigned int>(rows), row_threads(dim / 8), 0, stream>>>(
          dx, dy, x, w, rstd, dim, args.accumulate);
    } else {
      rmsnorm_backward_dx_kernel<1><<<static_cast<unsigned int>(rows), row_threads(dim), 0, stream>>>(
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
