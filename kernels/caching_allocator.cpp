#include "kernels/caching_allocator.h"

#include <algorithm>
#include <new>

#include "core/base/error.h"

namespace moetrain::kernels {

CachingAllocator::CachingAllocator(Allocator& upstream) : upstream_(upstream) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_locked();
}

size_t CachingAllocator::rounded_size(size_t bytes) {
  constexpr size_t kSmallStep = 512, kLargeStep = size_t{2} << 20, kLargeFrom = size_t{1} << 20;
  const size_t step = bytes < kLargeFrom ? kSmallStep : kLargeStep;
  return std::max(step, (bytes + step - 1) / step * step);
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t size = rounded_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* ptr = nullptr;
  auto cached = cached_.find(size);
  if (cached != cached_.end()) {
    ptr = cached->second;
    cached_.erase(cached);
    ++stats_.reused;
  } else {
    try {
      ptr = upstream_.allocate(size);
    } catch (const std::exception&) {
      // Out of memory (Error or bad_alloc): what the cache holds may be what is missing.
      if (cached_.empty()) throw;
      release_cached_locked();
      ptr = upstream_.allocate(size);
    }
    // Upstream hands out an address the cache still counts as in use only when that block was
    // freed behind the cache's back (not through deallocate): its record is stale, and keeping
    // it would give the new block the old size.
    if (in_use_.count(ptr) != 0) {
      upstream_.deallocate(ptr);
      throw Error(ExitCode::kInternal, "caching allocator: a block still counted as in use was freed behind its "
                                       "back (memory from device_allocator() must be returned with deallocate)");
    }
    ++stats_.upstream_allocations;
    stats_.reserved_bytes += size;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  in_use_.emplace(ptr, size);
  stats_.in_use_bytes += size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end()) return;  // not ours: Tensor never does this (and a destructor must not throw)
  stats_.in_use_bytes -= it->second;
  cached_.emplace(it->second, ptr);
  in_use_.erase(it);
}

void CachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_locked();
}

void CachingAllocator::release_cached_locked() {
  for (const auto& [size, ptr] : cached_) {
    upstream_.deallocate(ptr);
    stats_.reserved_bytes -= size;
  }
  cached_.clear();
}

CachingAllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

}  // namespace moetrain::kernels
