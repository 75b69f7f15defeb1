#include "kernels/cpu/situ.h"

#include <cmath>

#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void situ_forward(const SituArgs& args) {
  const int64_t width = args.h.size(-1);
  const int64_t rows = width == 0 ? 0 : args.h.numel() / width;
  const T beta = T(args.beta), lin = T(args.linear_beta);
  const T* gu = args.gate_up.ptr<T>();
  T* out = args.h.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * width;
    const T* u = g + width;
    T* hr = out + r * width;
    for (int64_t j = 0; j < width; ++j) {
      const T v = lin > T(0) ? lin * std::tanh(u[j] / lin) : u[j];
      hr[j] = beta * std::tanh(g[j] / beta) * sigmoid(g[j]) * v;
    }
  }
}

template <typename T>
void situ_backward(const SituBackwardArgs& args) {
  const int64_t width = args.dh.size(-1);
  const int64_t rows = width == 0 ? 0 : args.dh.numel() / width;
  const T beta = T(args.beta), lin = T(args.linear_beta);
  const T* gu = args.gate_up.ptr<T>();
  const T* dh = args.dh.ptr<T>();
  T* dgu = args.dgate_up.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * width;
    const T* u = g + width;
    const T* dhr = dh + r * width;
    T* dg = dgu + r * 2 * width;
    T* du = dg + width;
    for (int64_t j = 0; j < width; ++j) {
      const T gj = g[j], uj = u[j], dhj = dhr[j];  // read first: dgate_up may alias gate_up
      const T t = std::tanh(gj / beta), s = sigmoid(gj);
      const T a = beta * t * s;
      T v = uj, dv = T(1);
      if (lin > T(0)) {
        const T tu = std::tanh(uj / lin);
        v = lin * tu;
        dv = T(1) - tu * tu;
      }
      dg[j] = dhj * v * ((T(1) - t * t) * s + beta * t * s * (T(1) - s));
      du[j] = dhj * a * dv;
    }
  }
}

template void situ_forward<float>(const SituArgs&);
template void situ_forward<double>(const SituArgs&);
template void situ_backward<float>(const SituBackwardArgs&);
template void situ_backward<double>(const SituBackwardArgs&);

}  // namespace moetrain::kernels::cpu
