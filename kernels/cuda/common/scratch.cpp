#include "kernels/cuda/common/scratch.h"

#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"

namespace moetrain::kernels::cuda_ops {

// The buffer goes back to the allocator it came from: freeing it with cudaFree behind the
// caching allocator's back left the allocator a record of a block that no longer existed, and a
// later cudaMalloc that returned the same address inherited that record's (larger) size.
DeviceScratch::~DeviceScratch() {
  if (data_ != nullptr) cuda::device_allocator().deallocate(data_);
}

void* DeviceScratch::reserve(size_t bytes) {
  if (bytes <= bytes_ && data_ != nullptr) return data_;
  // Grow by at least half again, so that a slowly rising size does not reallocate every call.
  size_t grown = bytes_ + bytes_ / 2;
  if (grown < bytes) grown = bytes;
  grown = round_up(grown < 256 ? 256 : grown);
  if (data_ != nullptr) {
    // Kernels queued on the stream may still read the old buffer; the allocator may hand it out
    // at once, which is safe only for work on that same stream. Growing is rare: wait.
    CUDA_CHECK(cudaDeviceSynchronize());
    cuda::device_allocator().deallocate(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  data_ = cuda::device_allocator().allocate(grown);  // an Error naming free memory on failure
  bytes_ = grown;
  return data_;
}

}  // namespace moetrain::kernels::cuda_ops
