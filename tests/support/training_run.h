// One process's worth of training objects for checkpoint and resume tests, built the way
// run_training builds them (model_options_for, the Trainer, synthetic data, a CheckpointSession
// saving after every step it is due), on the CPU backend in F32 with random frozen weights.
#pragma once

#include <memory>

#include "core/checkpoint/checkpoint_session.h"
#include "core/model/model.h"
#include "core/train/synthetic_data.h"
#include "kernels/ops.h"

namespace moetrain::testing {

struct TrainingRun {
  Config config;
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
  std::unique_ptr<SyntheticData> data;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<CheckpointGroup> group = make_single_process_group();
  std::unique_ptr<CheckpointSession> session;

  explicit TrainingRun(const Config& c) : config(c) {
    model = std::make_unique<Model>(resolve_model_spec(c), *backend, model_options_for(c));
    model->init_random_weights();
    data = std::make_unique<SyntheticData>(c.data, c.model.vocab_size);
    TrainerOptions t;
    t.train = c.train;
    t.data = c.data;
    t.logging = c.logging;
    trainer = std::make_unique<Trainer>(t, *model, [this] { return data->next(); });
    DataCursorAccess cursor{[this] { return data->cursor(); }, [this](uint64_t v) { data->seek(v); }, {}, {}};
    session = std::make_unique<CheckpointSession>(c, *group, *trainer, *backend, cursor);
    trainer->set_after_step([this](const StepRecord&) { session->after_step(); });
  }
};

}  // namespace moetrain::testing
