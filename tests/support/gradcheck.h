// Test helpers shared by the op tests: deterministic random tensors, tensor comparison with a
// relative+absolute tolerance that reports the worst element, and a central-difference gradient
// checker in double.
//
// The gradient check, the usual way for a backward op:
//   1. pick a random "upstream gradient" dy and define the scalar loss L(x) = sum(dy * f(x));
//   2. run the backward with dy: it gives dL/dx (the analytic gradient);
//   3. check_gradient perturbs x[i] by +-eps, re-evaluates L through the forward, and compares
//      (L(x + eps) - L(x - eps)) / (2 eps) with the analytic value at every checked element.
// Everything is in double, so eps ~ 1e-6 leaves ~1e-9 of truncation and rounding error.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/base/tensor.h"

namespace moetrain::testing {

// splitmix64: the same stream on every platform and standard library (std distributions are not).
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next_u64() % static_cast<uint64_t>(n)); }
  // Magnitude in [lo, hi] with a random sign: never zero, so no term of a test vanishes.
  double nonzero(double lo = 0.1, double hi = 1.0) { return (next_u64() & 1 ? 1.0 : -1.0) * uniform(lo, hi); }

 private:
  uint64_t state_;
};

inline double get_element(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return static_cast<const float*>(t.data)[i];
    case DType::kF64: return static_cast<const double*>(t.data)[i];
    case DType::kI32: return static_cast<const int32_t*>(t.data)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(t.data)[i]);
    default: MOETRAIN_ASSERT(false, std::string("get_element on ") + dtype_name(t.dtype));
  }
  return 0.0;
}

inline void set_element(const TensorView& t, int64_t i, double value) {
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[i] = static_cast<float>(value); return;
    case DType::kF64: static_cast<double*>(t.data)[i] = value; return;
    case DType::kI32: static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(value); return;
    case DType::kI64: static_cast<int64_t*>(t.data)[i] = static_cast<int64_t>(value); return;
    default: MOETRAIN_ASSERT(false, std::string("set_element on ") + dtype_name(t.dtype));
  }
}

// A host I32 tensor holding `values` (group offsets, token ids, cu_seqlens).
inline Tensor make_i32(const std::vector<int32_t>& values) {
  Tensor t({static_cast<int64_t>(values.size())}, DType::kI32);
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// A host copy of `src` in `dtype`, element by element through double.
inline Tensor copy_as(const TensorView& src, DType dtype) {
  Tensor t(src.shape, dtype);
  for (int64_t i = 0; i < src.numel(); ++i) set_element(t, i, get_element(src, i));
  return t;
}

// Fills a F32/F64 tensor with values of magnitude in [lo, hi] and random sign (never zero).
inline void fill_random(const TensorView& t, uint64_t seed, double lo = 0.1, double hi = 1.0) {
  TestRng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) set_element(t, i, rng.nonzero(lo, hi));
}

// A new host tensor of the given shape and dtype filled by fill_random.
inline Tensor random_tensor(Shape shape, DType dtype, uint64_t seed, double lo = 0.1, double hi = 1.0) {
  Tensor t(shape, dtype);
  fill_random(t.view(), seed, lo, hi);
  return t;
}

// sum_i a[i] * b[i] in double: the scalar loss L = <dy, y> of a gradient check.
inline double dot(const TensorView& a, const TensorView& b) {
  MOETRAIN_ASSERT(a.numel() == b.numel(), "dot of " + a.shape.str() + " and " + b.shape.str());
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += get_element(a, i) * get_element(b, i);
  return s;
}

struct Comparison {
  bool ok = true;
  double max_abs_error = 0.0;
  std::string message;  // names the worst element; empty when there is nothing to compare
};

inline bool within_tolerance(double actual, double expected, double rtol, double atol) {
  if (std::isnan(actual) || std::isnan(expected)) return false;
  return std::fabs(actual - expected) <= atol + rtol * std::max(std::fabs(actual), std::fabs(expected));
}

// The running tally of an element-wise comparison: how many elements fail, the largest finite
// |error|, and the worst element (the largest excess over its tolerance; a NaN error, from a NaN
// or from inf against inf, is the worst).
struct ElementTally {
  int64_t failures = 0;
  int64_t worst = -1;
  double worst_excess = -1e300;
  double max_abs_error = 0.0;

