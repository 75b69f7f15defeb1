// The attention output gate, CPU reference (contract: kernels/ops.h, AttentionGateArgs):
//   y = x * s,  s = sigmoid(gate)   per element, or per (token, head) when headwise
//   dx = dy * s,  dgate = dy * x * s * (1 - s)   (summed over the head's columns when headwise)
#include "kernels/cpu/reference.h"

#include <cmath>

#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void attention_gate_forward(const AttentionGateArgs& args) {
  const int64_t rows = args.x.size(0) * args.x.size(1), dim = args.x.size(2);
  const T* x = args.x.ptr<T>();
  const T* gate = args.gate.ptr<T>();
  T* y = args.y.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) {
      const int64_t i = r * dim + c;
      const double s = sigmoid(static_cast<double>(gate[args.headwise ? r : i]));
      y[i] = static_cast<T>(static_cast<double>(x[i]) * s);
    }
  }
}

// dx and dgate overwritten; dx may alias dy (each (token, head) reads dy before writing dx).
template <typename T>
void attention_gate_backward(const AttentionGateBackwardArgs& args) {
  const int64_t rows = args.x.size(0) * args.x.size(1), dim = args.x.size(2);
  const T* x = args.x.ptr<T>();
  const T* gate = args.gate.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  T* dx = args.dx.ptr<T>();
  T* dgate = args.dgate.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    if (args.headwise) {
      const double s = sigmoid(static_cast<double>(gate[r]));
      double dot = 0.0;
      for (int64_t c = 0; c < dim; ++c) dot += static_cast<double>(dy[r * dim + c]) * static_cast<double>(x[r * dim + c]);
      dgate[r] = static_cast<T>(dot * s * (1.0 - s));
      for (int64_t c = 0; c < dim; ++c) dx[r * dim + c] = static_cast<T>(static_cast<double>(dy[r * dim + c]) * s);
      continue;
    }
    for (int64_t c = 0; c < dim; ++c) {
      const int64_t i = r * dim + c;
      const double s = sigmoid(static_cast<double>(gate[i]));
      const double g = static_cast<double>(dy[i]);
      dgate[i] = static_cast<T>(g * static_cast<double>(x[i]) * s * (1.0 - s));
      dx[i] = static_cast<T>(g * s);
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(attention_gate_forward, const AttentionGateArgs&)
MOETRAIN_CPU_INSTANTIATE(attention_gate_backward, const AttentionGateBackwardArgs&)

}  // namespace moetrain::kernels::cpu
