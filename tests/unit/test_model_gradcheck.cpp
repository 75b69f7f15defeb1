// The whole model's LoRA gradients against central differences in double: every adapter of
// every layer kind (MLA with and without q LoRA, KDA in Kimi-Linear's and Kimi K3's forms, DSA,
// dense MLP, routed experts, shared experts), through routing weights, RoPE with YaRN, the KDA
// recurrence, DSA's selected keys, packed documents and the masked loss.
#include <memory>

#include "catch.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "model_gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// k3_kda: the KDA layer in Kimi K3's form (fused qkv, full-rank output gate, bounded decay).
Config config_of(bool q_lora, double aux_coef, bool k3_kda) {
  Config config = tiny_model_config(q_lora);
  config.model.moe.aux_loss_coef = aux_coef;
  if (k3_kda) {
    config.model.kda.fused_qkv = true;
    config.model.kda.full_rank_output_gate = true;
    config.model.kda.lower_bound = -5.0;
  }
  return config;
}

ModelOptions options_of(bool q_lora, bool recompute, bool k3_kda, int64_t recompute_layers) {
  ModelOptions options;
  options.recompute = recompute;
  options.recompute_layers = recompute_layers;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = k3_kda ? std::vector<std::string>{"qkv_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj",
                                                           "o_proj", "kv_b_proj", "experts"}
                                : all_lora_targets(q_lora);
  return options;
}

struct Fixture : GradcheckModel {
  Fixture(bool q_lora, double aux_coef, bool recompute, bool k3_kda = false, int64_t recompute_layers = -1)
      : GradcheckModel(config_of(q_lora, aux_coef, k3_kda), options_of(q_lora, recompute, k3_kda, recompute_layers),
                       100, 3) {}
};

}  // namespace

TEST_CASE("model LoRA gradients match finite differences (q LoRA, YaRN, DSA, MoE)", "[model][gradcheck]") {
  Fixture f(/*q_lora=*/true, /*aux_coef=*/0.0, /*recompute=*/false);
  // Adapters: layer 0 MLA 5 + dense 3; layer 1 KDA 9 (q, k, v, f_a, f_b, b, g_a, g_b, o) + shared 3 +
  // experts 3; layer 2 DSA 5 (MLA's projections; its indexer is frozen) + shared 3 + experts 3.
  REQUIRE(f.model->parameters().size() == 2 * (5 + 3 + (9 + 3 + 3) + (5 + 3 + 3)));
  f.check_all_parameters();
}

TEST_CASE("model LoRA gradients match finite differences (KDA as in Kimi K3)", "[model][gradcheck]") {
  Fixture f(/*q_lora=*/false, /*aux_coef=*/0.0, /*recompute=*/true, /*k3_kda=*/true);
  // KDA: qkv_proj, f_a, f_b, b, g_proj, o; MLA: kv_b, o (twice); experts 3 in two MoE layers.
  REQUIRE(f.model->parameters().size() == 2 * (6 + 2 * 2 + 2 * 3));
  f.check_all_parameters();
}

TEST_CASE("model LoRA gradients match finite differences (no q LoRA, aux loss, recompute)", "[model][gradcheck]") {
  Fixture f(/*q_lora=*/false, /*aux_coef=*/0.01, /*recompute=*/true);
  f.check_all_parameters();
}

TEST_CASE("recompute gives the same loss and gradients as keeping activations", "[model]") {
  Fixture keep(true, 0.01, false);
  const double loss = keep.objective();
  const std::vector<Tensor> a = keep.gradients();
  // Every layer re-run, and the first one or two of the three (parallel.recompute_layers).
  for (int64_t layers : {-1, 1, 2}) {
    INFO("recompute_layers " << layers);
    Fixture again(true, 0.01, true, false, layers);
    CHECK(again.objective() == loss);
    const std::vector<Tensor> b = again.gradients();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      Comparison c = compare_tensors(a[i], b[i], 0.0, 0.0, keep.model->parameters()[i]->name);
      INFO(c.message);
      CHECK(c.ok);
    }
  }
}
