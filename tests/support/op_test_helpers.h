// Small helpers the CPU op tests share (tests/unit/test_cpu_ops_*.cpp): host tensors from listed
// values, rows of an index tensor, the logistic function in double, and a Comparison checked with
// its message.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.h"
#include "tests/support/gradcheck.h"

namespace moetrain::testing {

// A host tensor of `shape` holding `values` in order (rounded to `dtype`).
inline Tensor tensor_of(const std::vector<double>& values, Shape shape, DType dtype = DType::kF64) {
  Tensor t(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i) set_element(t, static_cast<int64_t>(i), values[i]);
  return t;
}

// A host I32 tensor of `shape` holding `values` (expert indices, selections).
inline Tensor i32_tensor(const std::vector<int32_t>& values, Shape shape) {
  Tensor t(shape, DType::kI32);
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// Row `row` of an I32 tensor [rows, k].
inline std::vector<int32_t> i32_row(const TensorView& index, int64_t row) {
  const int64_t k = index.size(1);
  return std::vector<int32_t>(index.ptr<int32_t>() + row * k, index.ptr<int32_t>() + (row + 1) * k);
}

// Every element of an I32 tensor.
inline std::vector<int32_t> i32_values(const TensorView& t) {
  return std::vector<int32_t>(t.ptr<int32_t>(), t.ptr<int32_t>() + t.numel());
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

inline void check(const Comparison& c) {
  INFO(c.message);
  CHECK(c.ok);
}

}  // namespace moetrain::testing
