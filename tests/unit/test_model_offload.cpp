// parallel.offload: the layer inputs wait for the backward in (page-locked) host memory. On the CPU
// backend the host copy is a plain copy and the "device" buffer is freed and re-allocated as on
// CUDA (LayerCheckpoints), so training must be bit for bit what it is without offload, with
// recompute on, off or partial, and with Block Attention Residuals (whose block summaries stay).
#include <memory>
#include <string>

#include "catch.h"
#include "core/config/config.h"
#include "core/model/layer_checkpoints.h"
#include "core/model/model.h"
#include "tests/support/offload_steps.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ModelOptions options_for(const Config& config, bool recompute, int64_t recompute_layers, bool offload) {
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = all_lora_targets(config.model.mla.q_lora_rank.has_value());
  options.recompute = recompute;
  options.recompute_layers = recompute_layers;
  options.offload = offload;
  return options;
}

void check_same_training(const Config& config, bool recompute, int64_t recompute_layers) {
  std::unique_ptr<kernels::Backend> cpu = kernels::make_cpu_backend();
  const ModelSpec spec = resolve_model_spec(config);
  const Batch batch = tiny_batch(config.model.vocab_size, 3);
  const OffloadRun kept = run_offload_steps(*cpu, spec, options_for(config, recompute, recompute_layers, false), batch, 3);
  const OffloadRun offloaded = run_offload_steps(*cpu, spec, options_for(config, recompute, recompute_layers, true), batch, 3);
  REQUIRE(kept.losses.size() == 3);
  CHECK(kept.losses[2] != kept.losses[0]);  // the steps move the adapters: later steps differ
  CHECK(offloaded.losses == kept.losses);
  CHECK(offloaded.gradients == kept.gradients);
  CHECK(offloaded.adapters == kept.adapters);
}

}  // namespace

TEST_CASE("offload: training is bit for bit the same (MLA, KDA, DSA, MoE), recompute on", "[model]") {
  check_same_training(tiny_model_config(true), true, -1);
}

TEST_CASE("offload: recompute off or partial offloads the inputs all the same, nothing changes", "[model]") {
  check_same_training(tiny_model_config(true), false, -1);
  check_same_training(tiny_model_config(true), true, 1);
}

TEST_CASE("offload: with Block Attention Residuals the block summaries stay and nothing changes", "[model]") {
  check_same_training(tiny_k3_config(2), true, -1);
}

TEST_CASE("LayerCheckpoints: inputs come back intact, host copies only with offload", "[model]") {
  std::unique_ptr<kernels::Backend> cpu = kernels::make_cpu_backend();
  const BatchTensors no_batch;
  const LayerContext ctx{*cpu, DType::kF32, no_batch};
  for (bool offload : {false, true}) {
    LayerCheckpoints checkpoints(*cpu, offload);
    checkpoints.begin(4);
    for (size_t i = 0; i < 4; ++i) {
      Tensor input = ctx.alloc({3, 2});
      cpu->fill(input, static_cast<double>(i) + 0.5);
      checkpoints.keep(i, std::move(input));
    }
    CHECK(checkpoints.host_bytes() == (offload ? 4u * 6u * sizeof(float) : 0u));
    for (size_t i = 4; i-- > 0;) {
      const Tensor input = checkpoints.take(ctx, i);
      if (i > 0) checkpoints.prefetch(ctx, i - 1);
      REQUIRE(input.shape() == Shape({3, 2}));
      for (int64_t k = 0; k < 6; ++k) CHECK(input.ptr<float>()[k] == static_cast<float>(i) + 0.5f);
    }
  }
}

TEST_CASE("parallel.offload: off by default, read from the config into the model's options", "[model][config]") {
  const std::string yaml =
      "model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n  mla:\n    num_heads: 2\n"
      "  moe:\n    num_experts: 4\n    top_k: 2\ndata:\n  seq_len: 16\n";
  CHECK_FALSE(parse_config(yaml, "tiny.yaml").parallel.offload);
  CHECK_FALSE(model_options_for(parse_config(yaml, "tiny.yaml")).offload);
  const Config on = parse_config(yaml, "tiny.yaml", {"parallel.offload=true", "parallel.recompute=false"});
  CHECK(on.parallel.offload);
  CHECK(model_options_for(on).offload);
}
