// L2 norm (q and k of KDA) and the gated RMSNorm of KDA's output:
//   l2norm:        y = x inv,  inv = 1 / sqrt(sum x^2 + eps)
//                  dx = inv dy - (x . dy) inv^3 x
//   gated rmsnorm: y = x rstd w sigmoid(gate),  rstd = 1 / sqrt(mean x^2 + eps)
//                  dx = rstd w sig dy - (sum_j x dy w sig) rstd^3 / dim x,
//                  dgate = dy x rstd w sig (1 - sig),  dweight = sum_rows dy x rstd sig
// One warp per row: lane l owns elements l, l + 32, ... (coalesced), a warp-shuffle sum, then
// the same lane writes the same elements. Sums in fixed order: deterministic.
#include "kernels/cuda/kda/kda_norms.h"

#include "core/base/tensor.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRowsPerBlock = kNormThreads / 32;

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }
ConstOperand in(const TensorView& t) { return {t.data, kind_of(t.dtype)}; }
MutOperand out(const TensorView& t) { return {t.data, kind_of(t.dtype)}; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + __expf(-z)); }

// The warp's row, or -1 past the last (the whole warp agrees).
__device__ __forceinline__ int64_t warp_row(int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  return row < rows ? row : -1;
}

__global__ void l2norm_forward_kernel(MutOperand y, float* inv_norm, ConstOperand x, int64_t rows, int64_t dim,
                                      float eps) {
  const int64_t row = warp_row(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t base = row * dim;
  float sum = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) {
    const float v = load_one(x, base + j);
    sum = fmaf(v, v, sum);
  }
  const float inv = rsqrtf(warp_sum(sum) + eps);
  if (lane == 0) inv_norm[row] = inv;
  for (int64_t j = lane; j < dim; j += 32) store_one(y, base + j, load_one(x, base + j) * inv);
}

__global__ void l2norm_backward_kernel(MutOperand dx, ConstOperand dy, ConstOperand x, const float* inv_norm,
                                       int64_t rows, int64_t dim) {
  const int64_t row = warp_row(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t base = row * dim;
  float dot = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) dot = fmaf(load_one(x, base + j), load_one(dy, base + j), dot);
  const float inv = inv_norm[row];
  const float coef = warp_sum(dot) * inv * inv * inv;
  for (int64_t j = lane; j < dim; j += 32)
    store_one(dx, base + j, inv * load_one(dy, base + j) - coef * load_one(x, base + j));
}

__global__ void gated_rmsnorm_forward_kernel(MutOperand y, float* rstd, ConstOperand x, ConstOperand gate,
                                             ConstOperand weight, int64_t rows, int64_t dim, float eps) {
  const int64_t row = warp_row(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t base = row * dim;
  float sum = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) {
    const float v = load_one(x, base + j);
    sum = fmaf(v, v, sum);
  }
  const float s = rsqrtf(warp_sum(sum) / static_cast<float>(dim) + eps);
  if (lane == 0) rstd[row] = s;
  for (int64_t j = lane; j < dim; j += 32)
    store_one(y, base + j, load_one(x, base + j) * s * load_one(weight, j) * sigmoidf(load_one(gate, base + j)));
}

__global__ void gated_rmsnorm_backward_kernel(MutOperand dx, MutOperand dgate, ConstOperand dy, ConstOperand x,
                                              ConstOperand gate, ConstOperand weight, const float* rstd, int64_t rows,
                                              int64_t dim) {
  const int64_t row = warp_row(rows);
  if (row < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t base = row * dim;
  float dot = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) {
    dot = fmaf(load_one(x, base + j), load_one(dy, base + j) * load_one(weight, j) * sigmoidf(load_one(gate, base + j)),
               dot);
  }
  const float s = rstd[row];
  const float coef = warp_sum(dot) * s * s * s / static_cast<float>(dim);
  for (int64_t j = lane; j < dim; j += 32) {
    const float xv = load_one(x, base + j), g = load_one(dy, base + j), w = load_one(weight, j);
    const float sig = sigmoidf(load_one(gate, base + j));
    store_one(dx, base + j, s * g * w * sig - coef * xv);
    store_one(dgate, base + j, g * xv * s * w * sig * (1.0f - sig));
  }
}

