// parallel.recompute_layers: the first N layers re-run their forward in the backward and the
// others keep what their backward reads. Seen from the allocator: the re-run layers allocate their
// forward's tensors a second time, and the step's peak of live tensor bytes falls as N grows.
// (That the loss and the gradients do not change is test_model_gradcheck's.)
#include <algorithm>
#include <cstdint>
#include <unordered_map>

#include "catch.h"
#include "core/model/model.h"
#include "kernels/ops.h"
#include "kernels/timing_backend.h"
#include "tests/support/gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// The CPU backend with an allocator that counts allocations and the peak of live bytes. Ops are
// forwarded unchanged (a disabled TimingBackend).
class CountingAllocations final : public kernels::TimingBackend {
 public:
  explicit CountingAllocations(kernels::Backend& inner) : TimingBackend(inner), counting_(inner) {}
  Allocator& allocator() override { return counting_; }
  void reset() {
    counting_.count = 0;
    counting_.peak = counting_.live;
  }
  int64_t allocations() const { return counting_.count; }
  int64_t peak_bytes() const { return counting_.peak; }

 private:
  struct Counting final : Allocator {
    explicit Counting(kernels::Backend& backend) : inner(backend) {}
    Device device() const override { return inner.allocator().device(); }
    void* allocate(size_t bytes) override {
      void* ptr = inner.allocator().allocate(bytes);
      ++count;
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
    int64_t count = 0, live = 0, peak = 0;
  };
  Counting counting_;
};

struct StepAccount {
  int64_t allocations, peak_bytes;
};

// One training step of the tiny three-layer model (MLA + dense MLP, KDA + MoE, DSA + MoE) after
// a first one (which sets up what persists across steps).
StepAccount account_step(bool recompute, int64_t recompute_layers) {
  Config config = tiny_model_config(true);
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = all_lora_targets(true);
  options.recompute = recompute;
  options.recompute_layers = recompute_layers;
  const Batch batch = tiny_batch(config.model.vocab_size, 3);
  const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  auto cpu = kernels::make_cpu_backend();
  CountingAllocations backend(*cpu);
  Model model(resolve_model_spec(config), backend, options);
  model.init_random_weights();
  model.forward_backward(batch, grad_scale);
  backend.reset();
  model.forward_backward(batch, grad_scale);
  return {backend.allocations(), backend.peak_bytes()};
}

}  // namespace

TEST_CASE("recompute_layers: the first N layers re-run their forward, the peak falls as N grows", "[model]") {
  const StepAccount off = account_step(false, -1);
  const StepAccount first1 = account_step(true, 1);
  const StepAccount first2 = account_step(true, 2);
  const StepAccount all = account_step(true, -1);
  const StepAccount all3 = account_step(true, 3);
  INFO("allocations " << off.allocations << " " << first1.allocations << " " << first2.allocations << " "
                      << all.allocations << "; peak bytes " << off.peak_bytes << " " << first1.peak_bytes << " "
                      << first2.peak_bytes << " " << all.peak_bytes);
  // Each re-run layer allocates its forward's tensors again.
  CHECK(off.allocations < first1.allocations);
  CHECK(first1.allocations < first2.allocations);
  CHECK(first2.allocations < all.allocations);
  CHECK(all3.allocations == all.allocations);  // 3 of 3 layers is every layer
  CHECK(all3.peak_bytes == all.peak_bytes);
  // Fewer layers keep their saved tensors through the step.
  CHECK(off.peak_bytes > first1.peak_bytes);
  CHECK(first1.peak_bytes >= first2.peak_bytes);
  CHECK(first2.peak_bytes >= all.peak_bytes);
  CHECK(off.peak_bytes > all.peak_bytes);
}
