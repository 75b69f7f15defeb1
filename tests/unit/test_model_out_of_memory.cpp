// An allocation that fails inside a training step (as the CUDA allocator does when the GPU is
// full) ends the step with an Error that names the layer, the pass and the tensor in front of the
// allocator's own account, and keeps that error's exit code.
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "tests/support/counted_tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

TEST_CASE("an allocation failing inside a training step names the layer, the pass and the tensor", "[model]") {
  for (bool recompute : {false, true}) {
    INFO((recompute ? "recompute on" : "recompute off"));
    CountedTinyModel tiny(recompute);
    tiny.backend.arm(-1);
    tiny.step();
    const int64_t per_step = tiny.backend.allocations();
    REQUIRE(per_step > 20);

    // Every allocation of the step in turn: each failure names the part of the step, the tensor
    // and the allocator's own message, with its exit code; layers' forwards and backwards among them.
    int in_forward = 0, in_backward = 0;
    for (int64_t fail_at = 1; fail_at <= per_step; ++fail_at) {
      tiny.backend.arm(fail_at);
      std::string message;
      ExitCode code = ExitCode::kOk;
      try {
        tiny.step();
      } catch (const Error& error) {
        message = error.what();
        code = error.code();
      }
      INFO("allocation " << fail_at << " of " << per_step << ": " << message);
      if (code == ExitCode::kOk) {  // buffers the first step made and kept: this step needs fewer
        CHECK(tiny.backend.allocations() < fail_at);
        continue;
      }
      REQUIRE(code == ExitCode::kInternal);
      CHECK((message.rfind("model.layers.", 0) == 0 || message.rfind("the ", 0) == 0));
      CHECK(message.find(" tensor [") != std::string::npos);
      CHECK(message.find(" bytes) on the cpu: out of GPU memory (simulated)") != std::string::npos);
      in_forward += message.find(") forward: ") != std::string::npos;
      in_backward += message.find(") backward") != std::string::npos;
    }
    CHECK(in_forward > 0);
    CHECK(in_backward > 0);
  }
}
