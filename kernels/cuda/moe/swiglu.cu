#include "kernels/cuda/moe/swiglu.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

// expf(-g) overflows to inf for very negative g, which correctly gives 0.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The gated activations, per element of a row's gate half g and up half u: forward h = f(g, u),
// backward (dg, du) from d = dh.
struct Swiglu {
  __device__ __forceinline__ float forward(float g, float u) const { return g * sigmoid(g) * u; }
  __device__ __forceinline__ void backward(float d, float g, float u, float& dg, float& du) const {
    const float sig = sigmoid(g);
    dg = d * u * sig * (1.0f + g * (1.0f - sig));
    du = d * g * sig;
  }
};

// SiTU (ops.h SituArgs); lin == 0 leaves the up branch unbounded.
struct Situ {
  float beta, lin;
  __device__ __forceinline__ float forward(float g, float u) const {
    const float v = lin > 0.0f ? lin * tanhf(u / lin) : u;
    return beta * tanhf(g / beta) * sigmoid(g) * v;
  }
  __device__ __forceinline__ void backward(float d, float g, float u, float& dg, float& du) const {
    const float t = tanhf(g / beta), s = sigmoid(g);
    float v = u, dv = 1.0f;
    if (lin > 0.0f) {
      const float tu = tanhf(u / lin);
      v = lin * tu;
      dv = 1.0f - tu * tu;
    }
    dg = d * v * ((1.0f - t * t) * s + beta * t * s * (1.0f - s));
    du = d * beta * t * s * dv;
  }
};

// gate_up [rows, 2 * width] = [gate | up] per row; h and dh [rows, width].
template <int kChunk, typename Act>
__global__ void gated_forward_kernel(MutOperand h, ConstOperand gate_up, int64_t rows, int64_t width, Act act) {
  const int64_t chunks_per_row = width / kChunk;
  const int64_t total = rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, j = (i % chunks_per_row) * kChunk;
    float g[kChunk], u[kChunk];
    load_chunk<kChunk>(g, gate_up, r * 2 * width + j);
    load_chunk<kChunk>(u, gate_up, r * 2 * width + width + j);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) g[e] = act.forward(g[e], u[e]);
    store_chunk<kChunk>(h, r * width + j, g);
  }
}

template <int kChunk, typename Act>
__global__ void gated_backward_kernel(MutOperand dgate_up, ConstOperand dh, ConstOperand gate_up, int64_t rows,
                                      int64_t width, Act act) {
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
    for (int e = 0; e < kChunk; ++e) act.backward(d[e], g[e], u[e], dg[e], du[e]);
    store_chunk<kChunk>(dgate_up, r * 2 * width + j, dg);
    store_chunk<kChunk>(dgate_up, r * 2 * width + width + j, du);
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

// 16-byte chunks when the width and every base pointer allow them, else one element a thread.
template <typename Act>
void launch_gated_forward(const TensorView& h, const TensorView& gate_up, Act act, cudaStream_t stream) {
  const int64_t width = h.size(-1);
  const int64_t rows = width == 0 ? 0 : h.numel() / width;
  if (rows == 0) return;
  const MutOperand out{h.data, kind_of(h.dtype)};
  const ConstOperand in{gate_up.data, kind_of(gate_up.dtype)};
  if (width % 8 == 0 && aligned16(out.data) && aligned16(in.data)) {
    gated_forward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(out, in, rows, width, act);
  } else {
    gated_forward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(out, in, rows, width, act);
  }
  CUDA_CHECK_LAUNCH();
}

template <typename Act>
void launch_gated_backward(const TensorView& dgate_up, const TensorView& dh_view, const TensorView& gate_up, Act act,
                           cudaStream_t stream) {
  const int64_t width = dh_view.size(-1);
  const int64_t rows = width == 0 ? 0 : dh_view.numel() / width;
  if (rows == 0) return;
  const MutOperand dgu{dgate_up.data, kind_of(dgate_up.dtype)};
  const ConstOperand dh{dh_view.data, kind_of(dh_view.dtype)}, gu{gate_up.data, kind_of(gate_up.dtype)};
  if (width % 8 == 0 && aligned16(dgu.data) && aligned16(dh.data) && aligned16(gu.data)) {
    gated_backward_kernel<8><<<grid_for(rows * width / 8, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width,
                                                                                            act);
  } else {
    gated_backward_kernel<1><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(dgu, dh, gu, rows, width, act);
  }
  CUDA_CHECK_LAUNCH();
}

Situ situ_of(double beta, double linear_beta) { return Situ{static_cast<float>(beta), static_cast<float>(linear_beta)}; }

}  // namespace

void swiglu_forward(const TensorView& h, const TensorView& gate_up, cudaStream_t stream) {
  launch_gated_forward(h, gate_up, Swiglu{}, stream);
}

void swiglu_backward(const SwigluBackwardArgs& args, cudaStream_t stream) {
  launch_gated_backward(args.dgate_up, args.dh, args.gate_up, Swiglu{}, stream);
}

void situ_forward(const SituArgs& args, cudaStream_t stream) {
  launch_gated_forward(args.h, args.gate_up, situ_of(args.beta, args.linear_beta), stream);
}

void situ_backward(const SituBackwardArgs& args, cudaStream_t stream) {
  launch_gated_backward(args.dgate_up, args.dh, args.gate_up, situ_of(args.beta, args.linear_beta), stream);
}

}  // namespace moetrain::kernels::cuda_ops
