// An allocation that fails inside a training step (as the CUDA allocator does when the GPU is
// full) ends the step with an Error that names the layer, the pass and the tensor in front of the
// allocator's own account, and keeps that error's exit code.
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/model.h"
#include "kernels/ops.h"
#include "tests/support/counting_backend.h"
#include "tests/support/gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

TEST_CASE("an allocation failing inside a training step names the layer, the pass and the tensor", "[model]") {
  for (bool recompute : {false, true}) {
    INFO((recompute ? "recompute on" : "recompute off"));
    Config config = tiny_model_config(true);
    ModelOptions options;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = all_lora_targets(true);
    options.recompute = recompute;
    const Batch batch = tiny_batch(config.model.vocab_size, 3);
    const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());

    auto cpu = kernels::make_cpu_backend();
    CountingBackend backend(*cpu);
    Model model(resolve_model_spec(config), backend, options);
    model.init_random_weights();
    backend.arm(-1);
    model.forward_backward(batch, grad_scale);
    const int64_t per_step = backend.allocations();
    REQUIRE(per_step > 20);

    // Every allocation of the step in turn: each failure names the part of the step, the tensor
    // and the allocator's own message, with its exit code; layers' forwards and backwards among them.
    int in_forward = 0, in_backward = 0;
    for (int64_t fail_at = 1; fail_at <= per_step; ++fail_at) {
      backend.arm(fail_at);
      std::string message;
      ExitCode code = ExitCode::kOk;
      try {
        model.forward_backward(batch, grad_scale);
      } catch (const Error& error) {
        message = error.what();
        code = error.code();
      }
      INFO("allocation " << fail_at << " of " << per_step << ": " << message);
      if (code == ExitCode::kOk) {  // buffers the first step made and kept: this step needs fewer
        CHECK(backend.allocations() < fail_at);
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
