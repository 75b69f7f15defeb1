#include "kernels/cuda/scratch.h"

#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"

namespace moetrain::kernels::cuda_ops {

DeviceScratch::~DeviceScratch() {
  if (data_ != nullptr) {
    const cudaError_t status = cudaFree(data_);
    // At process exit the runtime may already be gone (cudaErrorCudartUnloading): nothing to free.
    if (status != cudaSuccess && status != cudaErrorCudartUnloading) std::fprintf(stderr, "moetrain: cudaFree(scratch) failed: %s\n", cudaGetErrorString(status));
  }
}

void* DeviceScratch::reserve(size_t bytes) {
  if (bytes <= bytes_ && data_ != nullptr) return data_;
  // Grow by at least half again, so that a slowly rising size does not reallocate every call.
  size_t grown = bytes_ + bytes_ / 2;
  if (grown < bytes) grown = bytes;
  grown = round_up(grown < 256 ? 256 : grown);
  if (data_ != nullptr) {
    CUDA_CHECK(cudaFree(data_));  // waits for the device: no kernel still reads the old buffer
    data_ = nullptr;
    bytes_ = 0;
  }
  data_ = cuda::device_allocator().allocate(grown);  // an Error naming free memory on failure
  bytes_ = grown;
  return data_;
}

}  // namespace moetrain::kernels::cuda_ops
