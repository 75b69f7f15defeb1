// ModelFlops (the MFU numerator, docs/PERF.md) worked out by hand on the tiny config, and its
// adapter count checked against the parameters a built Model really trains.
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "core/plan/model_flops.h"
#include "core/plan/param_count.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;

TEST_CASE("step FLOPs of the tiny model by hand") {
  // hidden 16, vocab 37, layers MLA (2 heads, qk 6 + 4, v 5, kv rank 8, no q LoRA), KDA (2 heads
  // of 4), MLA; dense first (width 24), then MoE: 6 experts of width 8, top 2, one shared.
  Config config = testing::tiny_model_config(false);
  config.lora.rank = 4;
  config.lora.targets = {"o_proj", "experts"};
  ModelFlops flops(plan_model_spec(config.model), config.lora);

  // MLA: q 16*2*10 + kv_a 16*(8+4) + kv_b 8*2*(6+5) + o 2*5*16 = 848 per layer; KDA: q/k/v
  // 3*16*8, f_a 16*4 + f_b 4*8, b 16*2, g_a 16*4 + g_b 4*8, o 8*16 = 736; dense MLP 3*16*24 =
  // 1152; MoE: (top 2 + 1 shared) x 3*16*8 + router 16*6 = 1248; head 37*16 = 592.
  CHECK(flops.frozen_weights_per_token() == 592 + 2 * 848 + 736 + 1152 + 2 * 1248);
  // o_proj 4*(10+16) on the MLA layers, 4*(8+16) on the KDA layer; a routed expert's 3 adapters
  // 3 * 4*(16+8) = 288, for the 2 experts a token visits, on 2 MoE layers.
  CHECK(flops.lora_weights_per_token() == 2 * 104 + 96 + 2 * 2 * 288);

  // 8 tokens in segments of 3 and 5: 6 + 15 causal pairs; 2 (10 + 5) x 2 heads per pair per MLA
  // layer. KDA's recurrence: 6 d^2 per head per token forward, 2 heads of 4: 192, 3x with backward.
  StepFlops step = flops.step(8, {0, 3, 8});
  CHECK(step.frozen == 4.0 * 6672 * 8);
  CHECK(step.lora == 6.0 * 1456 * 8);
  CHECK(step.attention == 3.5 * (60 * 2) * 21 + 3.0 * 192 * 8);
  CHECK(step.total() == step.frozen + step.lora + step.attention);
}

TEST_CASE("the adapter FLOPs follow the parameters a built model trains") {
  Config config = testing::tiny_model_config(true);
  config.lora.rank = 3;
  config.lora.targets = testing::all_lora_targets(true);
  ModelSpec spec = resolve_model_spec(config);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.lora = LoraSettings{config.lora.rank, config.lora.alpha, config.lora.rslora};
  options.lora_targets = config.lora.targets;
  Model model(spec, *backend, options);
  double per_token = 0.0;
  for (Parameter* p : model.parameters()) {
    const Shape& shape = p->value.shape();
    // A stacked routed-expert adapter [experts, ...]: a token uses top_k of the experts.
    per_token += shape.ndim() == 3 ? static_cast<double>(p->value.numel()) / static_cast<double>(shape[0]) *
                                         static_cast<double>(spec.config.moe.top_k)
                                   : static_cast<double>(p->value.numel());
  }
  CHECK(ModelFlops(spec, config.lora).lora_weights_per_token() == per_token);
}
