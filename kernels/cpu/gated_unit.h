// The row loops SwiGLU and SiTU share. gate_up [rows, 2 * width] holds [g | u] per row; h and dh are
// [rows, width]. Each op supplies its per-element function; the loops visit the elements in order.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// h[r, j] = unit(g[r, j], u[r, j]).
template <typename T, typename Unit>
void gated_unit_forward(const TensorView& h, const TensorView& gate_up, Unit unit) {
  const int64_t width = h.size(-1);
  const int64_t rows = width == 0 ? 0 : h.numel() / width;
  const T* gu = gate_up.ptr<T>();
  T* out = h.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * width;
    const T* u = g + width;
    T* hr = out + r * width;
    for (int64_t j = 0; j < width; ++j) hr[j] = unit(g[j], u[j]);
  }
}

// unit(g, u, dh, dg, du) sets dg and du of one element from its g, u and dh, which are read before
// either is written: dgate_up may alias gate_up.
template <typename T, typename UnitBackward>
void gated_unit_backward(const TensorView& dgate_up, const TensorView& dh, const TensorView& gate_up,
                         UnitBackward unit) {
  const int64_t width = dh.size(-1);
  const int64_t rows = width == 0 ? 0 : dh.numel() / width;
  const T* gu = gate_up.ptr<T>();
  const T* dhp = dh.ptr<T>();
  T* dgu = dgate_up.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * width;
    const T* u = g + width;
    const T* dhr = dhp + r * width;
    T* dg = dgu + r * 2 * width;
    T* du = dg + width;
    for (int64_t j = 0; j < width; ++j) {
      const T gj = g[j], uj = u[j], dhj = dhr[j];
      unit(gj, uj, dhj, dg[j], du[j]);
    }
  }
}

}  // namespace moetrain::kernels::cpu
