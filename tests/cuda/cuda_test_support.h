// Helpers of the CUDA op tests: each op runs on the GPU and on the CPU reference (in F64) from
// the same input values, and the outputs are compared with a tolerance for the output dtype.
//   - Inputs: random values of magnitude [lo, hi] with random signs (never zero), rounded to
//     what the device dtype holds, so that both backends start from identical numbers.
//   - Outputs: device tensors filled with all-ones bytes (NaN in every floating dtype) before
//     the op runs: an element the op forgets to write fails the comparison.
//   - Comparison: no NaN anywhere, relative L2 error ||a - e|| / ||e|| under `rel_l2`, and every
//     element within atol + rtol * |e|, atol a fraction of max |e|.
//   - One argument list for both runs: an op's arguments are built once, by a function of the
//     BackendSide, and that function is called for the GPU run and for the CPU run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/base/tensor.h"
#include "gradcheck.h"
#include "kernels/cuda/common/device.h"
#include "kernels/ops.h"

namespace moetrain::cuda_test {

inline kernels::Backend& gpu() {
  static std::unique_ptr<kernels::Backend> backend = kernels::make_cuda_backend();
  return *backend;
}
inline kernels::Backend& cpu() {
  static std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  return *backend;
}

// Host values as the dtype holds them: F64 -> dtype -> F64, in place.
inline void round_host(const TensorView& host64, DType dtype) {
  if (dtype == DType::kF64) return;
  Tensor narrow(host64.shape, dtype);
  convert_host(narrow.view(), host64);
  convert_host(host64, narrow.view());
}

// A device tensor of `dtype` holding the values of the F64 (or I32) host tensor.
inline Tensor upload(const TensorView& host, DType dtype) {
  Tensor converted(host.shape, dtype);
  if (dtype == host.dtype) {
    std::copy(static_cast<const char*>(host.data), static_cast<const char*>(host.data) + host.nbytes(),
              static_cast<char*>(converted.data()));
  } else {
    convert_host(converted.view(), host);
  }
  Tensor device(host.shape, dtype, cuda::device_allocator());
  gpu().copy(device, converted);  // on the backend's stream, so ordered with its kernels
  return device;
}

// The device tensor's values as an F64 host tensor (I32/I64 come back as I32/I64).
inline Tensor download(const TensorView& device) {
  Tensor raw(device.shape, device.dtype);
  gpu().copy(raw, device);  // waits for the backend's stream
  if (device.dtype == DType::kI32 || device.dtype == DType::kI64 || device.dtype == DType::kF64) return raw;
  Tensor wide(device.shape, DType::kF64);
  convert_host(wide.view(), raw.view());
  return wide;
}

// An int32 device tensor equals a host one exactly (counts the mismatches, names the first).
inline void expect_same_ints(const TensorView& device, const TensorView& host, const char* name) {
  const Tensor got = download(device);
  REQUIRE(got.numel() == host.numel());
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < host.numel(); ++i) {
    if (got.ptr<int32_t>()[i] != host.ptr<int32_t>()[i]) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  INFO(std::string(name) + ": " + std::to_string(mismatches) + " of " + std::to_string(host.numel()) +
       " differ, first at " + std::to_string(first));
  CHECK(mismatches == 0);
}

// A device tensor whose every byte is 0xff: NaN for F32, BF16 and F16.
inline Tensor poisoned(Shape shape, DType dtype) {
  Tensor ones(shape, dtype);
  std::fill(static_cast<unsigned char*>(ones.data()), static_cast<unsigned char*>(ones.data()) + ones.nbytes(), 0xff);
  Tensor device(shape, dtype, cuda::device_allocator());
  gpu().copy(device, ones);
  return device;
}

// One operand on both backends: `host` F64 (the values), `dev` the device tensor.
struct Operand {
  Tensor host;
  Tensor dev;
};

// The host values (set or changed by the test) rounded to `dtype`, and the device tensor replaced
// by their upload in `dtype`: both sides hold the same numbers again.
inline void round_and_upload(Operand& op, DType dtype) {
  round_host(op.host.view(), dtype);
  op.dev = upload(op.host.view(), dtype);
}

// Input from F64 host values the test made: rounded to `dtype`, uploaded in `dtype`.
inline Operand operand_from_host(Tensor host, DType dtype) {
  Operand op;
  op.host = std::move(host);
  round_and_upload(op, dtype);
  return op;
}

// Random input: host values rounded to `dtype`, uploaded in `dtype`.
inline Operand random_operand(Shape shape, DType dtype, uint64_t seed, double lo = 0.1, double hi = 1.0) {
  return operand_from_host(testing::random_tensor(shape, DType::kF64, seed, lo, hi), dtype);
}

// Output: host zeros (the CPU reference writes them), device poisoned.
inline Operand output_operand(Shape shape, DType dtype) {
  return Operand{Tensor::zeros(shape, DType::kF64), poisoned(shape, dtype)};
}

// Integer operand (I32) with the same values on both sides.
inline Operand int_operand(const std::vector<int32_t>& values, Shape shape) {
  Operand op;
  op.host = Tensor(shape, DType::kI32);
  std::copy(values.begin(), values.end(), op.host.ptr<int32_t>());
  op.dev = upload(op.host.view(), DType::kI32);
  return op;
}

// Integer output (I32, e.g. selected indices): a host tensor the CPU writes, the device one
// poisoned with -1 bytes.
inline Operand int_output_operand(Shape shape) {
  return Operand{Tensor(shape, DType::kI32), poisoned(shape, DType::kI32)};
}

// Packed sequences: cu_seqlens (0, then the end of each segment) as an I32 operand, and as the
// words that name a case's layout in a failure message ("cu_seqlens 0 5 133").
inline Operand cu_seqlens_operand(const std::vector<int32_t>& cu_seqlens) {
  return int_operand(cu_seqlens, Shape{static_cast<int64_t>(cu_seqlens.size())});
}
inline std::string cu_seqlens_label(const std::vector<int32_t>& cu_seqlens) {
  std::string s = "cu_seqlens";
  for (int32_t b : cu_seqlens) s += " " + std::to_string(b);
  return s;
}

// Which tensor of each Operand an op's arguments take: the device one on the GPU side, the F64
// host one on the CPU side. A test writes the arguments once, as a function of the side
// (`args.x = on(x)`), and runs gpu().op(make_args(kGpu)) and cpu().op(make_args(kCpu)), so the
// two runs cannot differ in anything but the backend. `on.device` is there for the few
// arguments that differ by design (an in-place output on the GPU side).
struct BackendSide {
  bool device;
  TensorView operator()(const Operand& op) const { return device ? op.dev.view() : op.host.view(); }
};
inline constexpr BackendSide kGpu{true};
inline constexpr BackendSide kCpu{false};

struct Tolerance {
  double rel_l2;
  double rtol;
  double atol_fraction;  // atol = atol_fraction * max |expected|
};

// The tolerance for an output stored in `dtype` (computed in F32 on the GPU).
inline Tolerance tolerance_for(DType dtype) {
  // BF16: one rounding of 2^-9 relative at most (~1e-3 RMS); F32: F32 arithmetic vs F64.
  if (dtype == DType::kBF16) return {5e-3, 1.6e-2, 2e-3};
  return {2e-5, 2e-4, 2e-5};
}

struct Result {
  bool ok = true;
  std::string message;
};

inline Result compare(const TensorView& actual, const TensorView& expected, Tolerance tol, const std::string& name) {
  Result r;
  std::ostringstream os;
  os.precision(8);
  if (actual.numel() != expected.numel()) {
    r.ok = false;
    os << name << ": " << actual.numel() << " elements, expected " << expected.numel();
    r.message = os.str();
    return r;
  }
  double max_expected = 0.0, diff2 = 0.0, ref2 = 0.0, worst_excess = -1.0;
  int64_t nans = 0, outside = 0, worst = -1;
  for (int64_t i = 0; i < expected.numel(); ++i) max_expected = std::max(max_expected, std::fabs(testing::get_element(expected, i)));
  const double atol = tol.atol_fraction * max_expected;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    const double a = testing::get_element(actual, i), e = testing::get_element(expected, i);
    if (std::isnan(a) || std::isnan(e)) {
      if (nans++ == 0) worst = i;
      continue;
    }
    diff2 += (a - e) * (a - e);
    ref2 += e * e;
    const double excess = std::fabs(a - e) - (atol + tol.rtol * std::fabs(e));
    if (excess > 0) ++outside;
    if (nans == 0 && excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  r.ok = nans == 0 && outside == 0 && rel <= tol.rel_l2;
  os << name << " " << actual.shape.str() << ": rel L2 " << rel << " (limit " << tol.rel_l2 << "), " << nans
     << " NaN, " << outside << " outside atol " << atol << " + rtol " << tol.rtol;
  if (worst >= 0)
    os << "; worst at " << worst << ": got " << testing::get_element(actual, worst) << ", expected "
       << testing::get_element(expected, worst);
  r.message = os.str();
  return r;
}

// Downloads a device output and compares it with the CPU's F64 result.
#define CUDA_TEST_EXPECT_CLOSE(device_tensor, host_expected, tolerance, name)                                   \
  do {                                                                                                        \
    const Tensor cuda_test_actual_ = ::moetrain::cuda_test::download(device_tensor);                          \
    const ::moetrain::cuda_test::Result cuda_test_result_ =                                                  \
        ::moetrain::cuda_test::compare(cuda_test_actual_.view(), host_expected, tolerance, name);              \
    INFO(cuda_test_result_.message);                                                                          \
    CHECK(cuda_test_result_.ok);                                                                              \
  } while (0)

// Two tensors of the same shape and dtype hold the same bytes (a bitwise-repeatability check).
inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// ---------------------------------------------------------------------------------------------
// The device and the environment

// The current device's compute capability as major * 10 + minor (90: H100 and H200), 0 when no
// device is visible.
inline int compute_capability() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return 10 * major + minor;
}
// Where the Hopper (sm_90a) kernels run, and so where a test expects them to be taken.
inline bool device_is_sm90() { return compute_capability() == 90; }

// Sets an environment variable (a kernel-path switch such as MOETRAIN_ATTENTION) for one scope,
// or unsets it for nullptr, and restores what was there when the scope ends, however it ends.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_old_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_old_ = false;
  std::string old_;
};

