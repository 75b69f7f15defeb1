// A micro-batch queued without waiting (Model::forward_backward_async) and the experts' adapters
// packed once per optimizer step (TrainableModel::hold_parameters), on the CPU reference:
//   - results read later, in any order, with several micro-batches queued, equal the immediate
//     ones exactly (loss, targets, expert loads, aux loss);
//   - while held, the packed adapters are reused (a change to the expert adapters is not seen),
//     and released, the next forward packs the current values;
//   - the trainer, which holds the adapters over each step's micro-batches, trains exactly as the
//     same model never held: a packed copy kept past an optimizer step would change the losses.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "core/data/synthetic_data.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// The tiny hybrid model (dense layer, two MoE layers with a shared expert) with adapters on the
// routed and shared experts and the attention, and an aux loss, so every statistic is non-trivial.
Config deferred_config() {
  Config c = tiny_model_config(false);
  c.model.moe.aux_loss_coef = 0.01;
  c.lora.rank = 4;
  c.lora.alpha = 8.0;
  c.lora.targets = {"q_proj", "o_proj", "shared_experts", "experts", "gate_proj", "up_proj", "down_proj"};
  c.data.micro_batch = 2;
  c.data.grad_accum = 2;
  c.train.steps = 3;
  c.train.lr = 2e-2;
  c.train.warmup_steps = 0;
  return c;
}

std::unique_ptr<Model> make_model(const Config& c, kernels::Backend& backend) {
  auto model = std::make_unique<Model>(resolve_model_spec(c), backend, model_options_for(c));
  model->init_random_weights();
  return model;
}

void check_same(const StepResult& a, const StepResult& b) {
  CHECK(a.loss_sum == b.loss_sum);
  CHECK(a.targets == b.targets);
  CHECK(a.max_expert_load == b.max_expert_load);
  CHECK(a.aux_loss == b.aux_loss);
  CHECK(a.expert_load_max == b.expert_load_max);
  CHECK(a.expert_load_min == b.expert_load_min);
}

// The model as a trainer sees it, without hold_parameters (and so without the model's own
// deferred results): every forward packs the adapters afresh.
class NeverHeld final : public TrainableModel {
 public:
  explicit NeverHeld(Model& model) : model_(model) {}
  std::vector<Parameter*> parameters() override { return model_.parameters(); }
  std::vector<ParameterGroup*> parameter_groups() override { return model_.parameter_groups(); }
  StepResult forward_backward(const Batch& batch, double grad_scale) override {
    return model_.forward_backward(batch, grad_scale);
  }
  kernels::Backend& backend() override { return model_.backend(); }

 private:
  Model& model_;
};

std::vector<Tensor> adapter_values(Model& model) {
  std::vector<Tensor> values;
  for (Parameter* p : model.parameters()) {
    values.emplace_back(p->value.shape(), p->value.dtype());
    std::memcpy(values.back().data(), p->value.data(), p->value.nbytes());
  }
  return values;
}

}  // namespace

TEST_CASE("results read after several queued micro-batches equal the immediate ones", "[model]") {
  const Config c = deferred_config();
  auto cpu = kernels::make_cpu_backend();
  auto immediate = make_model(c, *cpu);
  auto deferred = make_model(c, *cpu);
  SyntheticData data(c.data, c.model.vocab_size);
  std::vector<Batch> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(data.next());

  std::vector<StepResult> expected;
  for (const Batch& batch : batches) expected.push_back(immediate->forward_backward(batch, 0.01));
  // Three queued at once: more than the two upload buffers, and three result buffers in use.
  std::vector<PendingStep> pending;
  for (const Batch& batch : batches) pending.push_back(deferred->forward_backward_async(batch, 0.01));
  for (size_t i = batches.size(); i-- > 0;) {
    INFO("micro-batch " << i);
    const StepResult& got = pending[i].get();
    REQUIRE(got.expert_load_max.size() == 2);  // the two MoE layers
    CHECK(got.aux_loss > 0.0);
    CHECK(got.max_expert_load >= 1.0);
    check_same(got, expected[i]);
  }
  // And the same gradients.
  const std::vector<Parameter*> a = immediate->parameters(), b = deferred->parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i]->name);
    CHECK(std::memcmp(a[i]->grad.data(), b[i]->grad.data(), a[i]->grad.nbytes()) == 0);
  }
}

TEST_CASE("held, the experts' packed adapters are reused; released, they are packed again", "[model]") {
  for (bool recompute : {false, true}) {
    INFO((recompute ? "recompute on" : "recompute off"));
    Config c = deferred_config();
    c.parallel.recompute = recompute;
    auto cpu = kernels::make_cpu_backend();
    auto model = make_model(c, *cpu);
    SyntheticData data(c.data, c.model.vocab_size);
    const Batch batch = data.next();

    model->hold_parameters(true);
    const double before = model->forward_backward(batch, 0.01).loss_sum;
    // What an optimizer step would do to the experts' B (zero at initialisation).
    int changed = 0;
    for (Parameter* p : model->parameters()) {
      if (p->name.find(".mlp.") == std::string::npos || p->name.find("lora_B") == std::string::npos) continue;
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value.ptr<float>()[i] = 0.05f * static_cast<float>(i % 7 - 3);
      ++changed;
    }
    REQUIRE(changed >= 4);  // routed and shared experts of both MoE layers
    // Still held: the packed copy made before the change is what the experts use.
    CHECK(model->forward_backward(batch, 0.01).loss_sum == before);
    model->hold_parameters(false);
    const double after = model->forward_backward(batch, 0.01).loss_sum;
    CHECK(after != before);
    // Held again: packed from the current values.
    model->hold_parameters(true);
    CHECK(model->forward_backward(batch, 0.01).loss_sum == after);
    model->hold_parameters(false);
  }
}

TEST_CASE("the trainer's held adapters are packed again after every optimizer step", "[model][train]") {
  // Two micro-batches per step use one packed copy; each step's optimizer update must reach the
  // next step's forward. The same model, never held, packs at every forward: the runs must agree
  // exactly, step by step. With a copy kept past a step (the experts' B would stay at its
  // initial zero in the forwards) the second step's loss would differ.
  const Config c = deferred_config();
  auto cpu = kernels::make_cpu_backend();
  auto held_model = make_model(c, *cpu);
  auto plain_model = make_model(c, *cpu);
  NeverHeld never_held(*plain_model);
  SyntheticData held_data(c.data, c.model.vocab_size), plain_data(c.data, c.model.vocab_size);
  TrainerOptions options;
  options.train = c.train;
  options.data = c.data;
  options.logging = c.logging;
  Trainer held(options, *held_model, [&] { return held_data.next(); });
  Trainer plain(options, never_held, [&] { return plain_data.next(); });
  for (int step = 0; step < c.train.steps; ++step) {
    INFO("step " << step + 1);
    const StepRecord a = held.train_step(), b = plain.train_step();
    REQUIRE(!a.skipped);
    CHECK(a.loss == b.loss);
    CHECK(a.grad_norm == b.grad_norm);
    CHECK(a.aux_loss == b.aux_loss);
    CHECK(a.max_expert_load == b.max_expert_load);
  }
  const std::vector<Tensor> a = adapter_values(*held_model), b = adapter_values(*plain_model);
  for (size_t i = 0; i < a.size(); ++i) CHECK(std::memcmp(a[i].data(), b[i].data(), a[i].nbytes()) == 0);
}
