#include "kernels/cuda/common/device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kernels/caching_allocator.h"
#include "kernels/cuda/common/cuda_check.h"

namespace moetrain::cuda {
namespace {

class DeviceAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCUDA; }

  void* allocate(size_t bytes) override {
    void* ptr = nullptr;
    // A zero-byte tensor still gets a distinct, freeable pointer.
    const size_t size = bytes == 0 ? 256 : bytes;
    const cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      MemoryStats held;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        held = stats_;
      }
      // The caching allocator has already given its free blocks back before this fails.
      throw Error(ExitCode::kInternal,
                  "out of GPU memory on device " + std::to_string(current_device()) + ": asked for " +
                      std::to_string(bytes >> 20) + " MiB with " + std::to_string(free_bytes >> 20) + " of " +
                      std::to_string(total_bytes >> 20) + " MiB free; moetrain's tensors hold " +
                      std::to_string(held.allocated_bytes >> 20) + " MiB (peak " +
                      std::to_string(held.peak_bytes >> 20) + " MiB, " + std::to_string(held.allocations) +
                      " cudaMalloc calls so far). Lower data.micro_batch or data.seq_len, turn "
                      "parallel.recompute on (for every layer: parallel.recompute_layers -1), or spread the "
                      "model over more ranks (parallel.fsdp, parallel.ep); "
                      "`moetrain plan` shows what fits");
    }
    CUDA_CHECK(status);
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[ptr] = size;
    stats_.allocated_bytes += size;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.allocated_bytes);
    ++stats_.allocations;
    return ptr;
  }

  // Called from Tensor's destructor, so it must not throw: a failure is reported and left.
  void deallocate(void* ptr) override {
    const cudaError_t status = cudaFree(ptr);
    if (status != cudaSuccess) {
      std::fprintf(stderr, "moetrain: cudaFree failed: %s\n", cudaGetErrorString(status));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    if (it != sizes_.end()) {
      stats_.allocated_bytes -= it->second;
      sizes_.erase(it);
    }
  }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes = stats_.allocated_bytes;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  MemoryStats stats_;
};

DeviceAllocator& direct_allocator() {
  static DeviceAllocator allocator;
  return allocator;
}

// MOETRAIN_CUDA_ALLOCATOR: "caching" (default: freed blocks kept for reuse) or "direct"
// (cudaMalloc/cudaFree per tensor; cudaFree waits for the device).
kernels::CachingAllocator* caching_allocator() {
  static kernels::CachingAllocator* caching = []() -> kernels::CachingAllocator* {
    const char* choice = std::getenv("MOETRAIN_CUDA_ALLOCATOR");
    const std::string name = choice == nullptr ? "caching" : choice;
    MOETRAIN_CHECK(name == "direct" || name == "caching", ExitCode::kBadConfig,
                   "MOETRAIN_CUDA_ALLOCATOR=\"" + name + "\": expected direct or caching");
    // Never destroyed: tensors may be freed during static destruction.
    return name == "caching" ? new kernels::CachingAllocator(direct_allocator()) : nullptr;
  }();
  return caching;
}

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

void set_device(int device) { CUDA_CHECK(cudaSetDevice(device)); }

int current_device() {
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int multiprocessor_count() {
  static std::atomic<int> counts[64] = {};
  const int device = current_device();
  std::atomic<int>& count = counts[device % 64];
  if (count.load() == 0) {
    int asked = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&asked, cudaDevAttrMultiProcessorCount, device));
    count.store(asked);
  }
  return count.load();
}

Allocator& device_allocator() {
  if (kernels::CachingAllocator* caching = caching_allocator()) return *caching;
  return direct_allocator();
}

MemoryStats memory_stats() {
  MemoryStats stats = direct_allocator().stats();  // what cudaMalloc holds
  if (kernels::CachingAllocator* caching = caching_allocator()) {
    const kernels::CachingAllocatorStats c = caching->stats();
    stats.allocated_bytes = c.in_use_bytes;  // tensors, not the cache around them
    stats.peak_bytes = c.peak_in_use_bytes;
  }
  return stats;
}

void reset_peak_memory() {
  direct_allocator().reset_peak();
  if (kernels::CachingAllocator* caching = caching_allocator()) caching->reset_peaks();
}

double peak_bf16_flops() {
  cudaDeviceProp props{};
  CUDA_CHECK(cudaGetDeviceProperties(&props, current_device()));
  const std::string name = props.name;
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  // Dense (no sparsity) BF16 from NVIDIA's datasheets.
  if (has("H100") && has("PCIe")) return 756e12;
  if (has("H100") || has("H200") || has("H800") || has("GH200")) return 989.4e12;
  if (has("B200")) return 2250e12;
  if (has("A100") || has("A800")) return 312e12;
  return 0.0;
}

size_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

void copy_host_to_device(void* device_dst, const void* host_src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice));
}

void copy_device_to_host(void* host_dst, const void* device_src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost));
}

void copy_device_to_device(void* device_dst, const void* device_src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice));
}

void synchronize() { CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace moetrain::cuda
