// CachingAllocator over a counting host allocator with a memory limit: freed blocks come back
// for the same rounded size without an upstream call, other sizes go upstream, running out
// returns the cache and retries, and the statistics count what tensors hold.
#include <cstdlib>
#include <new>
#include <map>
#include <set>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/tensor.h"
#include "kernels/caching_allocator.h"

using moetrain::Allocator;
using moetrain::DType;
using moetrain::Tensor;
using moetrain::kernels::CachingAllocator;

namespace {

class LimitedAllocator final : public Allocator {
 public:
  explicit LimitedAllocator(size_t limit) : limit_(limit) {}
  moetrain::Device device() const override { return moetrain::Device::kCPU; }
  void* allocate(size_t bytes) override {
    if (held_ + bytes > limit_) throw std::bad_alloc();
    ++allocations;
    held_ += bytes;
    void* p = std::malloc(bytes);
    sizes_[p] = bytes;
    return p;
  }
  void deallocate(void* ptr) override {
    ++deallocations;
    held_ -= sizes_.at(ptr);
    sizes_.erase(ptr);
    std::free(ptr);
  }
  size_t held() const { return held_; }
  int allocations = 0;
  int deallocations = 0;

 private:
  size_t limit_;
  size_t held_ = 0;
  std::map<void*, size_t> sizes_;
};

}  // namespace

TEST_CASE("sizes round up to 512 B steps, and to 2 MiB steps from 1 MiB on") {
  CHECK(CachingAllocator::rounded_size(0) == 512);
  CHECK(CachingAllocator::rounded_size(1) == 512);
  CHECK(CachingAllocator::rounded_size(513) == 1024);
  CHECK(CachingAllocator::rounded_size((1 << 20) - 1) == (1 << 20));
  CHECK(CachingAllocator::rounded_size(1 << 20) == (2 << 20));
  CHECK(CachingAllocator::rounded_size((2 << 20) + 1) == (4 << 20));
}

TEST_CASE("a freed block serves the next request of its size without going upstream") {
  LimitedAllocator upstream(1 << 24);
  CachingAllocator cache(upstream);
  void* first = nullptr;
  {
    Tensor a({100}, DType::kF32, cache);  // 400 B -> a 512 B block
    first = a.data();
  }
  CHECK(upstream.allocations == 1);
  CHECK(upstream.deallocations == 0);  // cached, not returned
  {
    Tensor b({120}, DType::kF32, cache);  // 480 B: the same 512 B block
    CHECK(b.data() == first);
    Tensor c({200}, DType::kF32, cache);  // 800 B -> 1024 B: a new block
    CHECK(c.data() != first);
    auto s = cache.stats();
    CHECK(s.in_use_bytes == 512 + 1024);
    CHECK(s.reserved_bytes == 512 + 1024);
    CHECK(s.reused == 1);
    CHECK(s.upstream_allocations == 2);
  }
  auto s = cache.stats();
  CHECK(s.in_use_bytes == 0);
  CHECK(s.peak_in_use_bytes == 512 + 1024);
  CHECK(upstream.held() == 512 + 1024);
  cache.release_cached();
  CHECK(upstream.held() == 0);
  CHECK(cache.stats().reserved_bytes == 0);
}

TEST_CASE("out of memory upstream: the cache is returned and the request tried again") {
  LimitedAllocator upstream(4096);
  CachingAllocator cache(upstream);
  { Tensor a({768}, DType::kF32, cache); }  // 3072 B, cached after use
  CHECK(upstream.held() == 3072);
  // 2048 B does not fit beside the cached 3072 B; returning the cache makes room.
  Tensor b({512}, DType::kF32, cache);
  CHECK(upstream.deallocations == 1);
  CHECK(upstream.held() == 2048);
  // A request that can never fit still fails, with nothing cached to give back; the tensor says
  // what it was (upstream's std::bad_alloc becomes an Error naming it).
  CHECK_THROWS_WITH(Tensor({2048}, DType::kF32, cache),
                    "F32 tensor [2048] (8192 bytes) on the cpu: out of host memory");
}

TEST_CASE("the cache returns its blocks when it is destroyed") {
  LimitedAllocator upstream(1 << 20);
  {
    CachingAllocator cache(upstream);
    std::set<void*> seen;
    for (int i = 0; i < 4; ++i) {
      Tensor t({64 * (i + 1)}, DType::kF64, cache);
      seen.insert(t.data());
    }
    CHECK(seen.size() == 4);
    CHECK(upstream.held() > 0);
  }
  CHECK(upstream.held() == 0);
}

TEST_CASE("a block freed upstream behind the cache's back is refused when upstream hands it out again") {
  // An upstream with one slot, as cudaMalloc returns a just-freed address again.
  class OneSlot final : public Allocator {
   public:
    moetrain::Device device() const override { return moetrain::Device::kCPU; }
    void* allocate(size_t bytes) override {
      if (taken || bytes > sizeof(slot)) throw std::bad_alloc();
      taken = true;
      return slot;
    }
    void deallocate(void*) override { taken = false; }
    alignas(64) unsigned char slot[8192];
    bool taken = false;
  } upstream;
  CachingAllocator cache(upstream);
  void* first = cache.allocate(4096);
  upstream.deallocate(first);  // what DeviceScratch once did with cudaFree
  try {
    cache.allocate(1024);  // another size: upstream returns the same address
    FAIL("the stale block was handed out again");
  } catch (const moetrain::Error& error) {
    CHECK(std::string(error.what()).find("freed behind its back") != std::string::npos);
  }
  CHECK_FALSE(upstream.taken);  // the refused block went back upstream
}
