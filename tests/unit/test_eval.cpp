// Evaluation (data.eval, core/data/eval_data.h; Trainer::evaluate; Model::evaluate) and the
// progress line's elapsed time and ETA. Checks: a run that evaluates after every step trains
// exactly the losses, parameters and router-noise stream of one that does not; the eval loss is
// the mean cross-entropy of the eval windows' targets (against the model's logits, in double);
// the eval set is the same on any world size (every window once over the ranks, the same number
// of micro-batches on every rank); held-out documents never reach training; the config's rules.
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"
#include "core/data/data_source.h"
#include "core/data/eval_data.h"
#include "core/model/model.h"
#include "core/train/metrics.h"
#include "core/data/synthetic_data.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"
#include "tests/support/step_metrics.h"
#include "test_data_support.h"
#include "tiny_model.h"
#include "training_run.h"

namespace moetrain {
namespace {

using testing::DataScratchDir;
using testing::numbered_documents;

// The tiny hybrid model with router noise on, so that a forward drawn by an evaluation (or a
// moved noise stream) would change training.
Config noisy_tiny_config() {
  Config c = testing::short_lora_run_config(4);
  c.model.moe.router_noise = 0.05;
  c.lora.targets = testing::all_lora_targets(false);
  c.logging.every = 1000;
  return c;
}

struct Run {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
  std::unique_ptr<SyntheticData> data;
  std::unique_ptr<EvalData> eval;
  std::unique_ptr<Trainer> trainer;

