// AdamW, in place, with PyTorch's torch.optim.AdamW semantics (decoupled weight decay, bias
// correction), CPU reference (contract: kernels/ops.h, AdamWArgs). Per element:
//   param *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
#include "kernels/cpu/reference.h"

#include <cmath>

namespace moetrain::kernels::cpu {

template <typename T>
void adamw(const AdamWArgs& args) {
  T* param = args.param.ptr<T>();
  const T* grad = args.grad.ptr<T>();
  T* m = args.exp_avg.ptr<T>();
  T* v = args.exp_avg_sq.ptr<T>();
  // The per-step scalars in double, as PyTorch computes them on the host.
  const double step = static_cast<double>(args.step);
  const T decay = static_cast<T>(1.0 - args.lr * args.weight_decay);
  const T beta1 = static_cast<T>(args.beta1), beta2 = static_cast<T>(args.beta2);
  const T one_minus_beta1 = static_cast<T>(1.0 - args.beta1), one_minus_beta2 = static_cast<T>(1.0 - args.beta2);
  const T step_size = static_cast<T>(args.lr / (1.0 - std::pow(args.beta1, step)));
  const T bias_correction2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(args.beta2, step)));
  const T eps = static_cast<T>(args.eps);
  for (int64_t i = 0; i < args.param.numel(); ++i) {
    const T g = grad[i];
    param[i] *= decay;
    m[i] = beta1 * m[i] + one_minus_beta1 * g;
    v[i] = beta2 * v[i] + one_minus_beta2 * g * g;
    const T denom = std::sqrt(v[i]) / bias_correction2_sqrt + eps;
    param[i] -= step_size * m[i] / denom;
  }
}

MOETRAIN_CPU_INSTANTIATE(adamw, const AdamWArgs&)

}  // namespace moetrain::kernels::cpu
