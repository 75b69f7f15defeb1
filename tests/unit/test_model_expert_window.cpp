// train.expert_window: a step's micro-batches run w at a time as one packed pass, and the step
// equals the sequential micro-batches. Per-row and per-segment work (norms, mixers within their
// segments, router, each micro-batch's own noise stream, expert rows, the combine, the loss) is
// the same arithmetic in either, so every micro-batch's loss sum is bit for bit the same, and so
// is the step's sum of them; the adapters' gradients sum over a window's rows in one reduction
// instead of one per micro-batch, so they agree to rounding (F64 here). grad_accum 3 and 4 with
// windows 2 and 3 give partial last windows.
#include <memory>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/model.h"
#include "core/train/trainer.h"
#include "tests/support/model_gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct Case {
  const char* name;
  Config config;
  std::vector<std::string> targets;
  int64_t ffn_chunk_tokens = 0;
};

// Every mixer (MLA, KDA, DSA) and feed-forward kind (dense, routed MoE with a shared expert, K3's
// latent MoE with Block Attention Residuals), router noise on (each micro-batch must keep its own
// stream), the aux loss of both kinds (each micro-batch's own statistics), and feed-forward token
// chunks over a window (chunks cross the micro-batches' boundaries).
std::vector<Case> cases() {
  Config plain = tiny_model_config(/*q_lora=*/true);
  plain.model.moe.router_noise = 0.3;
  plain.model.moe.aux_loss_coef = 0.01;
  Config k3 = tiny_k3_config(/*block=*/2);
  k3.model.moe.router_noise = 0.3;
  k3.model.moe.aux_loss_coef = 0.02;
  k3.model.moe.aux_loss_type = "batch";
  Config chunked = tiny_model_config(/*q_lora=*/true);
  chunked.model.moe.router_noise = 0.3;
  return {{"MLA + dense, KDA + MoE, DSA + MoE; sequence aux loss", plain, all_lora_targets(true)},
          {"Kimi K3: latent MoE, attention residuals; batch aux loss", k3,
           {"q_proj", "kv_b_proj", "o_proj", "f_a_proj", "g_a_proj", "experts", "shared_experts", "gate_proj"}},
          {"feed-forward chunks of 12 tokens across the window", chunked, all_lora_targets(true), 12}};
}

struct Step {
  std::vector<double> micro_batch_losses;  // in step order
  double loss_sum = 0.0;                   // added in step order, as the trainer does
  double aux_loss = 0.0;
  std::vector<int64_t> expert_rows;        // every MoE layer's rows per expert, over the step
  std::vector<Tensor> gradients;
  uint64_t forward_count = 0;
};

// Two steps of grad_accum micro-batches (the second sees the first's forward count, so its router
// noise differs), queued `window` at a time; the second's results and gradients.
Step run(const Case& c, int64_t grad_accum, int64_t window, bool recompute) {
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = c.targets;
  options.recompute = recompute;
  options.ffn_chunk_tokens = c.ffn_chunk_tokens;
  options.aux_loss_weight = 1.0 / static_cast<double>(grad_accum);
  GradcheckModel m(c.config, options, 100, 3);
  std::vector<Batch> batches;
  int64_t targets = 0;
  for (int64_t j = 0; j < grad_accum; ++j) {
    batches.push_back(tiny_batch(c.config.model.vocab_size, 11 + static_cast<uint64_t>(j)));
    targets += batches.back().num_targets();
  }
  const double grad_scale = 1.0 / static_cast<double>(targets);
  Step step;
  for (int pass = 0; pass < 2; ++pass) {
    for (Parameter* p : m.model->parameters()) m.backend->fill(p->grad, 0.0);
    step = Step{};
    m.model->hold_parameters(true);
    std::vector<PendingStep> pending;
    for (size_t first = 0; first < batches.size(); first += static_cast<size_t>(window)) {
      std::vector<const Batch*> parts;
      for (size_t i = first; i < std::min(batches.size(), first + static_cast<size_t>(window)); ++i) {
        parts.push_back(&batches[i]);
      }
      pending.push_back(window == 1 ? m.model->forward_backward_async(*parts.front(), grad_scale)
                                    : m.model->forward_backward_window_async(parts, grad_scale));
    }
    m.model->hold_parameters(false);
    for (PendingStep& p : pending) {
      const StepResult& r = p.get();
      for (double loss : r.micro_batch_loss_sums) {
        step.micro_batch_losses.push_back(loss);
        step.loss_sum += loss;
      }
      step.aux_loss += r.aux_loss;
      size_t at = 0;  // every MoE layer's experts, one after another
      for (const std::vector<int64_t>& layer : r.expert_rows) {
        for (int64_t rows : layer) {
          if (at == step.expert_rows.size()) step.expert_rows.push_back(0);
          step.expert_rows[at++] += rows;
        }
      }
    }
  }
  step.forward_count = m.model->forward_count();
  for (Parameter* p : m.model->parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    m.backend->copy(g, p->grad);
    step.gradients.push_back(std::move(g));
  }
  return step;
}

}  // namespace

