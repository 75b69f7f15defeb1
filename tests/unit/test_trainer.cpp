// The training loop with a fake model whose gradient is written out here: a linear
// least-squares fit of a per-token target from fixed token features. It checks the loop
// reduces the loss, that accumulating micro-batches gives the one-big-batch gradient (scale
// 1 / targets of the whole step), that non-finite steps are skipped and stop the run after 5
// in a row, and what metrics.jsonl (per-layer expert loads included) and the progress line hold.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/train/metrics.h"
#include "core/train/schedule.h"
#include "core/data/synthetic_data.h"
#include "core/train/trainer.h"
#include "tests/support/step_metrics.h"

using moetrain::Batch;
using moetrain::DType;
using moetrain::Error;
using moetrain::ExitCode;
using moetrain::MetricsWriter;
using moetrain::Parameter;
using moetrain::StepMetrics;
using moetrain::StepResult;
using moetrain::SyntheticData;
using moetrain::Tensor;
using moetrain::Trainer;
using moetrain::TrainerOptions;

namespace {

constexpr int64_t kDim = 6;
constexpr int64_t kVocab = 40;

double feature(int32_t token, int64_t k) { return std::cos(0.37 * (token + 1) * (k + 1)); }

// What the model should predict for a target: a linear function of the input token's features
// plus a small label-dependent part no linear fit of the input can explain (the loss floor).
double target(int32_t input, int32_t label) {
  double y = 0.0;
  for (int64_t k = 0; k < kDim; ++k) y += (0.5 - 0.2 * k) * feature(input, k);
  return y + 0.05 * ((label % 5) - 2);
}

// pred = w . phi(input) + b;  loss = 0.5 (pred - y)^2 per target.
class LeastSquaresModel : public moetrain::TrainableModel {
 public:
  LeastSquaresModel() : backend_(moetrain::kernels::make_cpu_backend()) {
    weight_.name = "w";
    weight_.value = Tensor({kDim}, DType::kF64);
    weight_.grad = Tensor::zeros({kDim}, DType::kF64);
    for (int64_t k = 0; k < kDim; ++k) weight_.value.ptr<double>()[k] = 0.1 * (k % 3);
    bias_.name = "b";
    bias_.value = Tensor::zeros({1}, DType::kF64);
    bias_.grad = Tensor::zeros({1}, DType::kF64);
    bias_.weight_decay = false;
  }

  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  moetrain::kernels::Backend& backend() override { return *backend_; }

  StepResult forward_backward(const Batch& batch, double grad_scale) override {
    StepResult result;
    const double* w = weight_.value.ptr<double>();
    double* dw = weight_.grad.ptr<double>();
    double* db = bias_.grad.ptr<double>();
    for (size_t t = 0; t < batch.labels.size(); ++t) {
      if (batch.labels[t] < 0) continue;
      double pred = bias_.value.ptr<double>()[0];
      for (int64_t k = 0; k < kDim; ++k) pred += w[k] * feature(batch.input_ids[t], k);
      const double residual = pred - target(batch.input_ids[t], batch.labels[t]);
      result.loss_sum += 0.5 * residual * residual;
      for (int64_t k = 0; k < kDim; ++k) dw[k] += grad_scale * residual * feature(batch.input_ids[t], k);
      db[0] += grad_scale * residual;
      ++result.targets;
    }
    if (calls == fail_call) throw Error(ExitCode::kInternal, "out of GPU memory (simulated)");
    if (nan_loss_calls.count(calls)) result.loss_sum = std::nan("");
    if (nan_grad_calls.count(calls)) dw[0] = INFINITY;
    result.max_expert_load = 1.0 + 0.01 * static_cast<double>(calls);
    if (!layer_loads.empty()) {
      result.expert_load_max = layer_loads.at(static_cast<size_t>(calls)).first;
      result.expert_load_min = layer_loads.at(static_cast<size_t>(calls)).second;
    }
    ++calls;
    return result;
  }

