// CUDA router forward/backward and aux loss against the CPU reference (F64) on the same inputs.
// Forward logits are a random permutation of an evenly spaced grid per token, so selection
// scores have clear gaps and the chosen experts must match index for index (bias and noise
// steps of 1/65536 are far below the gaps); one case has exact ties, which must go to the lower index
// on both backends. Outputs are poisoned with NaN (indices with -1 bytes) first.
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_support.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

// [tokens, experts] logits: each row a random permutation of -3 + 6 * i / experts.
Operand grid_logits(int64_t tokens, int64_t experts, uint64_t seed) {
  Tensor host({tokens, experts}, DType::kF64);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> rank(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(rank.begin(), rank.end(), 0);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (int64_t e = 0; e < experts; ++e) {
      host.ptr<double>()[t * experts + e] = -3.0 + 6.0 * static_cast<double>(rank[e]) / static_cast<double>(experts);
    }
  }
  return operand_from_host(std::move(host), DType::kF32);
}

// Values k / 65536 for k in [0, 3): exact in every dtype and far below the score gaps (>= 1e-3).
Operand step_bias(int64_t experts, uint64_t seed) {
  Tensor host({experts}, DType::kF64);
  std::mt19937_64 rng(seed);
  for (int64_t e = 0; e < experts; ++e) host.ptr<double>()[e] = static_cast<double>(rng() % 3) / 65536.0;
  return operand_from_host(std::move(host), DType::kF32);
}

struct RouterCase {
  const char* name;
  int64_t tokens, experts, top_k, num_groups, topk_groups;
  kernels::RouterScoring scoring;
  bool bias, noise, normalize, ties;
  double scaling;
};

void check_router_case(const RouterCase& c, uint64_t seed) {
  INFO(c.name);
  Operand logits = grid_logits(c.tokens, c.experts, seed);
  if (c.ties) {
    // Every expert of every token alike: the lowest groups and experts must win.
    for (int64_t i = 0; i < logits.host.numel(); ++i) logits.host.ptr<double>()[i] = 0.375;
    round_and_upload(logits, DType::kF32);
  }
  Operand bias = c.bias ? step_bias(c.experts, seed + 1) : Operand{};
  // Noise: tiny steps like the bias, so that gaps stay clear.
  Operand noise;
  if (c.noise) {
    noise = step_bias(c.tokens * c.experts, seed + 2);
  }
  Operand scores = output_operand({c.tokens, c.experts}, DType::kF32);
  Operand weight = output_operand({c.tokens, c.top_k}, DType::kF32);
  Operand index = int_output_operand({c.tokens, c.top_k});

  const auto router_args = [&](BackendSide on) {
    kernels::RouterArgs args;
    args.scoring = c.scoring;
    args.top_k = c.top_k;
    args.num_groups = c.num_groups;
    args.topk_groups = c.topk_groups;
    args.normalize = c.normalize;
    args.scaling = c.scaling;
    args.scores = on(scores);
    args.topk_index = on(index);
    args.topk_weight = on(weight);
    args.logits = on(logits);
    if (c.bias) args.bias = on(bias);
    if (c.noise) args.noise = on(noise).reshaped(Shape{c.tokens, c.experts});
    return args;
  };
  gpu().router_forward(router_args(kGpu));
  cpu().router_forward(router_args(kCpu));

  expect_same_ints(index.dev, index.host, "topk_index");
  CUDA_TEST_EXPECT_CLOSE(scores.dev, scores.host.view(), tolerance_for(DType::kF32), "scores");
  CUDA_TEST_EXPECT_CLOSE(weight.dev, weight.host.view(), tolerance_for(DType::kF32), "topk_weight");
  if (c.ties) {
    // Lowest indices first: with equal scores the CPU picks experts 0, 1, ... of group 0 first.
    for (int64_t j = 0; j < c.top_k; ++j) CHECK(index.host.ptr<int32_t>()[j] == j);
  }
}