// ---------------------------------------------------------------------------------------------
// GEMM and grouped GEMM inputs

// A GEMM input: values BF16-representable (the GPU rounds F32 operands to BF16 before the
// tensor-core product, ops.h), stored on the GPU in `dtype`.
inline Operand gemm_input(Shape shape, DType dtype, uint64_t seed) {
  Operand op = random_operand(shape, DType::kBF16, seed);
  op.dev = upload(op.host.view(), dtype);
  return op;
}

// Tensor-core accumulation is F32 but not necessarily in the CPU's order or rounding (Hopper's
// MMA may truncate partial sums), so F32 GEMM outputs get a looser bound than elementwise F32.
inline Tolerance gemm_tolerance(DType c_dtype) {
  if (c_dtype == DType::kBF16) return tolerance_for(c_dtype);
  return {1e-4, 1e-3, 1e-4};
}

// Group offsets of a grouped GEMM: 0, then the running sum of the group sizes.
inline std::vector<int32_t> prefix_sums(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> offsets{0};
  for (int32_t s : sizes) offsets.push_back(offsets.back() + s);
  return offsets;
}

// `groups` counts around `mean` rows, a few at 7x the mean and a few empty (routing skew).
inline std::vector<int32_t> skewed_sizes(int groups, int mean, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> around(mean / 2, mean * 3 / 2);
  std::vector<int32_t> sizes(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) sizes[static_cast<size_t>(g)] = around(rng);
  for (int g = 0; g < groups; g += 13) sizes[static_cast<size_t>(g)] = 7 * mean;
  for (int g = 5; g < groups; g += 11) sizes[static_cast<size_t>(g)] = 0;
  return sizes;
}

}  // namespace moetrain::cuda_test
