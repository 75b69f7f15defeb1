#include "apps/bench/common.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kernels/cuda/common/cuda_check.h"

namespace moetrain::bench {

// `ops`: how long each timing runs its op untimed first (--heat-up-ms). An H200 running GEMMs
// back to back reaches its 700 W power cap within a second and lowers its SM clock from 1980
// MHz to 1245-1750 (nvidia-smi, 2026-12-01). Without the heat-up, a row ran at whatever clock the
// rows before it had left (the same launches differed by up to 25% between a cool GPU and a
// hot one): rows were compared at different clocks, and the first rows of a run timed at clocks
// a training step never sees. scripts/bench_torch_grouped_mm.py heats
// up the same way.
double heat_up_ms = 500;

// Median of `reps` runs after `warmup` runs and, past those, more runs until heat_up_ms have
// passed. Each run is timed by CUDA events recorded on the backend's stream around it: the GPU
// time of the launches, as `torch.cuda.Event` times the peer baselines, without the host's
// launch-and-synchronize round trip (10-20 us, a few percent of a short row).
double median_ms(Backend& backend, const std::function<void()>& op, int reps, int warmup) {
  const auto heat_up_start = std::chrono::steady_clock::now();
  for (int i = 0; i < warmup; ++i) op();
  backend.synchronize();
  while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - heat_up_start).count() <
         heat_up_ms) {
    op();
    backend.synchronize();
  }
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    op();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A device tensor filled from a host buffer of uniform values in +-[0.1, 1] (random signs).
Tensor random_device(Backend& backend, Shape shape, DType dtype, uint64_t seed, double scale) {
  Tensor host(shape, DType::kF32);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  float* p = host.ptr<float>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    double u = 0.1 + 0.9 * static_cast<double>(x >> 11) * 0x1.0p-53;
    p[i] = static_cast<float>((x & 1 ? u : -u) * scale);
  }
  Tensor staged(shape, DType::kF32, backend.allocator());
  backend.copy(staged, host);
  Tensor out(shape, dtype, backend.allocator());
  backend.convert(out, staged);
  return out;
}

Tensor int_device(Backend& backend, const std::vector<int32_t>& values) {
  Tensor host({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), host.ptr<int32_t>());
  Tensor out(host.shape(), DType::kI32, backend.allocator());
  backend.copy(out, host);
  return out;
}

std::string ratio(double value, double target, const char* what) {
  return fmt::format("{:.2f}x {}", value / target, what);
}
Tensor tiled_device(Backend& be, int64_t rows, int64_t d1, int64_t d2, int64_t block_rows, uint64_t seed) {
  Tensor block = random_device(be, {block_rows, d1, d2}, DType::kBF16, seed);
  Tensor out({rows, d1, d2}, DType::kBF16, be.allocator());
  for (int64_t r = 0; r < rows; r += block_rows) {
    const int64_t count = std::min(block_rows, rows - r);
    be.copy(out.view().slice_rows(r, r + count), block.view().slice_rows(0, count));
  }
  return out;
}
void print_rows(const std::vector<Row>& rows) {
  std::printf("\n%-58s %10s %10s %9s  %s\n", "benchmark", "ms", "TFLOP/s", "TB/s", "versus");
  for (const Row& r : rows) {
    std::printf("%-58s %10.3f %10s %9s  %s\n", r.name.c_str(), r.ms,
                r.tflops > 0 ? fmt::format("{:.1f}", r.tflops).c_str() : "-",
                r.tbps > 0 ? fmt::format("{:.2f}", r.tbps).c_str() : "-", r.versus.c_str());
  }
}

}  // namespace moetrain::bench
