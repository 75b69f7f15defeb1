// Kimi K3's feed-forward in the whole model: latent MoE (routing on the full hidden state,
// experts in the latent width, optional latent RMSNorm, up-projection, shared experts at full
// width) with SiTU in every MLP. LoRA gradients against central differences in double; the
// latent projections' names and shapes; the forward's order against the plain MoE; the config
// keys' errors.
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "catch.h"
#include "config_errors.h"
#include "core/base/error.h"
#include "core/model/latent_moe.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "model_gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

Config config_of(bool latent_norm, double aux_coef) {
  Config config = tiny_k3_ffn_config(latent_norm);
  config.model.moe.aux_loss_coef = aux_coef;
  return config;
}

ModelOptions options_of(bool recompute) {
  ModelOptions options;
  options.recompute = recompute;
  options.lora = LoraSettings{3, 6.0, false};
  options.lora_targets = {"routed_expert_down_proj", "routed_expert_up_proj", "experts", "shared_experts",
                          "gate_proj", "up_proj", "down_proj", "o_proj"};
  return options;
}

struct Fixture : GradcheckModel {
  Fixture(bool latent_norm, double aux_coef, bool recompute)
      : GradcheckModel(config_of(latent_norm, aux_coef), options_of(recompute), 200, 5) {}
};

}  // namespace

TEST_CASE("latent MoE + SiTU: LoRA gradients match finite differences (latent norm)", "[model][gradcheck]") {
  Fixture f(/*latent_norm=*/true, /*aux_coef=*/0.0, /*recompute=*/false);
  // Layer 0: MLA o_proj + dense 3. Layers 1 (KDA) and 2 (MLA): o_proj (1 each), shared 3,
  // experts 3, latent down + up 2.
  REQUIRE(f.model->parameters().size() == 2 * ((1 + 3) + 2 * (1 + 3 + 3 + 2)));
  std::set<std::string> names;
  for (Parameter* p : f.model->parameters()) names.insert(p->name);
  CHECK(names.count("model.layers.1.mlp.routed_expert_down_proj.lora_A.weight"));
  CHECK(names.count("model.layers.2.mlp.routed_expert_up_proj.lora_B.weight"));
  f.check_all_parameters();
}

TEST_CASE("latent MoE + SiTU: LoRA gradients match finite differences (no norm, aux loss, recompute)",
          "[model][gradcheck]") {
  Fixture f(/*latent_norm=*/false, /*aux_coef=*/0.01, /*recompute=*/true);
  f.check_all_parameters();
}

TEST_CASE("latent MoE weights: HF names and shapes, the experts at the latent width", "[model]") {
  for (bool latent_norm : {true, false}) {
    Fixture f(latent_norm, 0.0, false);
    // Plain weights by name; a SwiGLU module's gate_up and down share its name, so by layout.
    std::map<std::string, Shape> shapes;
    for (const WeightSlot& slot : f.model->weight_slots()) {
      const char* suffix = slot.layout == WeightLayout::kSwigluGateUp ? "#gate_up"
                           : slot.layout == WeightLayout::kSwigluDown ? "#down"
                                                                       : "";
      shapes[slot.name + suffix] = slot.tensor->shape();
    }
    CHECK(shapes.at("model.layers.1.mlp.routed_expert_down_proj.weight") == Shape{6, 16});
    CHECK(shapes.at("model.layers.1.mlp.routed_expert_up_proj.weight") == Shape{16, 6});
    CHECK(shapes.count("model.layers.1.mlp.routed_expert_norm.weight") == (latent_norm ? 1u : 0u));
    CHECK(shapes.at("model.layers.1.mlp.gate.weight") == Shape{6, 16});  // the router reads D
    CHECK(shapes.at("model.layers.1.mlp.experts#gate_up") == Shape{6, 16, 6});  // [E, 2F, L]
    CHECK(shapes.at("model.layers.1.mlp.experts#down") == Shape{6, 6, 8});      // [E, L, F]
    CHECK(shapes.at("model.layers.1.mlp.shared_experts#gate_up") == Shape{1, 16, 16});  // [1, 2F, D]
    CHECK(shapes.count("model.layers.0.mlp.routed_expert_down_proj.weight") == 0);  // dense layer
  }
}

