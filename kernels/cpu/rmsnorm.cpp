// RMSNorm forward and backward, CPU reference (contract: kernels/ops.h, RmsNormArgs).
//   y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
//   dx_k = rstd * w_k * dy_k - x_k * rstd^3 / dim * sum_j dy_j * w_j * x_j
//   dw_j = sum_rows dy_j * x_j * rstd
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/rows.h"

namespace moetrain::kernels::cpu {

template <typename T>
void rmsnorm_forward(const RmsNormArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* w = args.weight.ptr<T>();
  T* y = args.y.ptr<T>();
  T* rstd = args.rstd.ptr<T>();
  const T eps = static_cast<T>(args.eps);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T sum_sq = sum_of_squares(xr, dim);
    const T s = T(1) / std::sqrt(sum_sq / static_cast<T>(dim) + eps);
    rstd[r] = s;
    T* yr = y + r * dim;
    for (int64_t j = 0; j < dim; ++j) yr[j] = xr[j] * s * w[j];
  }
}

// dx is overwritten, or added to with `accumulate`. dweight (when given) is always overwritten
// with this call's sum over rows.
template <typename T>
void rmsnorm_backward(const RmsNormBackwardArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* w = args.weight.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  const T* rstd = args.rstd.ptr<T>();
  T* dx = args.dx.ptr<T>();
  const bool want_dweight = args.dweight.data != nullptr;
  T* dw = want_dweight ? args.dweight.ptr<T>() : nullptr;
  if (want_dweight) std::fill(dw, dw + dim, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    const T s = rstd[r];
    T dot = 0;  // sum_j dy_j * w_j * x_j
    for (int64_t j = 0; j < dim; ++j) dot += dyr[j] * w[j] * xr[j];
    const T coef = dot * s * s * s / static_cast<T>(dim);
    T* dxr = dx + r * dim;
    if (args.accumulate) {
      for (int64_t j = 0; j < dim; ++j) dxr[j] += s * w[j] * dyr[j] - coef * xr[j];
    } else {
      for (int64_t j = 0; j < dim; ++j) dxr[j] = s * w[j] * dyr[j] - coef * xr[j];
    }
    if (want_dweight)
      for (int64_t j = 0; j < dim; ++j) dw[j] += dyr[j] * xr[j] * s;
  }
}

MOETRAIN_CPU_INSTANTIATE(rmsnorm_forward, const RmsNormArgs&)
MOETRAIN_CPU_INSTANTIATE(rmsnorm_backward, const RmsNormBackwardArgs&)

}  // namespace moetrain::kernels::cpu