  std::vector<double> weights() const {
    std::vector<double> out(weight_.value.ptr<double>(), weight_.value.ptr<double>() + kDim);
    out.push_back(bias_.value.ptr<double>()[0]);
    return out;
  }

  std::set<int64_t> nan_loss_calls, nan_grad_calls;  // forward_backward calls to poison
  int64_t fail_call = -1;                             // the forward_backward call that throws
  // Per call: the (max, min) expert load of each MoE layer to report (none when empty).
  std::vector<std::pair<std::vector<double>, std::vector<double>>> layer_loads;
  int64_t calls = 0;

 private:
  std::unique_ptr<moetrain::kernels::Backend> backend_;
  Parameter weight_, bias_;
};

TrainerOptions make_options(int64_t steps, int64_t micro_batch, int64_t grad_accum) {
  TrainerOptions options;
  options.train.steps = steps;
  options.train.lr = 0.05;
  options.train.warmup_steps = 3;
  options.train.schedule = "cosine";
  options.train.grad_clip = 1.0;
  options.data.seq_len = 24;
  options.data.micro_batch = micro_batch;
  options.data.grad_accum = grad_accum;
  options.logging.every = 1000;  // keep the test output short
  return options;
}

Trainer::BatchSource source(SyntheticData& data) {
  return [&data] { return data.next(); };
}

bool near(double a, double b, double tolerance) { return std::abs(a - b) <= tolerance * (1.0 + std::abs(b)); }

std::filesystem::path scratch_dir(const std::string& name) {
  const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  auto dir = std::filesystem::temp_directory_path() / ("moetrain_test_trainer_" + name + "_" + std::to_string(stamp));
  std::filesystem::remove_all(dir);
  return dir;
}

std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// Trains to the end with a MetricsWriter on `dir`; returns the lines of its metrics.jsonl.
std::vector<nlohmann::json> train_with_metrics(const TrainerOptions& options, LeastSquaresModel& model,
                                               SyntheticData& data, const std::filesystem::path& dir) {
  {
    MetricsWriter writer(dir.string());
    Trainer trainer(options, model, source(data), &writer);
    trainer.run();
  }
  return read_jsonl(dir / "metrics.jsonl");
}

// Runs the trainer to its end or its first error: the error's code and message (kOk, "" if none).
std::pair<ExitCode, std::string> run_until_error(Trainer& trainer) {
  try {
    trainer.run();
  } catch (const Error& error) {
    return {error.code(), error.what()};
  }
  return {ExitCode::kOk, ""};
}

}  // namespace

TEST_CASE("the loop fits the model: the loss falls by an order of magnitude") {
  LeastSquaresModel model;
  TrainerOptions options = make_options(80, 2, 1);
  SyntheticData data(options.data, kVocab);
  Trainer trainer(options, model, source(data));
  const std::vector<double> losses = trainer.run();
  REQUIRE(losses.size() == 80);
  double last = 0.0;
  for (size_t i = 75; i < 80; ++i) last += losses[i] / 5;
  CHECK(last < 0.1 * losses[0]);
  CHECK(trainer.optimizer().step_count() == 80);
  CHECK(trainer.tokens_seen() == 80 * 2 * 24);
  for (const auto& record : trainer.history()) {
    CHECK(record.lr == moetrain::learning_rate(options.train, record.step));
  }
}