  // Counts element i, `actual` against `expected`; true when it is the worst so far.
  bool add(int64_t i, double actual, double expected, double rtol, double atol) {
    const double err = std::fabs(actual - expected);
    const double excess =
        std::isnan(err) ? 1e300 : err - (atol + rtol * std::max(std::fabs(actual), std::fabs(expected)));
    if (!within_tolerance(actual, expected, rtol, atol)) ++failures;
    if (!std::isnan(err)) max_abs_error = std::max(max_abs_error, err);
    if (excess <= worst_excess) return false;
    worst_excess = excess;
    worst = i;
    return true;
  }
};

// Element-wise comparison |actual - expected| <= atol + rtol * max(|actual|, |expected|).
// The message names the worst element (largest excess over its tolerance) and the counts.
// Use as: auto c = compare_tensors(...); INFO(c.message); CHECK(c.ok);
inline Comparison compare_tensors(const TensorView& actual, const TensorView& expected, double rtol, double atol,
                                  const std::string& name = "tensor") {
  Comparison result;
  if (actual.numel() != expected.numel()) {
    result.ok = false;
    result.message = name + ": shape " + actual.shape.str() + " vs expected " + expected.shape.str();
    return result;
  }
  ElementTally tally;
  for (int64_t i = 0; i < actual.numel(); ++i) tally.add(i, get_element(actual, i), get_element(expected, i), rtol, atol);
  result.ok = tally.failures == 0;
  result.max_abs_error = tally.max_abs_error;
  if (tally.worst >= 0) {
    std::ostringstream os;
    os.precision(10);
    os << name << ": " << tally.failures << " of " << actual.numel() << " elements outside rtol " << rtol << " atol "
       << atol << "; worst at flat index " << tally.worst << ": got " << get_element(actual, tally.worst)
       << ", expected " << get_element(expected, tally.worst);
    result.message = os.str();
  }
  return result;
}

// The message of the Error that f() throws ("" when it throws none): lets a test check that
// an error names the right thing without Catch2 matchers (their names differ between 2 and 3).
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

struct GradCheckOptions {
  double eps = 1e-6;
  double rtol = 1e-5;
  double atol = 1e-7;
  int64_t max_elements = 64;  // a larger tensor is checked at this many random elements
  uint64_t seed = 7;          // which elements (for large tensors)
};

// Central-difference check of one input's gradient. `input` must be an F64 tensor that `loss`
// reads on every call; `analytic` holds dL/dinput (F64 or F32, same element count).
// Every element is checked when input.numel() <= max_elements, else a fixed random subset.
// The input is restored exactly afterwards.
inline Comparison check_gradient(const std::function<double()>& loss, const TensorView& input,
                                 const TensorView& analytic, const std::string& name,
                                 const GradCheckOptions& options = {}) {
  MOETRAIN_ASSERT(input.dtype == DType::kF64, "gradient checks perturb F64 inputs; " + name + " is " +
                                                  dtype_name(input.dtype));
  MOETRAIN_ASSERT(input.numel() == analytic.numel(),
                  name + ": input " + input.shape.str() + " vs gradient " + analytic.shape.str());
  const int64_t n = input.numel();
  std::vector<int64_t> indices;
  if (n <= options.max_elements) {
    for (int64_t i = 0; i < n; ++i) indices.push_back(i);
  } else {
    TestRng rng(options.seed);
    for (int64_t k = 0; k < options.max_elements; ++k) indices.push_back(rng.below(n));
  }
  double* x = static_cast<double*>(input.data);
  ElementTally tally;
  double worst_fd = 0.0;
  for (int64_t i : indices) {
    const double saved = x[i];
    x[i] = saved + options.eps;
    const double plus = loss();
    x[i] = saved - options.eps;
    const double minus = loss();
    x[i] = saved;
    const double fd = (plus - minus) / (2.0 * options.eps);
    if (tally.add(i, get_element(analytic, i), fd, options.rtol, options.atol)) worst_fd = fd;
  }
  Comparison result;
  result.ok = tally.failures == 0;
  result.max_abs_error = tally.max_abs_error;
  if (tally.worst >= 0) {
    std::ostringstream os;
    os.precision(10);
    os << "gradient of " << name << ": " << tally.failures << " of " << indices.size()
       << " checked elements outside rtol " << options.rtol << " atol " << options.atol << "; worst at flat index "
       << tally.worst << ": analytic " << get_element(analytic, tally.worst) << ", finite difference " << worst_fd;
    result.message = os.str();
  }
  return result;
}

}  // namespace moetrain::testing
