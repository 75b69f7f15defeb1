// A backend whose allocator counts allocations and the peak of live bytes, and can fail one
// allocation (as the CUDA allocator does when the GPU is full). Ops are forwarded unchanged (a
// disabled TimingBackend).
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>

#include "core/base/error.h"
#include "kernels/timing_backend.h"

namespace moetrain::testing {

class CountingBackend final : public kernels::TimingBackend {
 public:
  explicit CountingBackend(kernels::Backend& inner) : TimingBackend(inner), counting_(inner) {}
  Allocator& allocator() override { return counting_; }
  // Restarts the counts (the peak from the bytes live now); the fail_at-th allocation from here
  // throws Error(kInternal) (none when fail_at < 0).
  void arm(int64_t fail_at = -1) {
    counting_.count = 0;
    counting_.fail_at = fail_at;
    counting_.peak = counting_.live;
  }
  int64_t allocations() const { return counting_.count; }
  int64_t peak_bytes() const { return counting_.peak; }

 private:
  struct Counting final : Allocator {
    explicit Counting(kernels::Backend& backend) : inner(backend) {}
    Device device() const override { return inner.allocator().device(); }
    void* allocate(size_t bytes) override {
      if (++count == fail_at) throw Error(ExitCode::kInternal, "out of GPU memory (simulated)");
      void* ptr = inner.allocator().allocate(bytes);
      sizes[ptr] = static_cast<int64_t>(bytes);
      live += static_cast<int64_t>(bytes);
      peak = std::max(peak, live);
      return ptr;
    }
    void deallocate(void* ptr) override {
      auto it = sizes.find(ptr);
      if (it != sizes.end()) {
        live -= it->second;
        sizes.erase(it);
      }
      inner.allocator().deallocate(ptr);
    }
    kernels::Backend& inner;
    std::unordered_map<void*, int64_t> sizes;
    int64_t count = 0, fail_at = -1, live = 0, peak = 0;
  };
  Counting counting_;
};

}  // namespace moetrain::testing
