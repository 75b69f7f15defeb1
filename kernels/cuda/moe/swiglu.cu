#include "kernels/cuda/moe/swiglu.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

// expf(-g) overflows to inf for very negative g, which correctly gives 0.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <int kChunk>
__global__ void swiglu_forward_kernel(MutOperand h, ConstOperand gate_up, int64_t rows, int64_t width) {
  const int64_t chunks_per_row = width / kChunk;
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, j = (i % chunks_per_row) * kChunk;
    float g[kChunk], u[kChunk];
    load_chunk<kChunk>(g, gate_up, r * 2 * width + j);
    load_chunk<kChunk>(u, gate_up, r * 2 * width + width + j);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) g[e] = g[e] * sigmoid(g[e]) * u[e];
    store_chunk<kChunk>(h, r * width + j, g);
  }
}

template <int kChunk>
__global__ void swiglu_backward_kernel(MutOperand dgate_up, ConstOperand dh, ConstOperand gate_up, int64_t rows,
                                       int64_t width) {
  const int64_t chunks_per_row = width / kChunk;
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, j = (i % chunks_per_row) * kChunk;
    float g[kChunk], u[kChunk], d[kChunk], dg[kChunk], du[kChunk];
    load_chunk<kChunk>(g, gate_up, r * 2 * width + j);
    load_chunk<kChunk>(u, gate_up, r * 2 * width + width + j);
    load_chunk<kChunk>(d, dh, r * width + j);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const float sig = sigmoid(g[e]);
      dg[e] = d[e] * u[e] * sig * (1.0f + g[e] * (1.0f - sig));
      du[e] = d[e] * g[e] * sig;
    }
    store_chunk<kChunk>(dgate_up, r * 2 * width + j, dg);
    store_chunk<kChunk>(dgate_up, r * 2 * width + width + j, du);
  }
}

// SiTU (ops.h SituArgs); lin == 0 leaves the up branch unbounded.
template <int kChunk>
__global__ void situ_forward_kernel(MutOperand h, ConstOperand gate_up, int64_t rows, int64_t width, float beta,
                                    float lin) {
  const int64_t chunks_per_row = width / kChunk;
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, j = (i % chunks_per_row) * kChunk;
    float g[kChunk], u[kChunk];
    load_chunk<kChunk>(g, gate_up, r * 2 * width + j);
    load_chunk<kChunk>(u, gate_up, r * 2 * width + width + j);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const float v = lin > 0.0f ? lin * tanhf(u[e] / lin) : u[e];
      g[e] = beta * tanhf(g[e] / beta) * sigmoid(g[e]) * v;
    }
    store_chunk<kChunk>(h, r * width + j, g);
  }
}

template <int kChunk>
__global__ void situ_backward_kernel(MutOperand dgate_up, ConstOperand dh, ConstOperand gate_up, int64_t rows,
                                     int64_t width, float beta, float lin) {
  const int64_t chunks_per_row = width / kChunk;
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, j = (i % chunks_per_row) * kChunk;
    float g[kChunk], u[kChunk], d[kChunk], dg[kChunk], du[kChunk];
    load_chunk<kChunk>(g, gate_up, r * 2 * width + j);
    load_chunk<kChunk>(u, gate_up, r * 2 * width + width + j);
    load_chunk<kChunk>(d, dh, r * width + j);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const float t = tanhf(g[e] / beta), s = sigmoid(g[e]);
      float v = u[e], dv = 1.0f;
      if (lin > 0.0f) {
        const float tu = tanhf(u[e] / lin);
        v = lin * tu;
        dv = 1.0f - tu * tu;
      }
      dg[e] = d[e] * v * ((1.0f - t * t) * s + beta * t * s * (1.0f - s));
      du[e] = d[e] * beta * t * s * dv;
    }
    store_chunk<kChunk>(dgate_up, r * 2 * width + j, dg);
    store_chunk<kChunk>(dgate_up, r * 2 * width + width + j, du);
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void swiglu_forward(const TensorView& h, const TensorView& gate_up, cudaStream_t stream) {
  const int64_t width = h.size(-1);
  const int64_t rows = width == 0 ? 0 : h.numel() / width;
  if (rows == 0) return;
  const MutOperand out{h.data, kind_of(h.dtype)};
  const ConstOperand in{gate_up.data, kind_of(gate_up.dtype)};
  if (width % 8 == 0 && aligned16(h.data) && aligned16(gate_up.data)) {
    swiglu_forward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(out, in, rows, width);
  } else {
    swiglu_forward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(out, in, rows, width);
  }
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const SwigluBackwardArgs& args, cudaStream_t stream) {
  const int64_t width = args.dh.size(-1);
  const int64_t rows = width == 0 ? 0 : args.dh.numel() / width;
  if (rows == 0) return;
  const MutOperand dgu{args.dgate_up.data, kind_of(args.dgate_up.dtype)};
  const ConstOperand dh{args.dh.data, kind_of(args.dh.dtype)}, gu{args.gate_up.data, kind_of(args.gate_up.dtype)};
  if (width % 8 == 0 && aligned16(dgu.data) && aligned16(dh.data) && aligned16(gu.data)) {
    swiglu_backward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width);
  } else {
    swiglu_backward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width);
  }
  CUDA_CHECK_LAUNCH();
}

void situ_forward(const SituArgs& args, cudaStream_t stream) {
  const int64_t width = args.h.size(-1);
  const int64_t rows = width == 0 ? 0 : args.h.numel() / width;
  if (rows == 0) return;
  const MutOperand out{args.h.data, kind_of(args.h.dtype)};
  const ConstOperand in{args.gate_up.data, kind_of(args.gate_up.dtype)};
  const float beta = static_cast<float>(args.beta), lin = static_cast<float>(args.linear_beta);
  if (width % 8 == 0 && aligned16(out.data) && aligned16(in.data)) {
    situ_forward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(out, in, rows, width, beta,
                                                                                          lin);
  } else {
    situ_forward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(out, in, rows, width, beta, lin);
  }
  CUDA_CHECK_LAUNCH();
}

void situ_backward(const SituBackwardArgs& args, cudaStream_t stream) {
  const int64_t width = args.dh.size(-1);
  const int64_t rows = width == 0 ? 0 : args.dh.numel() / width;
  if (rows == 0) return;
  const MutOperand dgu{args.dgate_up.data, kind_of(args.dgate_up.dtype)};
  const ConstOperand dh{args.dh.data, kind_of(args.dh.dtype)}, gu{args.gate_up.data, kind_of(args.gate_up.dtype)};
  const float beta = static_cast<float>(args.beta), lin = static_cast<float>(args.linear_beta);
  if (width % 8 == 0 && aligned16(dgu.data) && aligned16(dh.data) && aligned16(gu.data)) {
    situ_backward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width,
                                                                                           beta, lin);
  } else {
    situ_backward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width, beta,
                                                                                       lin);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
