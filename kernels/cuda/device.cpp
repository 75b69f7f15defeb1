#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moetrain::cuda {
namespace {

class DeviceAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCUDA; }

  void* allocate(size_t bytes) override {
    void* ptr = nullptr;
    // A zero-byte tensor still gets a distinct, freeable pointer.
    const cudaError_t status = cudaMalloc(&ptr, bytes == 0 ? 256 : bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      throw Error(ExitCode::kInternal,
                  "out of GPU memory on device " + std::to_string(current_device()) + ": asked for " +
                      std::to_string(bytes >> 20) + " MiB with " + std::to_string(free_bytes >> 20) + " of " +
                      std::to_string(total_bytes >> 20) + " MiB free; lower data.micro_batch or "
                      "data.seq_len, or spread the model over more ranks (parallel.fsdp, parallel.ep)");
    }
    CUDA_CHECK(status);
    return ptr;
  }

  // Called from Tensor's destructor, so it must not throw: a failure is reported and left.
  void deallocate(void* ptr) override {
    const cudaError_t status = cudaFree(ptr);
    if (status != cudaSuccess) {
      std::fprintf(stderr, "moetrain: cudaFree failed: %s\n", cudaGetErrorString(status));
    }
  }
};

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

Allocator& device_allocator() {
  static DeviceAllocator allocator;
  return allocator;
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
