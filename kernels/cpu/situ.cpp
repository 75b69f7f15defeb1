// SiTU, CPU reference (contract: kernels/ops.h, SituArgs). With t = tanh(g / beta),
// s = sigmoid(g), a = beta * t * s and v = linear_beta * tanh(u / linear_beta) (or u):
//   h  = a * v
//   dg = dh * v * ((1 - t^2) * s + beta * t * s * (1 - s))
//   du = dh * a * (1 - tanh(u / linear_beta)^2)   (dh * a when linear_beta is 0)
#include "kernels/cpu/reference.h"

#include <cmath>

#include "kernels/cpu/gated_unit.h"
#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void situ_forward(const SituArgs& args) {
  const T beta = T(args.beta), lin = T(args.linear_beta);
  gated_unit_forward<T>(args.h, args.gate_up, [beta, lin](T g, T u) {
    const T v = lin > T(0) ? lin * std::tanh(u / lin) : u;
    return beta * std::tanh(g / beta) * sigmoid(g) * v;
  });
}

template <typename T>
void situ_backward(const SituBackwardArgs& args) {
  const T beta = T(args.beta), lin = T(args.linear_beta);
  gated_unit_backward<T>(args.dgate_up, args.dh, args.gate_up, [beta, lin](T g, T u, T dh, T& dg, T& du) {
    const T t = std::tanh(g / beta), s = sigmoid(g);
    const T a = beta * t * s;
    T v = u, dv = T(1);
    if (lin > T(0)) {
      const T tu = std::tanh(u / lin);
      v = lin * tu;
      dv = T(1) - tu * tu;
    }
    dg = dh * v * ((T(1) - t * t) * s + beta * t * s * (T(1) - s));
    du = dh * a * dv;
  });
}

MOETRAIN_CPU_INSTANTIATE(situ_forward, const SituArgs&)
MOETRAIN_CPU_INSTANTIATE(situ_backward, const SituBackwardArgs&)

}  // namespace moetrain::kernels::cpu
