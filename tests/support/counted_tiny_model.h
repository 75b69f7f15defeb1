// The tiny hybrid model (tiny_model.h, with q LoRA, LoRA on every target) on the CPU backend
// behind a CountingBackend: what the tests of a step's allocations run.
#pragma once

#include <cstdint>
#include <memory>

#include "core/model/model.h"
#include "kernels/ops.h"
#include "tests/support/counting_backend.h"
#include "tests/support/tiny_model.h"

namespace moetrain::testing {

struct CountedTinyModel {
  // recompute_layers as ModelOptions::recompute_layers (-1: every layer, when recompute is on).
  explicit CountedTinyModel(bool recompute, int64_t recompute_layers = -1) {
    ModelOptions options;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = all_lora_targets(true);
    options.recompute = recompute;
    options.recompute_layers = recompute_layers;
    model = std::make_unique<Model>(resolve_model_spec(config), backend, options);
    model->init_random_weights();
  }
  // One forward and backward of the batch (the loss's gradient scaled by 1 / targets).
  void step() { model->forward_backward(batch, 1.0 / static_cast<double>(batch.num_targets())); }

  Config config = tiny_model_config(true);
  Batch batch = tiny_batch(config.model.vocab_size, 3);
  std::unique_ptr<kernels::Backend> cpu = kernels::make_cpu_backend();
  CountingBackend backend{*cpu};
  std::unique_ptr<Model> model;
};

}  // namespace moetrain::testing
