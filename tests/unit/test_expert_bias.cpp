// Aux-loss-free balancing (model.moe.bias_update_rate): after each optimizer step every MoE
// layer's selection bias moves by rate * sign(mean - rows of the expert), the rows counted over
// the whole step. With the router's weight zeroed, every token's selection is the top-k of the
// bias alone, so the step's rows are known by hand: tokens x micro-batches for the chosen
// experts, 0 for the rest. A resumed run equals an uninterrupted one bit for bit, bias included.
#include <filesystem>
#include <memory>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/model/model.h"
#include "adapter_testing.h"
#include "tiny_model.h"
#include "training_run.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

constexpr double kRate = 0.125;  // a power of two: the biases below stay exact

Config bias_run_config(const std::string& name, int64_t steps) {
  Config c = testing::short_lora_run_config(steps);
  c.model.moe.bias_update_rate = kRate;
  fs::path dir = fs::temp_directory_path() / ("moetrain_test_expert_bias_" + name);
  fs::remove_all(dir);
  c.logging.run_dir = dir.string();
  c.checkpoint.every = 2;
  c.checkpoint.export_adapter = "false";
  return c;
}

std::vector<double> host_values(const Tensor& t) {
  Tensor host(t.shape(), DType::kF64);
  convert_host(host.view(), t.view());
  return std::vector<double>(host.ptr<double>(), host.ptr<double>() + host.numel());
}

// Every layer's score bias, in layer order.
std::vector<std::vector<double>> biases(TrainableModel& model) {
  std::vector<std::vector<double>> out;
  for (const TrainedBuffer& b : model.trained_buffers()) out.push_back(host_values(*b.value));
  return out;
}

// The router's weight zeroed and each layer's bias set to `bias`: every token selects the top-k
// experts of `bias` (within the group the bias alone picks).
void route_by_bias(Model& model, const std::vector<double>& bias) {
  for (const WeightSlot& slot : model.weight_slots()) {
    if (slot.name.find(".mlp.gate.weight") != std::string::npos) {
      model.backend().fill(*slot.tensor, 0.0);
    } else if (slot.name.find("e_score_correction_bias") != std::string::npos) {
      Tensor host({static_cast<int64_t>(bias.size())}, DType::kF64);
      std::copy(bias.begin(), bias.end(), host.ptr<double>());
      Tensor stored(slot.tensor->shape(), slot.tensor->dtype());
      convert_host(stored.view(), host.view());
      model.backend().copy(*slot.tensor, stored);
    }
  }
}

// Forwards to a Model and keeps the rows each bias update got.
class RowsSpy final : public TrainableModel {
 public:
  explicit RowsSpy(Model& model) : model_(model) {}
  std::vector<Parameter*> parameters() override { return model_.parameters(); }
  StepResult forward_backward(const Batch& batch, double grad_scale) override {
    return model_.forward_backward(batch, grad_scale);
  }
  PendingStep forward_backward_window_async(const std::vector<const Batch*>& window, double grad_scale) override {
    return model_.forward_backward_window_async(window, grad_scale);
  }
  void hold_parameters(bool hold) override { model_.hold_parameters(hold); }
  kernels::Backend& backend() override { return model_.backend(); }
  std::vector<ParameterGroup*> parameter_groups() override { return model_.parameter_groups(); }
  void update_expert_bias(const std::vector<std::vector<int64_t>>& step_rows) override {
    rows.push_back(step_rows);
    model_.update_expert_bias(step_rows);
  }
  std::vector<TrainedBuffer> trained_buffers() override { return model_.trained_buffers(); }

  std::vector<std::vector<std::vector<int64_t>>> rows;  // per update, per layer, per expert

 private:
  Model& model_;
};

