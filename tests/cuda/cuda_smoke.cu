// CUDA smoke test: device memory through the tensor Allocator, copies both ways, one trivial
// kernel (y = 2x + 1) checked element by element, and the check macros reporting failures.
// Without a GPU (CI) it prints "SKIPPED: no CUDA device" and exits 77, which CTest reports as
// skipped (SKIP_RETURN_CODE in tests/cuda/CMakeLists.txt), never as passed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"

namespace {

constexpr int kSkipped = 77;

__global__ void affine_f32_kernel(float* y, const float* x, float scale, float shift, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = scale * x[i] + shift;
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw moetrain::Error(moetrain::ExitCode::kInternal, "check failed: " + what);
}

void check_affine_kernel() {
  using namespace moetrain;
  // Not a multiple of the block size, so the tail guard is exercised.
  const int64_t n = (int64_t{1} << 20) + 3;
  std::vector<float> x(n);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uniform(-100.0f, 100.0f);
  for (float& v : x) v = uniform(rng);

  Tensor dx({n}, DType::kF32, cuda::device_allocator());
  Tensor dy({n}, DType::kF32, cuda::device_allocator());
  expect(dx.device() == Device::kCUDA && dy.device() == Device::kCUDA, "allocator device is not CUDA");
  cuda::copy_host_to_device(dx.data(), x.data(), dx.nbytes());
  // All-ones bytes are NaN as float: an element the kernel skips cannot pass for a result.
  CUDA_CHECK(cudaMemset(dy.data(), 0xff, dy.nbytes()));

  const int threads = 256;
  const int blocks = static_cast<int>((n + threads - 1) / threads);
  affine_f32_kernel<<<blocks, threads>>>(dy.ptr<float>(), dx.ptr<float>(), 2.0f, 1.0f, n);
  CUDA_CHECK_LAUNCH();
  cuda::synchronize();

  std::vector<float> y(n, 0.0f);
  cuda::copy_device_to_host(y.data(), dy.data(), dy.nbytes());
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    // 2x is exact in fp32, so 2x + 1 rounds once on either side (fused or not): equal bits.
    const float expected = 2.0f * x[i] + 1.0f;
    if (std::isnan(y[i]) || y[i] != expected) {
      if (wrong < 5) std::fprintf(stderr, "y[%lld] = %g, expected %g\n", static_cast<long long>(i), y[i], expected);
      ++wrong;
    }
  }
  expect(wrong == 0, std::to_string(wrong) + " of " + std::to_string(n) + " elements wrong or NaN");

  // Device-to-device and back: the input comes home bit for bit.
  Tensor dcopy({n}, DType::kF32, cuda::device_allocator());
  cuda::copy_device_to_device(dcopy.data(), dx.data(), dx.nbytes());
  std::vector<float> round_trip(n, 0.0f);
  cuda::copy_device_to_host(round_trip.data(), dcopy.data(), dcopy.nbytes());
  expect(std::memcmp(round_trip.data(), x.data(), x.size() * sizeof(float)) == 0, "host->device->host round trip differs");
  std::printf("affine kernel: %lld elements ok\n", static_cast<long long>(n));
}

void check_errors_are_reported() {
  using namespace moetrain;
  std::string message;
  try {
    CUDA_CHECK(cudaSetDevice(cuda::device_count() + 7));
  } catch (const Error& error) {
    message = error.what();
  }
  expect(message.find("cudaSetDevice") != std::string::npos && message.find("cuda_smoke.cu:") != std::string::npos &&
             message.find("cudaErrorInvalidDevice") != std::string::npos,
         "CUDA_CHECK message: '" + message + "'");

  message.clear();
  try {
    Tensor huge({int64_t{1} << 50}, DType::kF32, cuda::device_allocator());  // 4 PiB
  } catch (const Error& error) {
    message = error.what();
  }
  expect(message.find("out of GPU memory") != std::string::npos, "out-of-memory message: '" + message + "'");
  Tensor empty({0}, DType::kF32, cuda::device_allocator());
  expect(empty.defined() && empty.device() == Device::kCUDA, "zero-element device tensor");
  std::printf("error reporting: ok\n");
}

}  // namespace

int main() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount returned 0");
    return kSkipped;
  }
  try {
    moetrain::cuda::set_device(0);
    check_affine_kernel();
    check_errors_are_reported();
  } catch (const moetrain::Error& error) {
    std::fprintf(stderr, "FAILED: %s\n", error.what());
    return 1;
  }
  std::printf("cuda_smoke: passed on %d device(s)\n", count);
  return 0;
}
