// The two norms of a KDA layer, CPU reference (contract: kernels/ops.h, L2NormArgs and
// GatedRmsNormArgs), per row of length dim.
// L2 norm of q and k:  y = x * r,  r = 1 / sqrt(sum(x^2) + eps)
//   dx = r * dy - r^3 * x * (x . dy)
// Gated output norm:   y = n * w * s,  n = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps),  s = sigmoid(gate)
//   dn = dy * w * s,  dx = rstd * dn - rstd^3 / dim * x * (x . dn)
//   dgate = dy * n * w * s * (1 - s),  dw = sum_rows dy * n * s
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/rows.h"
#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {

template <typename T>
void l2norm_forward(const L2NormArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  T* y = args.y.ptr<T>();
  T* inv_norm = args.inv_norm.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T sum_sq = sum_of_squares(xr, dim);
    const T inv = T(1) / std::sqrt(sum_sq + static_cast<T>(args.eps));
    inv_norm[r] = inv;
    for (int64_t j = 0; j < dim; ++j) y[r * dim + j] = xr[j] * inv;
  }
}

template <typename T>
void l2norm_backward(const L2NormBackwardArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  const T* inv_norm = args.inv_norm.ptr<T>();
  T* dx = args.dx.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    const T inv = inv_norm[r];
    T dot = 0;
    for (int64_t j = 0; j < dim; ++j) dot += xr[j] * dyr[j];
    const T coef = dot * inv * inv * inv;
    for (int64_t j = 0; j < dim; ++j) dx[r * dim + j] = inv * dyr[j] - coef * xr[j];
  }
}

template <typename T>
void gated_rmsnorm_forward(const GatedRmsNormArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* gate = args.gate.ptr<T>();
  const T* w = args.weight.ptr<T>();
  T* y = args.y.ptr<T>();
  T* rstd = args.rstd.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T sum_sq = sum_of_squares(xr, dim);
    const T s = T(1) / std::sqrt(sum_sq / static_cast<T>(dim) + static_cast<T>(args.eps));
    rstd[r] = s;
    for (int64_t j = 0; j < dim; ++j) y[r * dim + j] = xr[j] * s * w[j] * sigmoid(gate[r * dim + j]);
  }
}

// dx, dgate overwritten; dweight (when given) overwritten with this call's sum over rows.
template <typename T>
void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* gate = args.gate.ptr<T>();
  const T* w = args.weight.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  const T* rstd = args.rstd.ptr<T>();
  T* dx = args.dx.ptr<T>();
  T* dgate = args.dgate.ptr<T>();
  const bool want_dweight = args.dweight.data != nullptr;
  T* dw = want_dweight ? args.dweight.ptr<T>() : nullptr;
  if (want_dweight) std::fill(dw, dw + dim, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* gr = gate + r * dim;
    const T* dyr = dy + r * dim;
    const T s = rstd[r];
    T dot = 0;  // x . dn
    for (int64_t j = 0; j < dim; ++j) dot += xr[j] * dyr[j] * w[j] * sigmoid(gr[j]);
    const T coef = dot * s * s * s / static_cast<T>(dim);
    for (int64_t j = 0; j < dim; ++j) {
      const T sig = sigmoid(gr[j]), n = xr[j] * s;
      dx[r * dim + j] = s * dyr[j] * w[j] * sig - coef * xr[j];
      dgate[r * dim + j] = dyr[j] * n * w[j] * sig * (T(1) - sig);
      if (want_dweight) dw[j] += dyr[j] * n * sig;
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(l2norm_forward, const L2NormArgs&)
MOETRAIN_CPU_INSTANTIATE(l2norm_backward, const L2NormBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(gated_rmsnorm_forward, const GatedRmsNormArgs&)
MOETRAIN_CPU_INSTANTIATE(gated_rmsnorm_backward, const GatedRmsNormBackwardArgs&)

}  // namespace moetrain::kernels::cpu
