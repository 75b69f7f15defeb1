// SwiGLU, CPU reference (contract: kernels/ops.h).
//   h = silu(g) * u,  silu(g) = g * sigmoid(g),  gate_up = [g | u] per row
//   dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du = dh * silu(g)
#include "kernels/cpu/reference.h"

#include <cmath>

#include "kernels/cpu/gated_unit.h"
#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void swiglu_forward(const TensorView& h, const TensorView& gate_up) {
  gated_unit_forward<T>(h, gate_up, [](T g, T u) { return g * sigmoid(g) * u; });
}

template <typename T>
void swiglu_backward(const SwigluBackwardArgs& args) {
  gated_unit_backward<T>(args.dgate_up, args.dh, args.gate_up, [](T g, T u, T dh, T& dg, T& du) {
    const T sig = sigmoid(g);
    dg = dh * u * sig * (T(1) + g * (T(1) - sig));
    du = dh * g * sig;
  });
}

MOETRAIN_CPU_INSTANTIATE(swiglu_forward, const TensorView&, const TensorView&)
MOETRAIN_CPU_INSTANTIATE(swiglu_backward, const SwigluBackwardArgs&)

}  // namespace moetrain::kernels::cpu