// partial[chunk, j] = sum over the chunk's rows of dy x rstd sigmoid(gate); one thread per column.
__global__ void gated_rmsnorm_dweight_partial_kernel(float* partial, ConstOperand dy, ConstOperand x,
                                                     ConstOperand gate, const float* rstd, int64_t rows, int64_t dim,
                                                     int64_t rows_per_chunk) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = min(rows, begin + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t i = r * dim + j;
    acc += load_one(dy, i) * load_one(x, i) * rstd[r] * sigmoidf(load_one(gate, i));
  }
  partial[static_cast<int64_t>(blockIdx.y) * dim + j] = acc;
}

__global__ void column_total_kernel(float* total, const float* partial, int64_t chunks, int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[c * dim + j];
  total[j] = acc;
}

struct RowShape {
  int64_t rows;
  int64_t dim;
};
RowShape row_shape(const TensorView& x) {
  const int64_t dim = x.size(-1);
  return {dim == 0 ? 0 : x.numel() / dim, dim};
}
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

}  // namespace

void l2norm_forward(const L2NormArgs& args, cudaStream_t stream) {
  const RowShape s = row_shape(args.x);
  if (s.rows == 0) return;
  l2norm_forward_kernel<<<row_blocks(s.rows), kNormThreads, 0, stream>>>(
      out(args.y), static_cast<float*>(args.inv_norm.data), in(args.x), s.rows, s.dim, static_cast<float>(args.eps));
  CUDA_CHECK_LAUNCH();
}

void l2norm_backward(const L2NormBackwardArgs& args, cudaStream_t stream) {
  const RowShape s = row_shape(args.x);
  if (s.rows == 0) return;
  l2norm_backward_kernel<<<row_blocks(s.rows), kNormThreads, 0, stream>>>(
      out(args.dx), in(args.dy), in(args.x), static_cast<const float*>(args.inv_norm.data), s.rows, s.dim);
  CUDA_CHECK_LAUNCH();
}

void gated_rmsnorm_forward(const GatedRmsNormArgs& args, cudaStream_t stream) {
  const RowShape s = row_shape(args.x);
  if (s.rows == 0) return;
  gated_rmsnorm_forward_kernel<<<row_blocks(s.rows), kNormThreads, 0, stream>>>(
      out(args.y), static_cast<float*>(args.rstd.data), in(args.x), in(args.gate), in(args.weight), s.rows, s.dim,
      static_cast<float>(args.eps));
  CUDA_CHECK_LAUNCH();
}

void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args, cudaStream_t stream) {
  const RowShape s = row_shape(args.x);
  const auto* rstd = static_cast<const float*>(args.rstd.data);
  if (s.rows > 0) {
    gated_rmsnorm_backward_kernel<<<row_blocks(s.rows), kNormThreads, 0, stream>>>(
        out(args.dx), out(args.dgate), in(args.dy), in(args.x), in(args.gate), in(args.weight), rstd, s.rows, s.dim);
    CUDA_CHECK_LAUNCH();
  }
  if (args.dweight.data == nullptr || s.dim == 0) return;
  if (s.rows == 0) {
    CUDA_CHECK(cudaMemsetAsync(args.dweight.data, 0, args.dweight.nbytes(), stream));
    return;
  }
  // At most 512 chunks of at least 64 rows: the chunking depends on `rows` only (reproducible).
  int64_t rows_per_chunk = (s.rows + 511) / 512;
  if (rows_per_chunk < 64) rows_per_chunk = 64;
  const int64_t chunks = (s.rows + rows_per_chunk - 1) / rows_per_chunk;
  constexpr int kThreads = 256;
  const unsigned column_blocks = static_cast<unsigned>((s.dim + kThreads - 1) / kThreads);
  // A temporary like any other (the backend's one stream orders its use).
  Tensor partials(Shape{chunks * s.dim}, DType::kF32, cuda::device_allocator());
  float* partial = partials.ptr<float>();
  gated_rmsnorm_dweight_partial_kernel<<<dim3(column_blocks, static_cast<unsigned>(chunks)), kThreads, 0, stream>>>(
      partial, in(args.dy), in(args.x), in(args.gate), rstd, s.rows, s.dim, rows_per_chunk);
  CUDA_CHECK_LAUNCH();
  column_total_kernel<<<column_blocks, kThreads, 0, stream>>>(static_cast<float*>(args.dweight.data), partial, chunks,
                                                              s.dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
