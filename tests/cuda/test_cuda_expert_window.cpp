// train.expert_window on the GPU: a step of 3 micro-batches run in windows of 2 and 3 (one packed
// pass each, so the grouped GEMMs take the rows of several micro-batches and run other tile
// shapes) against the same micro-batches one at a time, BF16 on CUDA, router noise and the aux
// loss on. The CPU test (tests/unit/test_model_expert_window.cpp) shows the two equal bit for bit
// in their losses; here the kernels may round a row differently with the GEMM's shape, so the
// bound is BF16's: each micro-batch's loss to 1e-2 relative, each adapter gradient to 3e-2 of its
// norm, and every gradient must be non-zero.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// tiny_model_config's mixers (MLA, KDA, DSA) at the offload test's width, 32 experts top-4 so that
// a window changes every expert's row count.
Config window_config() {
  Config c = tiny_model_config(true);
  ModelConfig& m = c.model;
  m.hidden_size = 256;
  m.moe.num_experts = 32;
  m.moe.top_k = 4;
  m.moe.num_groups = 1;
  m.moe.topk_groups = 1;
  m.moe.expert_intermediate_size = 64;
  m.moe.router_noise = 0.1;
  m.moe.aux_loss_coef = 0.01;
  m.max_position_embeddings = 512;
  c.data.seq_len = 256;
  return c;
}

// Two windows of 256 tokens, three documents.
Batch batch_of(int64_t vocab, uint64_t seed) { return packed_batch(vocab, seed, 256, {0, 100, 256, 512}); }

struct Step {
  std::vector<double> losses;       // per micro-batch
  std::vector<Tensor> gradients;    // host F64
};

Step run(kernels::Backend& cuda, const ModelSpec& spec, bool recompute, int64_t window) {
  ModelOptions options;
  options.dtype = DType::kBF16;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = all_lora_targets(true);
  options.recompute = recompute;
  options.aux_loss_weight = 1.0 / 3.0;
  Model model(spec, cuda, options);
  model.init_random_weights();
  uint64_t seed = 100;
  for (Parameter* p : model.parameters()) {
    Tensor host(p->value.shape(), DType::kF32);
    fill_random(host, seed++, 0.02, 0.1);
    cuda.copy(p->value, host);
  }
  std::vector<Batch> batches;
  int64_t targets = 0;
  for (uint64_t j = 0; j < 3; ++j) {
    batches.push_back(batch_of(spec.config.vocab_size, 31 + j));
    targets += batches.back().num_targets();
  }
  const double grad_scale = 1.0 / static_cast<double>(targets);
  std::vector<PendingStep> pending;
  model.hold_parameters(true);
  for (size_t first = 0; first < batches.size(); first += static_cast<size_t>(window)) {
    std::vector<const Batch*> parts;
    for (size_t i = first; i < std::min(batches.size(), first + static_cast<size_t>(window)); ++i) {
      parts.push_back(&batches[i]);
    }
    pending.push_back(window == 1 ? model.forward_backward_async(*parts.front(), grad_scale)
                                  : model.forward_backward_window_async(parts, grad_scale));
  }
  model.hold_parameters(false);
  Step step;
  for (PendingStep& p : pending) {
    for (double loss : p.get().micro_batch_loss_sums) step.losses.push_back(loss);
  }
  for (Parameter* p : model.parameters()) {
    // The device's F32 gradient, widened on the host (a copy keeps its dtype).
    Tensor staged(p->grad.shape(), p->grad.dtype());
    cuda.copy(staged, p->grad);
    Tensor g(p->grad.shape(), DType::kF64);
    convert_host(g, staged);
    step.gradients.push_back(std::move(g));
  }
  return step;
}

double norm(const Tensor& t) {
  double sum = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) sum += t.ptr<double>()[i] * t.ptr<double>()[i];
  return std::sqrt(sum);
}

}  // namespace

TEST_CASE("cuda expert windows: the losses and gradients of the micro-batches one at a time", "[cuda][model]") {
  std::unique_ptr<kernels::Backend> cuda = kernels::make_cuda_backend();
  const ModelSpec spec = resolve_model_spec(window_config());
  for (bool recompute : {true, false}) {
    const Step sequential = run(*cuda, spec, recompute, 1);
    REQUIRE(sequential.losses.size() == 3);
    for (int64_t window : {2, 3}) {
      INFO("recompute " << recompute << ", window " << window);
      const Step windowed = run(*cuda, spec, recompute, window);
      REQUIRE(windowed.losses.size() == 3);
      for (size_t j = 0; j < 3; ++j) {
        CHECK(std::fabs(windowed.losses[j] - sequential.losses[j]) <= 1e-2 * std::fabs(sequential.losses[j]));
      }
      REQUIRE(windowed.gradients.size() == sequential.gradients.size());
      for (size_t i = 0; i < sequential.gradients.size(); ++i) {
        const double scale = norm(sequential.gradients[i]);
        Tensor diff(sequential.gradients[i].shape(), DType::kF64);
        for (int64_t e = 0; e < diff.numel(); ++e) {
          diff.ptr<double>()[e] = windowed.gradients[i].ptr<double>()[e] - sequential.gradients[i].ptr<double>()[e];
        }
        INFO("gradient " << i << ": |diff| " << norm(diff) << ", |sequential| " << scale);
        CHECK(scale > 0.0);
        CHECK(norm(diff) <= 3e-2 * scale);
      }
    }
  }
}