TEST_CASE("expert windows: the same losses, aux loss, expert rows and gradients as sequential micro-batches",
          "[model][expert_window]") {
  for (const Case& c : cases()) {
    for (bool recompute : {false, true}) {
      for (int64_t grad_accum : {3, 4}) {
        const Step sequential = run(c, grad_accum, 1, recompute);
        REQUIRE(sequential.micro_batch_losses.size() == static_cast<size_t>(grad_accum));
        REQUIRE(sequential.loss_sum > 0.0);
        if (c.config.model.moe.aux_loss_coef > 0.0) REQUIRE(sequential.aux_loss > 0.0);
        for (int64_t window : {2, 3}) {
          INFO(c.name << ", recompute " << recompute << ", grad_accum " << grad_accum << ", window " << window);
          const Step windowed = run(c, grad_accum, window, recompute);
          CHECK(windowed.micro_batch_losses == sequential.micro_batch_losses);
          CHECK(windowed.loss_sum == sequential.loss_sum);
          CHECK(windowed.aux_loss == Approx(sequential.aux_loss).epsilon(1e-13));
          CHECK(windowed.expert_rows == sequential.expert_rows);
          CHECK(windowed.forward_count == sequential.forward_count);
          check_same_gradients(windowed.gradients, sequential.gradients, 1e-12, 1e-15);
        }
      }
    }
  }
}

// Through the trainer: the same data, gradient scale and losses. The first step's loss is the
// same bit for bit; later steps start from adapters updated with gradients that differ in
// rounding, so they agree to rounding.
TEST_CASE("expert windows in the trainer: the step losses of sequential micro-batches", "[train][expert_window]") {
  const Case c = cases().front();
  auto losses = [&](int64_t window) {
    ModelOptions options;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = c.targets;
    options.aux_loss_weight = 1.0 / 3.0;
    GradcheckModel m(c.config, options, 100, 3);
    TrainerOptions trainer_options;
    trainer_options.train.steps = 3;
    trainer_options.train.lr = 1e-2;
    trainer_options.train.warmup_steps = 0;
    trainer_options.train.expert_window = window;
    trainer_options.data.seq_len = 8;
    trainer_options.data.micro_batch = 2;
    trainer_options.data.grad_accum = 3;
    trainer_options.logging.every = 1000;
    uint64_t seed = 21;
    Trainer trainer(trainer_options, *m.model, [&] { return tiny_batch(c.config.model.vocab_size, seed++); });
    return trainer.run();
  };
  const std::vector<double> sequential = losses(1);
  for (int64_t window : {2, 3}) {
    INFO("window " << window);
    const std::vector<double> windowed = losses(window);
    REQUIRE(windowed.size() == sequential.size());
    CHECK(windowed[0] == sequential[0]);
    for (size_t s = 1; s < sequential.size(); ++s) CHECK(windowed[s] == Approx(sequential[s]).epsilon(1e-12));
  }
}
