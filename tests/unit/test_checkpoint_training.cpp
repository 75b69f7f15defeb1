// Checkpoints of a real training run (the tiny MLA + MoE model, the Trainer, the synthetic
// data): 10 steps straight equal 5 + save + resume in fresh objects + 5, loss for loss and bit
// for bit; a preemption signal saves and stops with exit code 75, and resuming from there also
// continues exactly; the exported PEFT adapter loads back into a fresh model with identical
// adapter values and identical logits.
#include <signal.h>

#include <cstring>
#include <filesystem>
#include <memory>

#include "catch.h"
#include "core/base/error.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_session.h"
#include "core/checkpoint/preemption.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/data/synthetic_data.h"
#include "core/io/safetensors.h"
#include "tiny_model.h"
#include "training_run.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

Config tiny_run_config(const std::string& name) {
  Config c = testing::short_lora_run_config(10);
  c.lora.targets = testing::all_lora_targets(false);
  c.data.seq_len = 8;
  c.train.warmup_steps = 2;
  fs::path dir = fs::temp_directory_path() / ("moetrain_test_ckpt_training_" + name);
  fs::remove_all(dir);
  c.logging.run_dir = dir.string();
  c.checkpoint.every = 5;
  c.checkpoint.export_adapter = "false";
  return c;
}

using Run = testing::TrainingRun;

std::vector<double> values_of(Model& model) {
  std::vector<double> all;
  for (Parameter* p : model.parameters()) {
    const float* v = p->value.ptr<float>();
    all.insert(all.end(), v, v + p->value.numel());
  }
  return all;
}

}  // namespace

TEST_CASE("resume: 10 steps straight equal 5 + save + resume + 5, bit for bit") {
  Config config = tiny_run_config("straight");
  Run straight(config);
  CHECK(!straight.session->resume());  // nothing saved yet: a fresh start
  std::vector<double> expected = straight.trainer->run();
  REQUIRE(expected.size() == 10);

  Config split_config = tiny_run_config("split");
  std::vector<double> first;
  {
    Run first_half(split_config);
    first_half.session->resume();
    for (int i = 0; i < 5; ++i) first.push_back(first_half.trainer->train_step().loss);  // saves step_5
  }
  REQUIRE(fs::exists(fs::path(split_config.logging.run_dir) / "checkpoints" / "step_5" / "manifest.json"));
  Run second_half(split_config);
  REQUIRE(second_half.session->resume());
  CHECK(second_half.trainer->next_step() == 5);
  CHECK(second_half.data->cursor() == 10);  // 5 steps x 2 windows
  std::vector<double> second = second_half.trainer->run();
  REQUIRE(second.size() == 5);
  for (int i = 0; i < 5; ++i) CHECK(first[i] == expected[i]);
  for (int i = 0; i < 5; ++i) CHECK(second[i] == expected[5 + i]);
  CHECK(values_of(*second_half.model) == values_of(*straight.model));
  CHECK(second_half.trainer->optimizer().step_count() == straight.trainer->optimizer().step_count());
  CHECK(second_half.trainer->tokens_seen() == straight.trainer->tokens_seen());
}

TEST_CASE("preemption: a signal saves at the step boundary, exits 75, and the resumed run continues exactly") {
  Config config = tiny_run_config("straight_signal");
  config.checkpoint.every = 0;
  Run straight(config);
  std::vector<double> expected = straight.trainer->run();

  Config signal_config = tiny_run_config("signal");
  signal_config.checkpoint.every = 0;
  std::vector<double> before;
  {
    Run run(signal_config);
    clear_preemption_request();
    for (int i = 0; i < 2; ++i) before.push_back(run.trainer->train_step().loss);
    ::raise(SIGUSR1);  // the handler the session installed only sets the flag
    REQUIRE(preemption_requested());
    bool preempted = false;
    try {
      run.trainer->train_step();
    } catch (const Error& e) {
      preempted = e.code() == ExitCode::kPreempted;
      CHECK(std::string(e.what()).find("SIGUSR1 after step 3") != std::string::npos);
    }
    CHECK(preempted);
    clear_preemption_request();
  }
  Run resumed(signal_config);
  REQUIRE(resumed.session->resume());
  CHECK(resumed.trainer->next_step() == 3);
  std::vector<double> after = resumed.trainer->run();
  REQUIRE(after.size() == 7);
  for (int i = 0; i < 2; ++i) CHECK(before[i] == expected[i]);
  for (int i = 0; i < 7; ++i) CHECK(after[i] == expected[3 + i]);
}

TEST_CASE("export: the PEFT adapter loads into a fresh model with identical values and logits") {
  Config config = tiny_run_config("export");
  // The per-expert layout here (its keys are checked below); test_peft_export_golden reads the
  // default transformers5 layout back, and scripts/check_peft_export.py loads both in PEFT.
  config.checkpoint.export_layout = "per_expert";
  config.train.steps = 3;
  config.checkpoint.every = 3;
  std::string adapter_dir = config.logging.run_dir + "/adapter";
  std::string from_checkpoint_dir = config.logging.run_dir + "/adapter_from_checkpoint";
  config.checkpoint.export_adapter = adapter_dir;
  Run trained(config);
  trained.trainer->run();
  trained.session->finish();  // step_3 already saved by after_step; writes the adapter
  export_checkpoint_adapter(trained.session->root(), from_checkpoint_dir);

  // Per-expert 2-D keys for the stacked routed experts (transformers 4 / vLLM naming).
  REQUIRE(fs::exists(adapter_dir + "/adapter_config.json"));
  PeftAdapterConfig peft = read_peft_adapter_config(adapter_dir);
  CHECK(peft.rank == 4);
  CHECK(peft.alpha == 8.0);
  SafetensorsFile file(adapter_dir + "/adapter_model.safetensors");
  CHECK(file.has("base_model.model.model.layers.1.mlp.experts.5.gate_proj.lora_A.weight"));
  CHECK(file.info("base_model.model.model.layers.1.mlp.experts.5.down_proj.lora_B.weight").shape == Shape{16, 4});
  CHECK(!file.has("base_model.model.model.layers.1.mlp.experts.gate_proj.lora_A.weight"));

  Batch batch = testing::tiny_batch(config.model.vocab_size, 7);
  Tensor expected_logits = trained.model->logits(batch);
  for (const std::string& dir : {adapter_dir, from_checkpoint_dir}) {
    Config fresh_config = tiny_run_config("export_fresh");
    Run fresh(fresh_config);
    CHECK(values_of(*fresh.model) != values_of(*trained.model));
    load_peft_adapter(*fresh.model, dir);
    CHECK(values_of(*fresh.model) == values_of(*trained.model));
    Tensor logits = fresh.model->logits(batch);
    REQUIRE(logits.shape() == expected_logits.shape());
    CHECK(std::memcmp(logits.data(), expected_logits.data(), logits.nbytes()) == 0);
  }
}