TEST_CASE("the step's gradient is the mean over all its targets, however they are split") {
  // lr 0 and no clipping: the first step's reported grad norm is the raw accumulated gradient.
  TrainerOptions options = make_options(1, 1, 2);
  options.train.lr = 0.0;
  options.train.grad_clip = 0.0;
  LeastSquaresModel model;
  SyntheticData data(options.data, kVocab);
  Trainer trainer(options, model, source(data));
  const double loss = trainer.run().at(0);

  // The same two windows, and the gradient of their mean loss written out directly.
  SyntheticData replay(options.data, kVocab);
  const Batch first = replay.next(), second = replay.next();
  REQUIRE(first.num_targets() != second.num_targets());  // else per-micro-batch means would pass too
  const std::vector<double> w = LeastSquaresModel().weights();
  std::vector<double> grad(kDim + 1, 0.0);
  double loss_sum = 0.0;
  const double targets = static_cast<double>(first.num_targets() + second.num_targets());
  for (const Batch* batch : {&first, &second}) {
    for (size_t t = 0; t < batch->labels.size(); ++t) {
      if (batch->labels[t] < 0) continue;
      double pred = w[kDim];
      for (int64_t k = 0; k < kDim; ++k) pred += w[k] * feature(batch->input_ids[t], k);
      const double r = pred - target(batch->input_ids[t], batch->labels[t]);
      loss_sum += 0.5 * r * r;
      for (int64_t k = 0; k < kDim; ++k) grad[k] += r * feature(batch->input_ids[t], k) / targets;
      grad[kDim] += r / targets;
    }
  }
  double norm = 0.0;
  for (double g : grad) norm += g * g;
  CHECK(near(trainer.history().at(0).grad_norm, std::sqrt(norm), 1e-12));
  CHECK(near(loss, loss_sum / targets, 1e-12));
  CHECK(trainer.history().at(0).targets == static_cast<int64_t>(targets));
}

TEST_CASE("two accumulated micro-batches train exactly like one batch of both") {
  LeastSquaresModel accumulated, whole;
  TrainerOptions split_options = make_options(6, 1, 2), whole_options = make_options(6, 2, 1);
  SyntheticData split_data(split_options.data, kVocab), whole_data(whole_options.data, kVocab);
  Trainer split(split_options, accumulated, source(split_data));
  Trainer one(whole_options, whole, source(whole_data));
  const std::vector<double> split_losses = split.run(), whole_losses = one.run();
  for (size_t i = 0; i < split_losses.size(); ++i) {
    CHECK(near(split_losses[i], whole_losses[i], 1e-12));
    CHECK(near(split.history()[i].grad_norm, one.history()[i].grad_norm, 1e-12));
  }
  const std::vector<double> a = accumulated.weights(), b = whole.weights();
  for (size_t i = 0; i < a.size(); ++i) CHECK(near(a[i], b[i], 1e-12));
  CHECK(accumulated.calls == 12);
  CHECK(whole.calls == 6);
}

TEST_CASE("non-finite steps are skipped, and five in a row stop the run") {
  LeastSquaresModel model;
  model.nan_loss_calls = {2, 3};                // two bad steps, then recovery
  model.nan_grad_calls = {6, 7, 8, 9, 10};      // five in a row: stop at the fifth
  TrainerOptions options = make_options(30, 1, 1);
  SyntheticData data(options.data, kVocab);
  Trainer trainer(options, model, source(data));
  std::vector<std::vector<double>> weights_after;  // after each step, from the hook
  std::vector<int64_t> hook_next_steps;
  trainer.set_after_step([&](const moetrain::StepRecord& record) {
    weights_after.push_back(model.weights());
    hook_next_steps.push_back(trainer.next_step());
  });

  const auto [code, message] = run_until_error(trainer);
  CHECK(code == ExitCode::kInternal);
  CHECK(message.find("5 steps in a row") != std::string::npos);
  CHECK(message.find("step 11") != std::string::npos);

  // Two skips then good steps reset the count: the stop comes at call 10, not at the 5th bad one.
  const auto& history = trainer.history();
  REQUIRE(history.size() == 11);
  REQUIRE(weights_after.size() == 11);
  CHECK(hook_next_steps.back() == 11);
  for (int64_t step = 0; step < 11; ++step) {
    const bool bad = step == 2 || step == 3 || step >= 6;
    CHECK(history[step].skipped == bad);
    if (step > 0 && bad) CHECK(weights_after[step] == weights_after[step - 1]);  // untouched
    if (step > 0 && !bad) CHECK(weights_after[step] != weights_after[step - 1]);
  }
  CHECK(std::isnan(history[2].loss));
  CHECK(std::isinf(history[6].grad_norm));
  CHECK(trainer.optimizer().step_count() == 4);  // steps 0, 1, 4, 5 updated
  for (double w : model.weights()) CHECK(std::isfinite(w));
  for (const auto* p : model.parameters()) {
    for (int64_t i = 0; i < p->grad.numel(); ++i) CHECK(p->grad.ptr<double>()[i] == 0.0);
  }
}