TEST_CASE("latent MoE forward: route on x, experts on the projection, norm on the sum, shared on x", "[model]") {
  // L = D, down = 2 I, up = 3 I. The latent experts (gate_up halved) on z = 2x then compute what
  // the plain MoE's experts compute on x, so with the same router and shared experts
  //   latent(x) = 3 RMSNorm(routed(x)) + shared(x),
  // routed(x) the plain MoE's weighted expert sum. Routing on z instead (doubled logits), the
  // norm on z, or the shared experts on z or after the up-projection would all differ.
  auto backend = kernels::make_cpu_backend();
  Config plain_config = tiny_k3_ffn_config(/*latent_norm=*/true);
  plain_config.model.moe.latent_size = 0;
  plain_config.model.moe.use_latent_norm = false;
  Config latent_config = tiny_k3_ffn_config(/*latent_norm=*/true);
  const int64_t d = latent_config.model.hidden_size, n = 7;
  latent_config.model.moe.latent_size = d;
  BatchTensors batch;
  batch.num_tokens = n;
  batch.seq_len = n;
  LayerContext ctx{*backend, DType::kF64, batch};
  ModelSpec plain_spec = resolve_model_spec(plain_config), latent_spec = resolve_model_spec(latent_config);
  MoeFfn plain(plain_spec, 1, ctx, nullptr);
  LatentMoeFfn latent(latent_spec, 1, ctx, nullptr);
  REQUIRE(plain.shared);
  REQUIRE(latent.moe.shared);

  uint64_t seed = 900;
  for (Tensor* t : {&plain.router_weight, &plain.score_bias, &plain.experts.gate_up, &plain.experts.down,
                    &plain.shared->mlp.gate_up, &plain.shared->mlp.down, &latent.norm}) {
    fill_random(*t, seed++, 0.1, 1.0);
  }
  backend->copy(latent.moe.router_weight, plain.router_weight);
  backend->copy(latent.moe.score_bias, plain.score_bias);
  backend->axpby(latent.moe.experts.gate_up, plain.experts.gate_up, 0.5, 0.0);  // = 0.5 plain
  backend->copy(latent.moe.experts.down, plain.experts.down);
  backend->copy(latent.moe.shared->mlp.gate_up, plain.shared->mlp.gate_up);
  backend->copy(latent.moe.shared->mlp.down, plain.shared->mlp.down);
  backend->fill(latent.down_proj.weight, 0.0);
  backend->fill(latent.up_proj.weight, 0.0);
  for (int64_t i = 0; i < d; ++i) {
    set_element(latent.down_proj.weight, i * d + i, 2.0);
    set_element(latent.up_proj.weight, i * d + i, 3.0);
  }

  Tensor x = random_tensor({n, d}, DType::kF64, 901, 0.1, 2.0);
  Tensor routed({n, d}, DType::kF64), shared({n, d}, DType::kF64), out({n, d}, DType::kF64);
  plain.forward_routed(ctx, routed, x, x);
  plain.shared->forward(ctx, shared, x);
  latent.forward(ctx, out, x);
  const double eps = latent_config.model.rms_norm_eps;
  for (int64_t t = 0; t < n; ++t) {
    double sum_sq = 0.0;
    for (int64_t j = 0; j < d; ++j) sum_sq += get_element(routed, t * d + j) * get_element(routed, t * d + j);
    const double rstd = 1.0 / std::sqrt(sum_sq / static_cast<double>(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      const double expected = 3.0 * get_element(routed, t * d + j) * rstd * get_element(latent.norm, j) +
                              get_element(shared, t * d + j);
      CHECK(get_element(out, t * d + j) == Approx(expected).epsilon(1e-12).margin(1e-12));
    }
  }
}

TEST_CASE("latent MoE and SiTU config keys are checked", "[config]") {
  auto message = [](const std::vector<std::string>& overrides) {
    return testing::config_error(
        "model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n  mla:\n    num_heads: 2\n  moe:\n"
        "    num_experts: 4\n    top_k: 2\ndata:\n  seq_len: 16\n",
        "k3.yaml", overrides);
  };
  auto has = testing::contains;
  CHECK(has(message({"model.hidden_act=gelu"}), "model.hidden_act"));
  CHECK(has(message({"model.situ_beta=0"}), "model.situ_beta"));
  CHECK(has(message({"model.situ_linear_beta=-1"}), "model.situ_linear_beta"));
  CHECK(has(message({"model.moe.latent_size=-2"}), "model.moe.latent_size"));
  const std::string norm_alone = message({"model.moe.use_latent_norm=true"});
  CHECK(has(norm_alone, "model.moe.use_latent_norm"));
  CHECK(has(norm_alone, "model.moe.latent_size"));
  CHECK(has(message({"model.moe.latent_dim=8"}), "latent_size"));  // unknown key: did you mean
  Config ok = parse_config(
      "model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n  hidden_act: situ\n  situ_beta: 4.0\n  situ_linear_beta: 25.0\n  moe:\n    latent_size: 8\n"
      "    use_latent_norm: true\n",
      "k3.yaml", {});
  CHECK(ok.model.hidden_act == "situ");
  CHECK(ok.model.situ_linear_beta == 25.0);
  CHECK(ok.model.moe.latent_size == 8);
  CHECK(ok.model.moe.use_latent_norm);
}
