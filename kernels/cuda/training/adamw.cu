#include "kernels/cuda/training/adamw.h"

#include <cmath>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

struct AdamWScalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bias_correction2_sqrt, eps;
};

__device__ __forceinline__ void adamw_update(float& param, float grad, float& m, float& v, const AdamWScalars& s) {
  param *= s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * grad;
  v = s.beta2 * v + s.one_minus_beta2 * grad * grad;
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  param -= s.step_size * m / denom;
}

// kVec == 4: float4 accesses (the launcher checks alignment and n % 4); kVec == 1: scalars.
template <int kVec>
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
                             float* __restrict__ exp_avg_sq, AdamWScalars s, int64_t vectors) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (kVec == 4) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      float4 m = reinterpret_cast<float4*>(exp_avg)[i];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
      adamw_update(p.x, g.x, m.x, v.x, s);
      adamw_update(p.y, g.y, m.y, v.y, s);
      adamw_update(p.z, g.z, m.z, v.z, s);
      adamw_update(p.w, g.w, m.w, v.w, s);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(exp_avg)[i] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
    } else {
      adamw_update(param[i], grad[i], exp_avg[i], exp_avg_sq[i], s);
    }
  }
}

}  // namespace

void adamw(const AdamWArgs& args, cudaStream_t stream) {
  const int64_t n = args.param.numel();
  if (n == 0) return;
  const double step = static_cast<double>(args.step);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - args.lr * args.weight_decay);
  s.beta1 = static_cast<float>(args.beta1);
  s.beta2 = static_cast<float>(args.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - args.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  s.step_size = static_cast<float>(args.lr / (1.0 - std::pow(args.beta1, step)));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(args.beta2, step)));
  s.eps = static_cast<float>(args.eps);
  auto* param = static_cast<float*>(args.param.data);
  const auto* grad = static_cast<const float*>(args.grad.data);
  auto* m = static_cast<float*>(args.exp_avg.data);
  auto* v = static_cast<float*>(args.exp_avg_sq.data);
  if (n % 4 == 0 && aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v)) {
    adamw_kernel<4><<<grid_for(n / 4, kThreads), kThreads, 0, stream>>>(param, grad, m, v, s, n / 4);
  } else {
    adamw_kernel<1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(param, grad, m, v, s, n);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