TEST_CASE("an error inside a step's forward/backward names the step and micro-batch, code kept") {
  LeastSquaresModel model;
  model.fail_call = 4;  // the first micro-batch of step 3 (calls count from 0, two per step)
  TrainerOptions options = make_options(5, 1, 2);
  SyntheticData data(options.data, kVocab);
  Trainer trainer(options, model, source(data));
  const auto [code, message] = run_until_error(trainer);
  CHECK(code == ExitCode::kInternal);
  CHECK(message == "step 3, micro-batch 1: out of GPU memory (simulated)");
}

TEST_CASE("metrics.jsonl gets one line per step and is appended on resume") {
  const auto dir = scratch_dir("metrics");
  {
    LeastSquaresModel model;
    model.nan_loss_calls = {2};
    TrainerOptions options = make_options(4, 2, 1);
    options.logging.every = 2;
    SyntheticData data(options.data, kVocab);
    MetricsWriter writer((dir / "nested").string());
    Trainer trainer(options, model, source(data), &writer);
    trainer.run();
  }
  const auto path = dir / "nested" / "metrics.jsonl";
  std::vector<nlohmann::json> lines = read_jsonl(path);
  REQUIRE(lines.size() == 4);
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json& line = lines[i];
    CHECK(line.at("step").get<int64_t>() == static_cast<int64_t>(i) + 1);
    CHECK(line.at("tokens").get<int64_t>() == static_cast<int64_t>(i + 1) * 2 * 24);
    CHECK(line.at("tokens_per_s").get<double>() > 0.0);
    CHECK(near(line.at("max_expert_load").get<double>(), 1.0 + 0.01 * static_cast<double>(i), 1e-12));
    CHECK(line.contains("lr"));
    CHECK(line.contains("grad_norm"));
  }
  CHECK(lines[0].at("loss").get<double>() > 0.0);
  CHECK(lines[2].at("loss").is_null());  // NaN is written as null: the line stays valid JSON
  CHECK(lines[2].at("skipped").get<double>() == 1.0);
  CHECK(!lines[1].contains("skipped"));

  MetricsWriter resumed((dir / "nested").string());
  StepMetrics m;
  m.step = 5;
  m.extra = {{"aux_loss", 0.25}};
  resumed.write(m, /*log_progress=*/false);
  lines = read_jsonl(path);
  REQUIRE(lines.size() == 5);
  CHECK(lines[4].at("step").get<int64_t>() == 5);
  CHECK(lines[4].at("aux_loss").get<double>() == 0.25);
  std::filesystem::remove_all(dir);
}

