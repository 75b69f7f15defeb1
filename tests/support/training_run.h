// One process's worth of training objects for checkpoint and resume tests, built the way
// run_training builds them (model_options_for, the Trainer, synthetic data, a CheckpointSession
// saving after every step it is due), on the CPU backend in F32 with random frozen weights.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/checkpoint/checkpoint_session.h"
#include "core/model/model.h"
#include "core/data/synthetic_data.h"
#include "kernels/ops.h"
#include "tiny_model.h"

namespace moetrain::testing {

// The Trainer's options as run_training gives them for `c`: its train, data and logging sections.
inline TrainerOptions trainer_options_for(const Config& c) {
  TrainerOptions t;
  t.train = c.train;
  t.data = c.data;
  t.logging = c.logging;
  return t;
}

// The model of `c` on `backend` with random frozen weights.
inline std::unique_ptr<Model> random_model(const Config& c, kernels::Backend& backend) {
  auto model = std::make_unique<Model>(resolve_model_spec(c), backend, model_options_for(c));
  model->init_random_weights();
  return model;
}

// `steps` steps of the tiny model (tiny_model.h) with LoRA r4 / alpha 8 on micro-batches of 2, at
// lr 1e-2 after one warm-up step: the base of the training-run tests' configs.
inline Config short_lora_run_config(int64_t steps) {
  Config c = tiny_model_config(false);
  c.lora.rank = 4;
  c.lora.alpha = 8.0;
  c.data.micro_batch = 2;
  c.train.steps = steps;
  c.train.lr = 1e-2;
  c.train.warmup_steps = 1;
  return c;
}

struct TrainingRun {
  Config config;
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
  std::unique_ptr<SyntheticData> data;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<CheckpointGroup> group = make_single_process_group();
  std::unique_ptr<CheckpointSession> session;

  explicit TrainingRun(const Config& c) : config(c) {
    model = random_model(c, *backend);
    data = std::make_unique<SyntheticData>(c.data, c.model.vocab_size);
    trainer = std::make_unique<Trainer>(trainer_options_for(c), *model, [this] { return data->next(); });
    DataCursorAccess cursor{[this] { return data->cursor(); }, [this](uint64_t v) { data->seek(v); }, {}, {}};
    session = std::make_unique<CheckpointSession>(c, *group, *trainer, *backend, cursor);
    trainer->set_after_step([this](const StepRecord&) { session->after_step(); });
  }
};

// Four steps of the tiny model (tiny_model.h) with LoRA r4 / alpha 8, saving a checkpoint every
// 2 steps into run_dir: the resume checks of the adapter forms set their targets and form on it.
inline Config four_step_run_config(const std::string& run_dir) {
  Config c = short_lora_run_config(4);
  c.logging.run_dir = run_dir;
  c.checkpoint.every = 2;
  c.checkpoint.export_adapter = "false";
  return c;
}

// Trains `before` steps of `c`, then resumes from its checkpoint in new objects (as a new process
// would) and trains to the end; appends every step's loss to `losses` and returns the resumed run.
inline std::unique_ptr<TrainingRun> run_with_resume(const Config& c, int before, std::vector<double>& losses) {
  {
    TrainingRun first(c);
    first.session->resume();
    for (int i = 0; i < before; ++i) losses.push_back(first.trainer->train_step().loss);
  }
  auto second = std::make_unique<TrainingRun>(c);
  REQUIRE(second->session->resume());
  for (double loss : second->trainer->run()) losses.push_back(loss);
  return second;
}

}  // namespace moetrain::testing