TEST_CASE("cuda router_forward matches the CPU reference index for index") {
  using kernels::RouterScoring;
  const RouterCase cases[] = {
      {"sigmoid, one group, bias", 96, 64, 6, 1, 1, RouterScoring::kSigmoid, true, false, true, false, 2.5},
      {"sigmoid, 8 groups keep 3, bias", 96, 64, 6, 8, 3, RouterScoring::kSigmoid, true, false, true, false, 2.5},
      {"softmax, 4 groups keep 2, noise", 80, 48, 4, 4, 2, RouterScoring::kSoftmax, false, true, true, false, 1.0},
      {"softmax, no normalisation", 50, 40, 3, 1, 1, RouterScoring::kSoftmax, false, false, false, false, 1.5},
      {"sigmoid, 256 experts top-8 (Kimi dims)", 33, 256, 8, 1, 1, RouterScoring::kSigmoid, true, false, true, false, 2.446},
      {"sigmoid, 1-expert groups", 40, 16, 3, 16, 5, RouterScoring::kSigmoid, true, false, true, false, 1.0},
      {"exact ties go to the lower index", 8, 32, 5, 4, 2, RouterScoring::kSigmoid, false, false, true, true, 1.0},
  };
  uint64_t seed = 1000;
  for (const RouterCase& c : cases) check_router_case(c, seed += 10);
}

// Random top-k indices: `top_k` distinct experts per token.
Operand random_topk(int64_t tokens, int64_t experts, int64_t top_k, uint64_t seed) {
  std::vector<int32_t> values;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> all(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    values.insert(values.end(), all.begin(), all.begin() + top_k);
  }
  return int_operand(values, Shape{tokens, top_k});
}

TEST_CASE("cuda router_backward matches the CPU reference") {
  using kernels::RouterScoring;
  const int64_t tokens = 70, experts = 48, top_k = 5;
  uint64_t seed = 2000;
  for (RouterScoring scoring : {RouterScoring::kSigmoid, RouterScoring::kSoftmax}) {
    for (bool normalize : {true, false}) {
      for (bool extra : {true, false}) {
        INFO("softmax " << (scoring == RouterScoring::kSoftmax) << " normalize " << normalize << " extra " << extra);
        Operand scores = random_operand({tokens, experts}, DType::kF32, seed += 10, 0.01, 0.99);
        Operand index = random_topk(tokens, experts, top_k, seed + 1);
        Operand dweight = random_operand({tokens, top_k}, DType::kF32, seed + 2);
        Operand dextra = random_operand({tokens, experts}, DType::kF32, seed + 3);
        Operand dlogits = output_operand({tokens, experts}, DType::kF32);
        const auto backward_args = [&](BackendSide on) {
          kernels::RouterBackwardArgs args;
          args.scoring = scoring;
          args.normalize = normalize;
          args.scaling = 1.75;
          args.dlogits = on(dlogits);
          args.dtopk_weight = on(dweight);
          if (extra) args.dscores_extra = on(dextra);
          args.scores = on(scores);
          args.topk_index = on(index);
          return args;
        };
        gpu().router_backward(backward_args(kGpu));
        cpu().router_backward(backward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(dlogits.dev, dlogits.host.view(), tolerance_for(DType::kF32), "dlogits");
      }
    }
  }
}

TEST_CASE("cuda aux_loss matches the CPU reference: sequence-wise and batch-wise segments") {
  const int64_t tokens = 96, experts = 24, top_k = 3;
  uint64_t seed = 3000;
  for (int64_t segment : {int64_t{16}, int64_t{96}, int64_t{1}}) {
    INFO("tokens_per_segment " << segment);
    Operand scores = random_operand({tokens, experts}, DType::kF32, seed += 10, 0.01, 0.99);
    Operand index = random_topk(tokens, experts, top_k, seed + 1);
    Operand loss = output_operand({1}, DType::kF32);
    Operand dscores = output_operand({tokens, experts}, DType::kF32);
    const auto aux_loss_args = [&](BackendSide on) {
      kernels::AuxLossArgs args;
      args.tokens_per_segment = segment;
      args.coef = 0.013;
      args.loss = on(loss);
      args.dscores = on(dscores);
      args.scores = on(scores);
      args.topk_index = on(index);
      return args;
    };
    gpu().aux_loss(aux_loss_args(kGpu));
    cpu().aux_loss(aux_loss_args(kCpu));
    CUDA_TEST_EXPECT_CLOSE(loss.dev, loss.host.view(), tolerance_for(DType::kF32), "loss");
    CUDA_TEST_EXPECT_CLOSE(dscores.dev, dscores.host.view(), tolerance_for(DType::kF32), "dscores");
  }
}

}  // namespace