TEST_CASE("per-layer expert loads: the max of the micro-batches' maxima and the min of their minima") {
  const auto dir = scratch_dir("expert_load");
  LeastSquaresModel model;
  // Two steps of two micro-batches, two MoE layers: each layer's extremes come from either one.
  model.layer_loads = {{{1.5, 1.1}, {0.5, 0.9}}, {{1.2, 1.4}, {0.7, 0.6}},
                       {{2.0, 1.0}, {0.0, 1.0}}, {{1.0, 3.0}, {1.0, 0.25}}};
  TrainerOptions options = make_options(2, 1, 2);
  options.loss_floor = 0.125;
  SyntheticData data(options.data, kVocab);
  const std::vector<nlohmann::json> lines = train_with_metrics(options, model, data, dir);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].at("expert_load_max").get<std::vector<double>>() == std::vector<double>{1.5, 1.4});
  CHECK(lines[0].at("expert_load_min").get<std::vector<double>>() == std::vector<double>{0.5, 0.6});
  CHECK(lines[1].at("expert_load_max").get<std::vector<double>>() == std::vector<double>{2.0, 3.0});
  CHECK(lines[1].at("expert_load_min").get<std::vector<double>>() == std::vector<double>{0.0, 0.25});
  for (const auto& line : lines) CHECK(line.at("loss_floor").get<double>() == 0.125);
  std::filesystem::remove_all(dir);

  // A model without MoE layers and data without a known floor: neither key is written.
  const auto plain_dir = scratch_dir("no_expert_load");
  LeastSquaresModel plain;
  SyntheticData plain_data(options.data, kVocab);
  options.loss_floor = std::nan("");
  for (const auto& line : train_with_metrics(options, plain, plain_data, plain_dir)) {
    CHECK(!line.contains("expert_load_max"));
    CHECK(!line.contains("expert_load_min"));
    CHECK(!line.contains("loss_floor"));
  }
  std::filesystem::remove_all(plain_dir);
}

TEST_CASE("mfu is the step's model FLOPs over its time and the device's peak, only when both are known") {
  const auto dir = scratch_dir("mfu");
  LeastSquaresModel model;
  TrainerOptions options = make_options(3, 2, 2);
  options.batch_flops = [](const moetrain::Batch& batch) { return 1e6 * static_cast<double>(batch.num_tokens()); };
  options.peak_flops = 1e12;
  SyntheticData data(options.data, kVocab);
  {
    MetricsWriter writer(dir.string());
    Trainer trainer(options, model, source(data), &writer);
    trainer.run();
    const std::vector<nlohmann::json> lines = read_jsonl(dir / "metrics.jsonl");
    REQUIRE(lines.size() == 3);
    for (size_t i = 0; i < lines.size(); ++i) {
      const auto& record = trainer.history()[i];
      CHECK(record.model_flops == 1e6 * 2 * (2 * 24));  // two micro-batches of 2 x 24 tokens
      CHECK(near(lines[i].at("mfu").get<double>(), record.model_flops / record.seconds / 1e12, 1e-9));
    }
  }
  options.peak_flops = 0.0;  // an unknown device: no mfu key
  const auto dir2 = scratch_dir("mfu_unknown");
  for (const auto& line : train_with_metrics(options, model, data, dir2)) CHECK(!line.contains("mfu"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir2);
}

TEST_CASE("the progress line reads as documented") {
  StepMetrics m = moetrain::testing::progress_line_metrics();
  CHECK(moetrain::format_progress_line(m) ==
        "step 12/150 | loss 4.1234 | lr 1.20e-03 | grad 0.532 | 12.3k tok/s | max load 1.42");
  m.tokens_per_s = 950;
  m.extra = {{"aux_loss", 0.0125}};
  CHECK(moetrain::format_progress_line(m) ==
        "step 12/150 | loss 4.1234 | lr 1.20e-03 | grad 0.532 | 950 tok/s | max load 1.42 | aux_loss 0.0125");
  m.extra = {{"mfu", 0.4237}};
  CHECK(moetrain::format_progress_line(m) ==
        "step 12/150 | loss 4.1234 | lr 1.20e-03 | grad 0.532 | 950 tok/s | max load 1.42 | mfu 42.4%");
}

TEST_CASE("a run directory that cannot be created is a config error") {
  const auto dir = scratch_dir("blocked");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "file") << "x";  // a file where the run directory should go
  ExitCode code = ExitCode::kOk;
  try {
    MetricsWriter writer((dir / "file" / "run").string());
  } catch (const Error& error) {
    code = error.code();
  }
  CHECK(code == ExitCode::kBadConfig);
  std::filesystem::remove_all(dir);
}
