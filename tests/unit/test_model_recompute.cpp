// parallel.recompute_layers: the first N layers re-run their forward in the backward and the
// others keep what their backward reads. Seen from the allocator: the re-run layers allocate their
// forward's tensors a second time, and the step's peak of live tensor bytes falls as N grows.
// (That the loss and the gradients do not change is test_model_gradcheck's.)
#include <cstdint>

#include "catch.h"
#include "tests/support/counted_tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct StepAccount {
  int64_t allocations, peak_bytes;
};

// One training step of the tiny three-layer model (MLA + dense MLP, KDA + MoE, DSA + MoE) after
// a first one (which sets up what persists across steps).
StepAccount account_step(bool recompute, int64_t recompute_layers) {
  CountedTinyModel tiny(recompute, recompute_layers);
  tiny.step();
  tiny.backend.arm();
  tiny.step();
  return {tiny.backend.allocations(), tiny.backend.peak_bytes()};
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