  explicit Run(const Config& c) {
    model = testing::random_model(c, *backend);
    data = std::make_unique<SyntheticData>(c.data, c.model.vocab_size);
    TrainerOptions t = testing::trainer_options_for(c);
    eval = make_eval_data(c.data, c.model.vocab_size);
    if (eval) {
      t.eval_micro_batches = eval->micro_batches(c.data.micro_batch, 1);
      t.eval_batch = [this, c](int64_t i) { return eval->micro_batch(i, c.data.micro_batch, 0, 1); };
    }
    trainer = std::make_unique<Trainer>(t, *model, [this] { return data->next(); });
  }
  std::vector<float> parameters() const {
    std::vector<float> values;
    for (Parameter* p : model->parameters()) {
      values.insert(values.end(), p->value.ptr<float>(), p->value.ptr<float>() + p->value.numel());
    }
    return values;
  }
};

TEST_CASE("a run that evaluates after every step trains exactly like one that does not") {
  Config plain = noisy_tiny_config();
  Config evaluated = plain;
  evaluated.data.eval.source = "synthetic";
  evaluated.data.eval.windows = 3;
  evaluated.train.eval_every = 1;
  Run a(plain), b(evaluated);
  const std::vector<double> losses_a = a.trainer->run();
  const std::vector<double> losses_b = b.trainer->run();
  REQUIRE(losses_a.size() == 4);
  CHECK(losses_a == losses_b);  // bit for bit
  CHECK(a.parameters() == b.parameters());
  CHECK(a.model->forward_count() == b.model->forward_count());
  CHECK(a.data->cursor() == b.data->cursor());
  for (const StepRecord& record : a.trainer->history()) CHECK(std::isnan(record.eval_loss));
  for (const StepRecord& record : b.trainer->history()) CHECK(std::isfinite(record.eval_loss));
  REQUIRE(b.trainer->last_eval());
  CHECK(b.trainer->last_eval()->loss == b.trainer->history().back().eval_loss);
  // Evaluating again on unchanged parameters gives the same number: a fixed set, no noise.
  CHECK(b.trainer->evaluate().loss == b.trainer->history().back().eval_loss);
}

TEST_CASE("eval_every: evaluations after every N-th step and after the last, and only then") {
  Config c = noisy_tiny_config();
  c.train.steps = 5;
  c.data.eval.source = "synthetic";
  c.data.eval.windows = 2;
  c.train.eval_every = 2;
  Run run(c);
  run.trainer->run();
  std::vector<int64_t> evaluated;
  for (const StepRecord& r : run.trainer->history()) {
    if (!std::isnan(r.eval_loss)) evaluated.push_back(r.step + 1);
  }
  CHECK(evaluated == std::vector<int64_t>{2, 4, 5});
  c.train.eval_every = 0;  // only at the end
  Run at_end(c);
  at_end.trainer->run();
  evaluated.clear();
  for (const StepRecord& r : at_end.trainer->history()) {
    if (!std::isnan(r.eval_loss)) evaluated.push_back(r.step + 1);
  }
  CHECK(evaluated == std::vector<int64_t>{5});
}

TEST_CASE("Model::evaluate is the mean cross-entropy of the targets, forward only") {
  Config c = noisy_tiny_config();
  c.model.moe.router_noise = 0.0;  // logits() has no way to turn noise off; compare without it
  c.data.eval.source = "synthetic";
  c.data.eval.windows = 3;
  Run run(c);
  EvalData& eval = *run.eval;
  REQUIRE(eval.micro_batches(2, 1) == 2);  // 3 windows in micro-batches of 2: the last half padding
  double total = 0.0;
  int64_t targets = 0;
  for (int64_t i = 0; i < 2; ++i) {
    const Batch batch = eval.micro_batch(i, 2, 0, 1);
    const uint64_t forwards = run.model->forward_count();
    const StepResult result = run.model->evaluate(batch);
    CHECK(run.model->forward_count() == forwards);
    // The reference: log-softmax of the logits at every target, in double.
    const Tensor logits = run.model->logits(batch);
    const int64_t vocab = c.model.vocab_size;
    double expected = 0.0;
    int64_t expected_targets = 0;
    for (size_t t = 0; t < batch.labels.size(); ++t) {
      if (batch.labels[t] < 0) continue;
      const double* row = logits.ptr<double>() + static_cast<int64_t>(t) * vocab;
      double top = row[0];
      for (int64_t v = 1; v < vocab; ++v) top = std::max(top, row[v]);
      double sum = 0.0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - top);
      expected += std::log(sum) + top - row[batch.labels[t]];
      ++expected_targets;
    }
    CHECK(result.targets == expected_targets);
    CHECK(std::abs(result.loss_sum - expected) <= 1e-5 * std::abs(expected));
    total += result.loss_sum;
    targets += result.targets;
  }
  REQUIRE(targets > 0);
  const EvalRecord record = run.trainer->evaluate();
  CHECK(record.targets == targets);
  CHECK(std::abs(record.loss - total / static_cast<double>(targets)) <= 1e-12 * record.loss);
  // The gradients stayed zero: nothing was accumulated.
  for (Parameter* p : run.model->parameters()) {
    for (int64_t i = 0; i < p->grad.numel(); ++i) REQUIRE(p->grad.ptr<float>()[i] == 0.0f);
  }
}

// Every window of a world's evaluation, as token ids (padding left out), in global order.
std::vector<std::vector<int32_t>> eval_windows(EvalData& eval, int64_t micro_batch, int world) {
  std::map<int64_t, std::vector<int32_t>> by_index;
  const int64_t count = eval.micro_batches(micro_batch, world);
  for (int rank = 0; rank < world; ++rank) {
    for (int64_t i = 0; i < count; ++i) {
      const Batch batch = eval.micro_batch(i, micro_batch, rank, world);
      for (int64_t b = 0; b < micro_batch; ++b) {
        const int64_t global = i * world * micro_batch + rank * micro_batch + b;
        std::vector<int32_t> ids(batch.input_ids.begin() + b * batch.seq_len,
                                 batch.input_ids.begin() + (b + 1) * batch.seq_len);
        bool targets = false;
        for (int64_t t = 0; t < batch.seq_len; ++t) targets |= batch.labels[static_cast<size_t>(b * batch.seq_len + t)] >= 0;
        if (global >= eval.windows()) {
          CHECK_FALSE(targets);  // padding: no targets
          continue;
        }
        by_index[global] = ids;
      }
    }
  }
  std::vector<std::vector<int32_t>> windows;
  for (auto& [index, ids] : by_index) windows.push_back(ids);
  return windows;
}

TEST_CASE("the eval set is the same windows on every world size, in slices of one count per rank") {
  DataScratchDir dir("eval_worlds");
  write_indexed_dataset(dir.file("e"), numbered_documents({30, 7, 51, 12, 40, 9, 22}));
  DataConfig config;
  config.source = dir.file("e");
  config.seq_len = 16;
  config.eval.source = dir.file("e");
  EvalData eval(config, 1000);
  CHECK(eval.windows() == (30 + 7 + 51 + 12 + 40 + 9 + 22 + 15) / 16);  // windows: 0 is one epoch
  const std::vector<std::vector<int32_t>> one = eval_windows(eval, 2, 1);
  REQUIRE(static_cast<int64_t>(one.size()) == eval.windows());
  // One epoch: every token of the dataset once.
  std::multiset<int32_t> tokens;
  for (const auto& w : one) {
    for (int32_t id : w) {
      if (id != 0) tokens.insert(id);
    }
  }
  CHECK(tokens.size() == 171);
  CHECK(std::set<int32_t>(tokens.begin(), tokens.end()).size() == 171);
  for (int world : {2, 3, 4}) {
    INFO("world " << world);
    CHECK(eval_windows(eval, 2, world) == one);
    CHECK(eval_windows(eval, 1, world) == one);
  }
  config.eval.windows = 5;
  EvalData five(config, 1000);
  const std::vector<std::vector<int32_t>> first = eval_windows(five, 2, 3);
  CHECK(first == std::vector<std::vector<int32_t>>(one.begin(), one.begin() + 5));
}

TEST_CASE("held-out documents are never drawn for training, and are the eval set") {
  DataScratchDir dir("eval_holdout");
  std::vector<int64_t> lengths;
  for (int i = 0; i < 20; ++i) lengths.push_back(5 + (i * 7) % 13);
  write_indexed_dataset(dir.file("h"), numbered_documents(lengths));
  DataConfig config;
  config.source = dir.file("h");
  config.seq_len = 8;
  config.micro_batch = 3;
  config.eval.holdout = 0.25;
  const std::vector<int64_t> held = held_out_documents(20, 0.25, static_cast<uint64_t>(config.seed), 0, "h");
  REQUIRE(held.size() == 5);
  // Token id -> its document (ids are numbered in file order from 1).
  std::vector<int> document_of(1);
  for (int d = 0; d < 20; ++d) document_of.insert(document_of.end(), static_cast<size_t>(lengths[d]), d);
  const std::set<int> held_set(held.begin(), held.end());

  // Several epochs of training on 2 ranks: no held-out document, and every other one seen.
  std::set<int> trained;
  for (int rank = 0; rank < 2; ++rank) {
    std::unique_ptr<DataSource> source = make_data_source(config, 1000, rank, 2);
    for (int step = 0; step < 40; ++step) {
      for (int32_t id : source->next().input_ids) {
        if (id != 0) trained.insert(document_of[static_cast<size_t>(id)]);
      }
    }
  }
  for (int d : trained) CHECK(held_set.count(d) == 0);
  CHECK(trained.size() == 15);

  EvalData eval(config, 1000);
  std::set<int> evaluated;
  int64_t eval_tokens = 0;
  for (const auto& window : eval_windows(eval, 2, 1)) {
    for (int32_t id : window) {
      if (id != 0) evaluated.insert(document_of[static_cast<size_t>(id)]), ++eval_tokens;
    }
  }
  CHECK(evaluated == held_set);
  int64_t held_tokens = 0;
  for (int d : held) held_tokens += lengths[static_cast<size_t>(d)];
  CHECK(eval_tokens == held_tokens);  // each held-out token once
  // The split is a function of the seed alone, and never takes every document.
  CHECK(held_out_documents(20, 0.25, static_cast<uint64_t>(config.seed), 0, "h") == held);
  CHECK(held_out_documents(3, 0.99, 1, 0, "h").size() == 2);
  CHECK(held_out_documents(3, 0.01, 1, 0, "h").size() == 1);
  CHECK_THROWS_AS(held_out_documents(1, 0.5, 1, 0, "h"), Error);
}

std::string config_error(const std::vector<std::string>& overrides) {
  try {
    parse_config("model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n", "test.yaml", overrides);
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    return e.what();
  }
  return "";
}

TEST_CASE("data.eval and train.eval_every: read, written back, and checked") {
  Config c = parse_config("model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\ndata:\n  source: d/train\n  eval: {holdout: 0.05, windows: 8}\n"
                          "train:\n  eval_every: 50\n",
                          "test.yaml");
  CHECK(c.data.eval.holdout == 0.05);
  CHECK(c.data.eval.windows == 8);
  CHECK(c.train.eval_every == 50);
  CHECK(same_settings(parse_config(config_to_yaml(c), "resolved.yaml"), c));
  Config m = parse_config("model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n", "test.yaml",
                          {"data.source=d/train", "data.eval.source=[{path: d/a, weight: 2}, {path: d/b}]"});
  REQUIRE(m.data.eval.mixture.size() == 2);
  CHECK(m.data.eval.source == kDataSourceMixture);
  CHECK(same_settings(parse_config(config_to_yaml(m), "resolved.yaml"), m));
  CHECK_FALSE(Config().data.eval.enabled());

  // Catch2 2.x and 3.x name their substring matcher differently: a plain find works on both.
  auto says = [](const std::string& error, const char* part) { return error.find(part) != std::string::npos; };
  CHECK(says(config_error({"data.source=d/t", "data.eval.source=d/e", "data.eval.holdout=0.1"}), "both set"));
  CHECK(says(config_error({"train.eval_every=10"}), "no eval data is set"));
  CHECK(says(config_error({"data.eval.holdout=0.1"}), "endless synthetic stream"));
  CHECK(says(config_error({"data.eval.source=synthetic"}), "set `data.eval.windows`"));
  CHECK(says(config_error({"data.source=d/t", "data.eval.source=synthetic", "data.eval.windows=4"}),
             "evaluates the built-in Markov chain"));
  CHECK(says(config_error({"data.source=d/t", "data.eval.holdout=1"}), "data.eval.holdout"));
  CHECK(says(config_error({"data.eval.windows=-1"}), "data.eval.windows"));
  CHECK(says(config_error({"data.eval.sorce=d/e"}), "data.eval.source"));
}

TEST_CASE("the progress line shows the eval loss, the elapsed time and the ETA") {
  CHECK(format_duration(0.4) == "0s");
  CHECK(format_duration(59.4) == "59s");
  CHECK(format_duration(65) == "1m05s");
  CHECK(format_duration(3600 * 2 + 7 * 60 + 20) == "2h07m");
  CHECK(format_duration(std::nan("")) == "?");
  StepMetrics m = moetrain::testing::progress_line_metrics();
  m.extra = {{"eval_loss", 3.5}, {"eval_ppl", std::exp(3.5)}};
  m.elapsed_s = 65;
  m.eta_s = 860;
  CHECK(format_progress_line(m) == "step 12/150 | loss 4.1234 | lr 1.20e-03 | grad 0.532 | 12.3k tok/s | max load 1.42 "
                                   "| eval loss 3.5000 | eval ppl 33.12 | 1m05s elapsed | eta 14m20s");
}

TEST_CASE("the ETA leaves out the first step, and a resumed run counts only its own steps") {
  Config c = noisy_tiny_config();
  c.train.steps = 6;
  Run run(c);
  run.trainer->set_progress(2, 1000);  // as after a resume at step 2
  run.trainer->run();
  CHECK(run.trainer->steps_this_run() == 4);
  CHECK(run.trainer->tokens_this_run() == 4 * 2 * c.data.seq_len);
  CHECK(run.trainer->tokens_seen() == 1000 + 4 * 2 * c.data.seq_len);
  CHECK(run.trainer->seconds_this_run() > 0);
}

}  // namespace
}  // namespace moetrain
