// The expert load a real model reports, through the trainer, into metrics.jsonl: one value per
// MoE layer in `expert_load_max` and `expert_load_min`. A router biased to send every token to
// the same top_k experts gives the loads that imbalance must have (E / top_k on the busy
// experts, 0 on the idle ones); the unbiased layers give plausible loads that are token counts
// over the mean (a multiple of E / (tokens x top_k)).
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "core/train/metrics.h"
#include "core/data/synthetic_data.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// Every token's selection goes to experts 0 .. top_k - 1 of this MoE layer (the score bias
// steers the choice only).
void bias_router_to_first_experts(Model& model, kernels::Backend& backend, const std::string& layer_prefix,
                                  int64_t experts, int64_t top_k) {
  const std::string name = layer_prefix + ".mlp.gate.e_score_correction_bias";
  for (const WeightSlot& slot : model.weight_slots()) {
    if (slot.name != name) continue;
    REQUIRE(slot.tensor->dtype() == DType::kF32);
    Tensor bias({experts}, DType::kF32);
    for (int64_t e = 0; e < experts; ++e) bias.ptr<float>()[e] = e < top_k ? 100.0f : 0.0f;
    backend.copy(*slot.tensor, bias);
    return;
  }
  FAIL("no weight named " << name);
}

}  // namespace

TEST_CASE("metrics.jsonl holds each MoE layer's max and min expert load") {
  Config config = testing::tiny_model_config(/*q_lora=*/false);
  ModelConfig& m = config.model;
  m.num_layers = 4;
  m.layers = {"mla", "mla", "mla", "mla"};
  m.first_k_dense = 1;  // layers 1, 2, 3 are MoE
  m.moe.num_groups = 1;
  m.moe.topk_groups = 1;
  m.moe.score_correction_bias = true;
  const ModelSpec spec = resolve_model_spec(config);
  int64_t moe_layers = 0;
  for (FfnKind kind : spec.ffns) moe_layers += kind == FfnKind::kMoe ? 1 : 0;
  REQUIRE(moe_layers == 3);
  const int64_t experts = m.moe.num_experts, top_k = m.moe.top_k;

  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = {"o_proj", "experts"};
  Model model(spec, *backend, options);
  model.init_random_weights();
  bias_router_to_first_experts(model, *backend, "model.layers.2", experts, top_k);  // the second MoE layer

  TrainerOptions trainer_options;
  trainer_options.train.steps = 3;
  trainer_options.train.lr = 1e-3;
  trainer_options.data.seq_len = 8;
  trainer_options.data.micro_batch = 2;
  trainer_options.data.grad_accum = 2;
  trainer_options.logging.every = 1000;
  trainer_options.loss_floor = 1.25;
  SyntheticData data(trainer_options.data, m.vocab_size);
  const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  const auto dir = std::filesystem::temp_directory_path() / ("moetrain_test_expert_load_" + std::to_string(stamp));
  {
    MetricsWriter writer(dir.string());
    Trainer trainer(trainer_options, model, [&data] { return data.next(); }, &writer);
    trainer.run();
  }
  const std::vector<nlohmann::json> lines = read_jsonl(dir / "metrics.jsonl");
  std::filesystem::remove_all(dir);
  REQUIRE(lines.size() == 3);

  // One load is count x E / (tokens x top_k): a multiple of this step.
  const double quantum = static_cast<double>(experts) / static_cast<double>(2 * 8 * top_k);
  for (const nlohmann::json& line : lines) {
    INFO(line.dump());
    CHECK(line.at("loss_floor").get<double>() == 1.25);
    const auto max_load = line.at("expert_load_max").get<std::vector<double>>();
    const auto min_load = line.at("expert_load_min").get<std::vector<double>>();
    REQUIRE(max_load.size() == static_cast<size_t>(moe_layers));
    REQUIRE(min_load.size() == static_cast<size_t>(moe_layers));
    double max_over_layers = 0.0;
    for (size_t layer = 0; layer < max_load.size(); ++layer) {
      // The mean load is 1, so the busiest expert is at least that and the idlest at most.
      CHECK(max_load[layer] >= 1.0);
      CHECK(min_load[layer] <= 1.0);
      CHECK(min_load[layer] >= 0.0);
      CHECK(max_load[layer] <= static_cast<double>(experts) / static_cast<double>(top_k));
      for (double load : {max_load[layer], min_load[layer]}) {
        CHECK(std::abs(load / quantum - std::round(load / quantum)) < 1e-9);
      }
      max_over_layers = std::max(max_over_layers, max_load[layer]);
    }
    CHECK(line.at("max_expert_load").get<double>() == max_over_layers);
    // The biased layer: top_k experts take every token, the other experts none.
    CHECK(max_load[1] == static_cast<double>(experts) / static_cast<double>(top_k));
    CHECK(min_load[1] == 0.0);
  }
}

}  // namespace moetrain
