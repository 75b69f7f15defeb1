// Block Attention Residuals in the whole model (a tiny Kimi K3: latent MoE, SiTU, gated MLA, KDA):
// LoRA gradients against central differences in double for several block sizes, with and
// without recompute (the summaries' gradients gather terms from every later layer and the final
// mix, so adapters of the first layers see all of them); recompute changes no gradient; the mix
// weights' checkpoint names and shapes; the config key's errors.
#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>

#include "catch.h"
#include "config_errors.h"
#include "core/base/error.h"
#include "core/config/config.h"
#include "core/model/model.h"
#include "core/plan/param_count.h"
#include "gradcheck.h"
#include "model_gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

ModelOptions options_of(bool recompute) {
  ModelOptions options;
  options.recompute = recompute;
  options.lora = LoraSettings{3, 6.0, false};
  options.lora_targets = {"o_proj", "g_proj", "kv_b_proj", "q_proj", "routed_expert_up_proj", "shared_experts",
                          "gate_proj"};
  return options;
}

struct Fixture : GradcheckModel {
  Fixture(int64_t block, bool recompute) : GradcheckModel(tiny_k3_config(block), options_of(recompute), 300, 5) {}
};

void check_all_parameters(Fixture& f) {
  GradCheckOptions options;
  // Small steps: with blocks of 1 a routing decision lies ~1e-5 from the base point in one
  // direction (the finite difference at eps 1e-5 jumps to -2.69 from the analytic -2.645), and a
  // step across it measures the jump, not the derivative. atol: the differences' rounding,
  // ~1e-16 * |loss ~ 3| / eps.
  options.eps = 1e-7;
  options.rtol = 1e-5;
  options.atol = 3e-8;
  options.max_elements = 5;
  f.check_all_parameters(options);
}

}  // namespace

TEST_CASE("attention residuals: LoRA gradients match finite differences (blocks of 2)", "[model][gradcheck]") {
  Fixture f(2, /*recompute=*/false);
  check_all_parameters(f);
}

TEST_CASE("attention residuals: LoRA gradients match finite differences (blocks of 1 and 3, recompute)",
          "[model][gradcheck]") {
  for (int64_t block : {1, 3}) {
    INFO("block " << block);
    Fixture f(block, /*recompute=*/true);
    check_all_parameters(f);
  }
}

TEST_CASE("attention residuals: recompute changes neither the loss nor any gradient", "[model]") {
  Fixture plain(2, false), recomputed(2, true);
  const double loss = plain.objective(), loss_recomputed = recomputed.objective();
  CHECK(loss == loss_recomputed);
  const std::vector<Tensor> a = plain.gradients(), b = recomputed.gradients();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (int64_t e = 0; e < a[i].numel(); ++e) CHECK(a[i].ptr<double>()[e] == b[i].ptr<double>()[e]);
  // logits() (forward only, keeping just the summaries) agrees with the training forward: the
  // cross-entropy of its logits, computed here, is the training step's loss.
  const Tensor logits = plain.model->logits(plain.batch);
  const int64_t vocab = 37;
  REQUIRE(logits.numel() == static_cast<int64_t>(plain.batch.input_ids.size()) * vocab);
  double loss_sum = 0.0;
  for (size_t t = 0; t < plain.batch.labels.size(); ++t) {
    const int32_t label = plain.batch.labels[t];
    if (label < 0) continue;
    const double* row = logits.ptr<double>() + static_cast<int64_t>(t) * vocab;
    const double top = *std::max_element(row, row + vocab);
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += std::exp(row[v] - top);
    loss_sum += top + std::log(total) - row[label];
  }
  CHECK(loss_sum * plain.grad_scale == Approx(loss).epsilon(1e-12));
}

TEST_CASE("attention residuals: the mix weights' checkpoint names and shapes", "[model]") {
  Fixture f(2, false);
  std::set<std::string> names;
  for (const WeightSlot& slot : f.model->weight_slots()) {
    const std::string& n = slot.name;
    if (n.find("_res_") == std::string::npos) continue;
    names.insert(n);
    const bool query = n.size() > 12 && n.substr(n.size() - 12) == "_proj.weight";
    CHECK(slot.tensor->shape() == (query ? Shape{1, 16} : Shape{16}));
  }
  CHECK(names.size() == 5 * 4 + 2);
  CHECK(names.count("model.layers.4.self_attention_res_norm.weight"));
  CHECK(names.count("model.layers.0.mlp_res_proj.weight"));
  CHECK(names.count("model.output_attn_res_norm.weight"));
  CHECK(names.count("model.output_attn_res_proj.weight"));
}

TEST_CASE("the plan counts a tiny K3's weights and adapters as the model allocates them", "[model][plan]") {
  // Latent MoE (projections, norm, experts at the latent width), the depth mixes, gated MLA, KDA:
  // moetrain plan's formulas against the tensors the model holds.
  for (int64_t block : {0, 2}) {
    INFO("block " << block);
    Config config = tiny_k3_config(block);
    config.lora.rank = 3;
    config.lora.targets = {"o_proj", "g_proj", "kv_b_proj", "q_proj", "routed_expert_up_proj",
                           "routed_expert_down_proj", "shared_experts", "experts", "gate_proj"};
    ModelSpec spec = resolve_model_spec(config);
    auto backend = kernels::make_cpu_backend();
    ModelOptions options;
    options.dtype = DType::kF64;
    options.lora = LoraSettings{3, 6.0, false};
    options.lora_targets = config.lora.targets;
    Model model(spec, *backend, options);
    int64_t weights = 0, adapters = 0;
    for (const WeightSlot& slot : model.weight_slots()) {
      // The router's F32 score bias is kept whole beside the weights; the plan counts it too.
      weights += slot.tensor->numel();
    }
    for (Parameter* p : model.parameters()) adapters += p->value.numel();
    CHECK(count_model_parameters(spec).total() == weights);
    CHECK(count_lora_parameters(spec, config.lora).total() == adapters);
  }
}

TEST_CASE("attention residuals: model.attn_res_block_size is checked", "[config]") {
  auto message = [](const std::vector<std::string>& overrides) {
    return testing::config_error(
        "model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 40\n  mla:\n    num_heads: 2\ndata:\n  seq_len: 16\n",
        "k3.yaml", overrides);
  };
  auto has = testing::contains;
  CHECK(has(message({"model.attn_res_block_size=-1"}), "model.attn_res_block_size"));
  // 40 summaries and the running sum: more values than a mix takes.
  CHECK(has(message({"model.attn_res_block_size=1"}), "more than 31 residual blocks"));
  CHECK(message({"model.attn_res_block_size=2"}).empty());
}
