// parallel.ffn_chunk_tokens: the feed-forward halves run over token chunks, and the step equals
// the unchunked one. Per-row work (norms, router, noise, expert rows, the combine) is the same
// arithmetic in either, so the loss and the expert statistics are bit for bit the same; the
// adapters' gradients sum over the chunks in a different order, so they agree to rounding.
#include <memory>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/model.h"
#include "tests/support/model_gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

struct Case {
  const char* name;
  Config config;
  std::vector<std::string> targets;
};

// Every feed-forward kind (dense, routed MoE with a shared expert, K3's latent MoE) behind every
// mixer (MLA, KDA, DSA), with Block Attention Residuals in the K3 case; router noise on, so the
// chunks must draw the rows' own noise.
std::vector<Case> cases() {
  Config plain = tiny_model_config(/*q_lora=*/true);
  plain.model.moe.router_noise = 0.3;
  Config k3 = tiny_k3_config(/*block=*/2);
  k3.model.moe.router_noise = 0.3;
  return {{"MLA + dense, KDA + MoE, DSA + MoE", plain, all_lora_targets(true)},
          {"Kimi K3: latent MoE, attention residuals", k3,
           {"q_proj", "kv_b_proj", "o_proj", "f_a_proj", "g_a_proj", "experts", "shared_experts", "gate_proj"}}};
}

struct Step {
  StepResult result;
  std::vector<Tensor> gradients;
};

// Two steps (the second sees the first's forward count, so its router noise differs), the
// second's result and gradients.
Step run(const Case& c, bool recompute, int64_t chunk_tokens) {
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = c.targets;
  options.recompute = recompute;
  options.ffn_chunk_tokens = chunk_tokens;
  GradcheckModel m(c.config, options, 100, 3);
  m.model->forward_backward(m.batch, m.grad_scale);
  Step step;
  for (Parameter* p : m.model->parameters()) m.backend->fill(p->grad, 0.0);
  step.result = m.model->forward_backward(m.batch, m.grad_scale);
  for (Parameter* p : m.model->parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    m.backend->copy(g, p->grad);
    step.gradients.push_back(std::move(g));
  }
  return step;
}

}  // namespace

TEST_CASE("feed-forward token chunks: the same loss, statistics and gradients as the whole micro-batch",
          "[model][chunks]") {
  for (const Case& c : cases()) {
    for (bool recompute : {false, true}) {
      const Step whole = run(c, recompute, 0);
      REQUIRE(whole.result.loss_sum > 0.0);
      // 16 tokens: chunks of 4 x 4 (5), 6 uneven ones (3), 3 of 5-6 (7), one (16: no chunking).
      for (int64_t chunk : {5, 3, 7, 16}) {
        INFO(c.name << ", recompute " << recompute << ", chunks of at most " << chunk << " tokens");
        const Step chunked = run(c, recompute, chunk);
        CHECK(chunked.result.loss_sum == whole.result.loss_sum);
        CHECK(chunked.result.expert_load_max == whole.result.expert_load_max);
        CHECK(chunked.result.expert_load_min == whole.result.expert_load_min);
        check_same_gradients(chunked.gradients, whole.gradients, 1e-12, 1e-15);
      }
    }
  }
}

// (The config rule that refuses the pair is test_config's; this is the model's own guard.)
TEST_CASE("feed-forward token chunks refuse the MoE aux loss, which needs the whole micro-batch", "[model][chunks]") {
  Config config = tiny_model_config(/*q_lora=*/true);
  config.model.moe.aux_loss_coef = 0.01;
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = {"experts"};
  options.ffn_chunk_tokens = 4;
  GradcheckModel m(config, options, 100, 3);
  try {
    m.model->forward_backward(m.batch, m.grad_scale);
    FAIL("a chunked step with the aux loss ran");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    const std::string message = e.what();
    INFO(message);
    CHECK(message.find("aux loss") != std::string::npos);
    CHECK(message.find("parallel.ffn_chunk_tokens") != std::string::npos);
  }
}
