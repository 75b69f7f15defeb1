// CachingAllocator: keeps freed blocks for reuse instead of returning them upstream, so the
// temporaries a training step allocates and frees (thousands per step, the same sizes every
// step) stop costing a cudaMalloc and a cudaFree each -- and cudaFree synchronizes the device,
// which stops the host from running ahead of the GPU. The CUDA backend's default
// (MOETRAIN_CUDA_ALLOCATOR=direct turns it off, kernels/cuda/common/device.h).
//
// Blocks are reused for requests of exactly the same rounded size (512 B steps up to 1 MiB, then
// 2 MiB steps): a step allocates the same shapes every time, and an exact match never hands a
// large block to a small request. When upstream runs out of memory, every cached block is
// returned and the request is tried once more.
//
// Reuse is immediate, on the host's word that the previous owner is done: correct when all work
// on a block is ordered on one device queue, or ordered against it before the block's memory is
// freed or reused (the backend's stream; collectives call Communicator::wait_for first or wait
// on the host -- see core/model/fsdp_bucket.h). Backend-neutral (tested over the host allocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

#include "core/base/tensor.h"

namespace moetrain::kernels {

struct CachingAllocatorStats {
  size_t in_use_bytes = 0;     // blocks handed out now (rounded sizes)
  size_t peak_in_use_bytes = 0;
  size_t reserved_bytes = 0;   // in use + cached, all obtained from upstream
  size_t peak_reserved_bytes = 0;
  int64_t upstream_allocations = 0;  // calls to the upstream allocator
  int64_t reused = 0;                // requests served from the cache
};

class CachingAllocator final : public Allocator {
 public:
  // `upstream` is not owned and must outlive this allocator.
  explicit CachingAllocator(Allocator& upstream);
  ~CachingAllocator() override;  // returns every cached block (blocks still in use are leaked)
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  Device device() const override { return upstream_.device(); }
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr) override;

  void release_cached();  // returns every cached (free) block upstream
  CachingAllocatorStats stats() const;
  void reset_peaks();

  static size_t rounded_size(size_t bytes);

 private:
  void release_cached_locked();

  Allocator& upstream_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> cached_;         // free blocks by size
  std::unordered_map<void*, size_t> in_use_;    // handed-out blocks and their sizes
  CachingAllocatorStats stats_;
};

}  // namespace moetrain::kernels
