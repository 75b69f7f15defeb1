// A grow-only device buffer for the scratch space of one op call (BF16 copies of F32 GEMM
// operands, reduction partials, uploaded index tables). Owned by the CUDA backend; every user
// is on the backend's one stream, so a call may reuse the space of the previous one without
// waiting: stream order already puts the previous kernels first. The buffer comes from and goes
// back to cuda::device_allocator(); growing waits for the device first, so no kernel still
// reads the old buffer when the allocator reuses it.
// Pointers from reserve() stay valid until the next reserve().
#pragma once

#include <cstddef>

namespace moetrain::kernels::cuda_ops {

class DeviceScratch {
 public:
  DeviceScratch() = default;
  ~DeviceScratch();
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;

  // At least `bytes` of device memory, 256-byte aligned.
  void* reserve(size_t bytes);

  // Offsets that keep each carved region 256-byte aligned.
  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace moetrain::kernels::cuda_ops
