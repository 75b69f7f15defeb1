// The experts' balance the trainer writes into metrics.jsonl (expert_rows_min / _median / _max /
// _max_over_mean per MoE layer) against an independent count: a tiny model whose first layer is
// MoE and whose attention output projection is zero, so that layer's router sees
// rmsnorm(embedding[token]) and the host can route every token itself (sigmoid scores, the
// selection bias, top-k). One step of two micro-batches in one expert window: one grouped GEMM
// call per layer, whose rows are both micro-batches' tokens.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "core/train/metrics.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

// Rows per expert that layer 0 routes for `batch`, computed on the host.
std::vector<int64_t> route_on_host(const std::map<std::string, Tensor>& w, const ModelConfig& m, const Batch& batch) {
  const Tensor& embed = w.at("model.embed_tokens.weight");
  const Tensor& norm = w.at("model.layers.0.post_attention_layernorm.weight");
  const Tensor& router = w.at("model.layers.0.mlp.gate.weight");
  const Tensor& bias = w.at("model.layers.0.mlp.gate.e_score_correction_bias");
  const int64_t d = m.hidden_size, e = m.moe.num_experts;
  std::vector<int64_t> rows(static_cast<size_t>(e), 0);
  for (int32_t token : batch.input_ids) {
    const double* x = embed.ptr<double>() + static_cast<int64_t>(token) * d;
    double squares = 0.0;
    for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
    const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(d) + m.rms_norm_eps);
    std::vector<std::pair<double, int64_t>> choice;
    for (int64_t j = 0; j < e; ++j) {
      double logit = 0.0;
      for (int64_t i = 0; i < d; ++i) logit += x[i] * rstd * norm.ptr<double>()[i] * router.ptr<double>()[j * d + i];
      choice.push_back({1.0 / (1.0 + std::exp(-logit)) + bias.ptr<double>()[j], j});
    }
    std::sort(choice.begin(), choice.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int64_t k = 0; k < m.moe.top_k; ++k) ++rows[static_cast<size_t>(choice[static_cast<size_t>(k)].second)];
  }
  return rows;
}

}  // namespace

TEST_CASE("metrics.jsonl's rows per expert match the routing counted on the host", "[metrics][expert_rows]") {
  Config config = testing::tiny_model_config(/*q_lora=*/false);
  ModelConfig& m = config.model;
  m.first_k_dense = 0;  // layer 0 is MoE
  m.moe.num_experts = 8;
  m.moe.top_k = 3;
  m.moe.num_groups = 1;
  m.moe.topk_groups = 1;
  const ModelSpec spec = resolve_model_spec(config);
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = {"o_proj", "experts"};
  Model model(spec, *backend, options);
  model.init_random_weights();
  for (const WeightSlot& slot : model.weight_slots()) {
    if (slot.name == "model.layers.0.self_attn.o_proj.weight") backend->fill(*slot.tensor, 0.0);
  }
  std::map<std::string, Tensor> weights;
  for (const WeightSlot& slot : model.weight_slots()) {
    if (!slot.tensor->defined()) continue;
    Tensor host(slot.tensor->shape(), DType::kF64);
    backend->copy(host, *slot.tensor);
    weights.emplace(slot.name, std::move(host));
  }

  const std::vector<Batch> batches = {testing::tiny_batch(m.vocab_size, 5), testing::tiny_batch(m.vocab_size, 6)};
  std::vector<int64_t> expected(static_cast<size_t>(m.moe.num_experts), 0);
  for (const Batch& batch : batches) {
    const std::vector<int64_t> rows = route_on_host(weights, m, batch);
    for (size_t j = 0; j < rows.size(); ++j) expected[j] += rows[j];
  }
  REQUIRE(std::accumulate(expected.begin(), expected.end(), int64_t{0}) == 2 * 16 * m.moe.top_k);
  std::vector<int64_t> sorted = expected;
  std::sort(sorted.begin(), sorted.end());
  const double mean = 2.0 * 16 * static_cast<double>(m.moe.top_k) / static_cast<double>(m.moe.num_experts);

  TrainerOptions trainer_options;
  trainer_options.train.steps = 1;
  trainer_options.train.expert_window = 2;
  trainer_options.data.seq_len = 8;
  trainer_options.data.micro_batch = 2;
  trainer_options.data.grad_accum = 2;
  trainer_options.logging.every = 1000;
  size_t next = 0;
  const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  const auto dir = std::filesystem::temp_directory_path() / ("moetrain_test_expert_rows_" + std::to_string(stamp));
  {
    MetricsWriter writer(dir.string());
    Trainer trainer(trainer_options, model, [&] { return batches.at(next++); }, &writer);
    trainer.run();
  }
  std::ifstream in(dir / "metrics.jsonl");
  std::string text;
  std::getline(in, text);
  std::filesystem::remove_all(dir);
  const nlohmann::json line = nlohmann::json::parse(text);
  INFO(line.dump());
  const auto min = line.at("expert_rows_min").get<std::vector<double>>();
  const auto median = line.at("expert_rows_median").get<std::vector<double>>();
  const auto max = line.at("expert_rows_max").get<std::vector<double>>();
  const auto ratio = line.at("expert_rows_max_over_mean").get<std::vector<double>>();
  REQUIRE(min.size() == 3);  // every layer is MoE (first_k_dense 0)
  // Layer 0, one call: the window's rows.
  CHECK(min[0] == static_cast<double>(sorted.front()));
  CHECK(max[0] == static_cast<double>(sorted.back()));
  CHECK(median[0] == static_cast<double>(sorted[3] + sorted[4]) / 2.0);
  CHECK(ratio[0] == Approx(static_cast<double>(sorted.back()) / mean).epsilon(1e-12));
  for (size_t layer = 1; layer < min.size(); ++layer) {  // the other layers: consistent, and every row counted
    CHECK(min[layer] <= median[layer]);
    CHECK(median[layer] <= max[layer]);
    CHECK(max[layer] >= mean);
  }
}

TEST_CASE("expert_row_histogram: rows per call, the median of an even count the middle two's mean",
          "[metrics][expert_rows]") {
  const ExpertRowHistogram h = expert_row_histogram({6, 0, 10, 4}, 2);
  CHECK(h.min == 0.0);
  CHECK(h.median == 2.5);
  CHECK(h.max == 5.0);
  CHECK(h.mean == 2.5);
  CHECK(h.max_over_mean() == 2.0);
  const ExpertRowHistogram odd = expert_row_histogram({3, 9, 1}, 1);
  CHECK(odd.median == 3.0);
}

}  // namespace moetrain
