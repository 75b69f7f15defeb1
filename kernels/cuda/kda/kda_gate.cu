// The KDA forget gate, per element of f [tokens, heads * dim] with x = f + dt_bias, A = exp(a_log[head]):
//   lower_bound == 0: g = -A softplus(x)            dg/df = -A sigmoid(x)
//   lower_bound <  0: g = lb sigmoid(A x)           dg/df = lb A s (1 - s), s = sigmoid(A x)
// softplus(x) = x above 20, as torch's (and the CPU reference's) threshold.
// And y = sigmoid(x), dx = dy y (1 - y). Grid-stride elementwise loops.
#include "kernels/cuda/kda/kda_gate.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;
constexpr float kSoftplusThreshold = 20.0f;

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }

struct GateShape {
  int64_t n;      // elements of f
  int64_t width;  // heads * dim
  int64_t dim;
  float lower_bound;
};

__global__ void kda_gate_forward_kernel(float* g, ConstOperand f, const float* a_log, const float* dt_bias,
                                        GateShape s) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % s.width;
    const float x = load_one(f, i) + dt_bias[j];
    const float a = expf(a_log[j / s.dim]);
    g[i] = s.lower_bound < 0.0f ? s.lower_bound * sigmoidf(a * x)
                                : -a * (x > kSoftplusThreshold ? x : log1pf(expf(x)));
  }
}

__global__ void kda_gate_backward_kernel(MutOperand df, const float* dg, ConstOperand f, const float* a_log,
                                         const float* dt_bias, GateShape s) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % s.width;
    const float x = load_one(f, i) + dt_bias[j];
    const float a = expf(a_log[j / s.dim]);
    float d;
    if (s.lower_bound < 0.0f) {
      const float sg = sigmoidf(a * x);
      d = dg[i] * s.lower_bound * a * sg * (1.0f - sg);
    } else {
      d = -dg[i] * a * (x > kSoftplusThreshold ? 1.0f : sigmoidf(x));
    }
    store_one(df, i, d);
  }
}

__global__ void sigmoid_forward_kernel(MutOperand y, ConstOperand x, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_one(y, i, sigmoidf(load_one(x, i)));
}

__global__ void sigmoid_backward_kernel(MutOperand dx, ConstOperand dy, ConstOperand y, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float yv = load_one(y, i);
    store_one(dx, i, load_one(dy, i) * yv * (1.0f - yv));
  }
}

GateShape gate_shape(const TensorView& g, double lower_bound) {
  return {g.numel(), g.size(1) * g.size(2), g.size(2), static_cast<float>(lower_bound)};
}

}  // namespace

void kda_gate_forward(const KdaGateArgs& args, cudaStream_t stream) {
  const GateShape s = gate_shape(args.g, args.lower_bound);
  if (s.n == 0) return;
  kda_gate_forward_kernel<<<grid_for(s.n, kThreads), kThreads, 0, stream>>>(
      static_cast<float*>(args.g.data), {args.f.data, kind_of(args.f.dtype)}, static_cast<const float*>(args.a_log.data),
      static_cast<const float*>(args.dt_bias.data), s);
  CUDA_CHECK_LAUNCH();
}

void kda_gate_backward(const KdaGateBackwardArgs& args, cudaStream_t stream) {
  const GateShape s = gate_shape(args.dg, args.lower_bound);
  if (s.n == 0) return;
  kda_gate_backward_kernel<<<grid_for(s.n, kThreads), kThreads, 0, stream>>>(
      {args.df.data, kind_of(args.df.dtype)}, static_cast<const float*>(args.dg.data),
      {args.f.data, kind_of(args.f.dtype)}, static_cast<const float*>(args.a_log.data),
      static_cast<const float*>(args.dt_bias.data), s);
  CUDA_CHECK_LAUNCH();
}

void sigmoid_forward(const TensorView& y, const TensorView& x, cudaStream_t stream) {
  const int64_t n = y.numel();
  if (n == 0) return;
  sigmoid_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>({y.data, kind_of(y.dtype)},
                                                                        {x.data, kind_of(x.dtype)}, n);
  CUDA_CHECK_LAUNCH();
}

void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y, cudaStream_t stream) {
  const int64_t n = y.numel();
  if (n == 0) return;
  sigmoid_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      {dx.data, kind_of(dx.dtype)}, {dy.data, kind_of(dy.dtype)}, {y.data, kind_of(y.dtype)}, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
