// The indexer key's LayerNorm and the attention output gate (kernels/ops.h LayerNormArgs,
// AttentionGateArgs; kernels/cpu/dsa.cpp and attention_gate.cpp are the spec). F32 math, every
// operand BF16 or F32. Row reductions (LayerNorm statistics, the headwise gate's dot) are one warp
// per row with a fixed shuffle tree, so results are deterministic; a lane writes only elements it
// read itself, after the row's reduction, which makes y = x (and dx = dy) aliasing safe.
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/dsa/dsa_norm_gate.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;  // one warp per row

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// expf(-g) overflows to inf for very negative g, which correctly gives 0.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// Two passes over the row for the statistics (mean, then the centred sum of squares, as the
// reference computes them), a third to write.
__global__ void layernorm_forward_kernel(MutOperand y, ConstOperand x, ConstOperand weight, ConstOperand bias,
                                         int64_t rows, int64_t dim, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t base = row * dim;
  float sum = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) sum += load_one(x, base + j);
  const float mean = warp_sum(sum) / static_cast<float>(dim);
  float squares = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) {
    const float centred = load_one(x, base + j) - mean;
    squares += centred * centred;
  }
  const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(dim) + eps);
  for (int64_t j = lane; j < dim; j += 32) {
    store_one(y, base + j, (load_one(x, base + j) - mean) * rstd * load_one(weight, j) + load_one(bias, j));
  }
}

// Elementwise gate (one gate per element) or headwise (one per row of `dim`), forward.
__global__ void attention_gate_forward_kernel(MutOperand y, ConstOperand x, ConstOperand gate, int64_t total,
                                              int64_t dim, bool headwise) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = sigmoid(load_one(gate, headwise ? i / dim : i));
    store_one(y, i, load_one(x, i) * s);
  }
}

__global__ void attention_gate_backward_elementwise_kernel(MutOperand dx, MutOperand dgate, ConstOperand dy,
                                                           ConstOperand x, ConstOperand gate, int64_t total) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = sigmoid(load_one(gate, i)), g = load_one(dy, i);
    store_one(dgate, i, g * load_one(x, i) * s * (1.0f - s));
    store_one(dx, i, g * s);
  }
}

// One warp per (token, head) row: dgate = (dy . x) s (1 - s), dx = dy s.
__global__ void attention_gate_backward_headwise_kernel(MutOperand dx, MutOperand dgate, ConstOperand dy,
                                                        ConstOperand x, ConstOperand gate, int64_t rows,
                                                        int64_t dim) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t base = row * dim;
  float dot = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) dot += load_one(dy, base + j) * load_one(x, base + j);
  dot = warp_sum(dot);
  const float s = sigmoid(load_one(gate, row));
  if (lane == 0) store_one(dgate, row, dot * s * (1.0f - s));
  for (int64_t j = lane; j < dim; j += 32) store_one(dx, base + j, load_one(dy, base + j) * s);
}

unsigned int row_blocks(int64_t rows) { return static_cast<unsigned int>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

}  // namespace

void layernorm_forward(const LayerNormArgs& args, cudaStream_t stream) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = dim == 0 ? 0 : args.x.numel() / dim;
  if (rows == 0) return;
  layernorm_forward_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(
      MutOperand{args.y.data, kind_of(args.y.dtype)}, ConstOperand{args.x.data, kind_of(args.x.dtype)},
      ConstOperand{args.weight.data, kind_of(args.weight.dtype)}, ConstOperand{args.bias.data, kind_of(args.bias.dtype)},
      rows, dim, static_cast<float>(args.eps));
  CUDA_CHECK_LAUNCH();
}

void attention_gate_forward(const AttentionGateArgs& args, cudaStream_t stream) {
  const int64_t total = args.x.numel(), dim = args.x.size(2);
  if (total == 0) return;
  attention_gate_forward_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(
      MutOperand{args.y.data, kind_of(args.y.dtype)}, ConstOperand{args.x.data, kind_of(args.x.dtype)},
      ConstOperand{args.gate.data, kind_of(args.gate.dtype)}, total, dim, args.headwise);
  CUDA_CHECK_LAUNCH();
}

void attention_gate_backward(const AttentionGateBackwardArgs& args, cudaStream_t stream) {
  const int64_t total = args.x.numel(), dim = args.x.size(2);
  if (total == 0) return;
  const MutOperand dx{args.dx.data, kind_of(args.dx.dtype)}, dgate{args.dgate.data, kind_of(args.dgate.dtype)};
  const ConstOperand dy{args.dy.data, kind_of(args.dy.dtype)}, x{args.x.data, kind_of(args.x.dtype)},
      gate{args.gate.data, kind_of(args.gate.dtype)};
  if (args.headwise) {
    const int64_t rows = total / dim;
    attention_gate_backward_headwise_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(dx, dgate, dy, x, gate, rows,
                                                                                       dim);
  } else {
    attention_gate_backward_elementwise_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(dx, dgate, dy, x,
                                                                                                  gate, total);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
