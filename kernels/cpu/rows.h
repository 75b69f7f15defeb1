// Small row helpers the CPU reference ops share. Each one fixes an order of arithmetic (a plain
// left-to-right sum), so the ops that use it keep the exact results of writing the loop inline.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// The number of rows of length dim in x (zero when dim is zero).
inline int64_t row_count(const TensorView& x, int64_t dim) { return dim == 0 ? 0 : x.numel() / dim; }

// sum_j x_j^2, accumulated in T from j = 0 up.
template <typename T>
T sum_of_squares(const T* x, int64_t n) {
  T s = 0;
  for (int64_t j = 0; j < n; ++j) s += x[j] * x[j];
  return s;
}

// sum_i a_i * b_i, accumulated in double from i = 0 up.
template <typename T>
double dot_double(const T* a, const T* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

}  // namespace moetrain::kernels::cpu
