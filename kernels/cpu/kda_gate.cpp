// KDA's gates, CPU reference (contract: kernels/ops.h, KdaGateArgs and sigmoid_forward).
// Forget gate (log decay) per token, head h and channel c, x = f + dt_bias[h, c], A = exp(a_log[h]):
//   lower_bound == 0: g = -A * softplus(x),          dg/df = -A * sigmoid(x)
//   lower_bound <  0: g = lb * sigmoid(A * x),       dg/df = lb * A * s * (1 - s), s = sigmoid(A * x)
// softplus as torch's F.softplus (the models' reference): x itself above 20, log1p(exp(x)) below,
// whose derivative is 1 above 20, sigmoid(x) below.
// Beta: y = sigmoid(x), dx = dy * y * (1 - y).
#include "kernels/cpu/reference.h"

#include <cmath>

#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {
namespace {

// torch's threshold: above it softplus(x) = x to working precision, and exp(x) would overflow.
constexpr double kSoftplusThreshold = 20.0;

template <typename T>
T softplus(T x) {
  return x > T(kSoftplusThreshold) ? x : std::log1p(std::exp(x));
}

template <typename T>
T softplus_derivative(T x) {
  return x > T(kSoftplusThreshold) ? T(1) : sigmoid(x);
}

// Walks every (token, head, channel) of f [tokens, heads * dim] with the values the gate uses:
// body(index, x = f + dt_bias, A = exp(a_log[head])).
template <typename T, typename Body>
void for_each_gate(const TensorView& f, const TensorView& a_log, const TensorView& dt_bias, Body&& body) {
  const int64_t heads = a_log.numel();
  const int64_t width = dt_bias.numel();  // heads * dim
  const int64_t dim = width / heads;
  const int64_t tokens = width == 0 ? 0 : f.numel() / width;
  const T* fp = f.ptr<T>();
  const T* al = a_log.ptr<T>();
  const T* bias = dt_bias.ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < width; ++j) {
      const int64_t i = t * width + j;
      body(i, fp[i] + bias[j], std::exp(al[j / dim]));
    }
  }
}

}  // namespace

template <typename T>
void kda_gate_forward(const KdaGateArgs& args) {
  T* g = args.g.ptr<T>();
  const T lb = static_cast<T>(args.lower_bound);
  for_each_gate<T>(args.f, args.a_log, args.dt_bias, [&](int64_t i, T x, T a) {
    g[i] = lb < T(0) ? lb * sigmoid(a * x) : -a * softplus(x);
  });
}

template <typename T>
void kda_gate_backward(const KdaGateBackwardArgs& args) {
  T* df = args.df.ptr<T>();
  const T* dg = args.dg.ptr<T>();
  const T lb = static_cast<T>(args.lower_bound);
  for_each_gate<T>(args.f, args.a_log, args.dt_bias, [&](int64_t i, T x, T a) {
    if (lb < T(0)) {
      const T s = sigmoid(a * x);
      df[i] = dg[i] * lb * a * s * (T(1) - s);
    } else {
      df[i] = -dg[i] * a * softplus_derivative(x);
    }
  });
}

template <typename T>
void sigmoid_forward(const TensorView& y, const TensorView& x) {
  const T* xp = x.ptr<T>();
  T* yp = y.ptr<T>();
  for (int64_t i = 0; i < x.numel(); ++i) yp[i] = sigmoid(xp[i]);
}

// dx may alias dy (elementwise).
template <typename T>
void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) {
  const T* dyp = dy.ptr<T>();
  const T* yp = y.ptr<T>();
  T* dxp = dx.ptr<T>();
  for (int64_t i = 0; i < y.numel(); ++i) dxp[i] = dyp[i] * yp[i] * (T(1) - yp[i]);
}

MOETRAIN_CPU_INSTANTIATE(kda_gate_forward, const KdaGateArgs&)
MOETRAIN_CPU_INSTANTIATE(kda_gate_backward, const KdaGateBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(sigmoid_forward, const TensorView&, const TensorView&)
MOETRAIN_CPU_INSTANTIATE(sigmoid_backward, const TensorView&, const TensorView&, const TensorView&)

}  // namespace moetrain::kernels::cpu
