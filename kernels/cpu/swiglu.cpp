#include "kernels/cpu/swiglu.h"

#include <cmath>

#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void swiglu_forward(const TensorView& h, const TensorView& gate_up) {
  const int64_t width = h.size(-1);
  const int64_t rows = width == 0 ? 0 : h.numel() / width;
  const T* gu = gate_up.ptr<T>();
  T* out = h.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * width;
    const T* u = g + width;
    T* hr = out + r * width;
    for (int64_t j = 0; j < width; ++j) hr[j] = g[j] * sigmoid(g[j]) * u[j];
  }
}

template <typename T>
void swiglu_backward(const SwigluBackwardArgs& args) {
  const int64_t width = args.dh.size(-1);
  const int64_t rows = width == 0 ? 0 : args.dh.numel() / width;
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
      const T sig = sigmoid(g[j]);
      const T gj = g[j], uj = u[j], dhj = dhr[j];  // read first: dgate_up may alias gate_up
      dg[j] = dhj * uj * sig * (T(1) + gj * (T(1) - sig));
      du[j] = dhj * gj * sig;
    }
  }
}

template void swiglu_forward<float>(const TensorView&, const TensorView&);
template void swiglu_forward<double>(const TensorView&, const TensorView&);
template void swiglu_backward<float>(const SwigluBackwardArgs&);
template void swiglu_backward<double>(const SwigluBackwardArgs&);

}  // namespace moetrain::kernels::cpu