// One step of grad_accum micro-batches (in windows of `window`) routed by the bias: the rows
// counted by hand, and the bias moved by the rule.
void check_one_step(int64_t grad_accum, int64_t window) {
  Config c = bias_run_config("step", 1);
  c.data.grad_accum = grad_accum;
  c.train.expert_window = window;
  testing::TrainingRun run(c);
  const std::vector<double> bias = {0.5, 0.375, 0.0, 0.125, 0.25, 0.25};  // experts 0 and 1 win
  route_by_bias(*run.model, bias);
  RowsSpy spy(*run.model);
  Trainer trainer(testing::trainer_options_for(c), spy, [&run] { return run.data->next(); });
  trainer.train_step();

  const int64_t tokens = grad_accum * c.data.micro_batch * c.data.seq_len;
  REQUIRE(spy.rows.size() == 1);
  REQUIRE(spy.rows[0].size() == 2);  // the tiny model's two MoE layers
  const std::vector<int64_t> expected_rows = {tokens, tokens, 0, 0, 0, 0};
  // mean rows = 2 tokens / 6: experts 0 and 1 are above it and step down, the rest step up.
  const std::vector<double> expected_bias = {0.5 - kRate, 0.375 - kRate, kRate, 0.125 + kRate, 0.25 + kRate,
                                             0.25 + kRate};
  for (const std::vector<int64_t>& layer : spy.rows[0]) CHECK(layer == expected_rows);
  for (const std::vector<double>& layer : biases(*run.model)) CHECK(layer == expected_bias);
}

}  // namespace

TEST_CASE("bias update: one micro-batch, rows counted by hand, the rule applied") { check_one_step(1, 1); }

TEST_CASE("bias update: the rows of every micro-batch of grad_accum count, one by one or in a window") {
  check_one_step(3, 1);
  check_one_step(2, 2);
}

TEST_CASE("bias update: an expert at the mean keeps its bias; rate 0 changes nothing") {
  Config c = bias_run_config("rule", 1);
  testing::TrainingRun run(c);
  const std::vector<std::vector<double>> before = biases(*run.model);
  // Mean 4: experts at 4 stay, below move up, above move down.
  run.model->update_expert_bias({{4, 4, 0, 8, 3, 5}, {1, 7, 4, 4, 4, 4}});
  const std::vector<std::vector<double>> after = biases(*run.model);
  const std::vector<std::vector<double>> sign = {{0, 0, 1, -1, 1, -1}, {1, -1, 0, 0, 0, 0}};
  for (size_t l = 0; l < 2; ++l) {
    for (size_t e = 0; e < 6; ++e) CHECK(after[l][e] == before[l][e] + kRate * sign[l][e]);
  }

  Config off = bias_run_config("off", 1);
  off.model.moe.bias_update_rate = 0.0;
  testing::TrainingRun plain(off);
  CHECK(plain.model->trained_buffers().empty());
  plain.model->update_expert_bias({{4, 4, 0, 8, 3, 5}, {1, 7, 4, 4, 4, 4}});  // a no-op
}

TEST_CASE("bias update: 4 steps straight equal 2 + save + resume + 2, bias and adapters bit for bit") {
  Config straight_config = bias_run_config("straight", 4);
  testing::TrainingRun straight(straight_config);
  const std::vector<std::vector<double>> initial = biases(*straight.model);
  const std::vector<double> expected = straight.trainer->run();
  REQUIRE(expected.size() == 4);
  CHECK(biases(*straight.model) != initial);  // the updates moved it

  Config split = bias_run_config("split", 4);
  std::vector<double> losses;
  std::unique_ptr<testing::TrainingRun> resumed = testing::run_with_resume(split, 2, losses);
  REQUIRE(losses.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(losses[i] == expected[i]);
  CHECK(biases(*resumed->model) == biases(*straight.model));
  CHECK(testing::same_adapter_bytes(*resumed->model, *straight.model));

  // The checkpoint holds each layer's bias as buffer/<HF name>.
  CheckpointReader reader((fs::path(split.logging.run_dir) / "checkpoints" / "step_2").string());
  CHECK(reader.has("buffer/model.layers.1.mlp.gate.e_score_correction_bias"));
  CHECK(reader.has("buffer/model.layers.2.mlp.gate.e_score_correction_bias"));
}
