// CPU MoE router and aux loss: hand-built routing cases (group limit, bias, noise, scaling, ties,
// softmax scoring) with expected values worked out from the definitions, and finite-difference
// checks of router_backward and aux_loss in double.
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/cpu/reference.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

bool close(double a, double b, double tol = 1e-12) { return std::fabs(a - b) <= tol * (1.0 + std::fabs(b)); }

struct Routed {
  Tensor scores, index, weight;
};

// Routes `logits` ([tokens, experts]) with the options in `base` (its tensors are set here).
template <typename T = double>
Routed route(const Tensor& logits, RouterArgs base, const Tensor* bias = nullptr, const Tensor* noise = nullptr) {
  const int64_t tokens = logits.size(0);
  Routed r{Tensor(logits.shape(), logits.dtype()), Tensor({tokens, base.top_k}, DType::kI32),
           Tensor({tokens, base.top_k}, logits.dtype())};
  base.scores = r.scores;
  base.topk_index = r.index;
  base.topk_weight = r.weight;
  base.logits = logits;
  if (bias) base.bias = *bias;
  if (noise) base.noise = *noise;
  cpu::router_forward<T>(base);
  return r;
}

RouterArgs options(int64_t top_k, int64_t groups, int64_t topk_groups, bool normalize = true, double scaling = 1.0,
                   RouterScoring scoring = RouterScoring::kSigmoid) {
  RouterArgs a;
  a.top_k = top_k;
  a.num_groups = groups;
  a.topk_groups = topk_groups;
  a.normalize = normalize;
  a.scaling = scaling;
  a.scoring = scoring;
  return a;
}

std::vector<int32_t> indices(const Routed& r, int64_t token = 0) { return i32_row(r.index, token); }

}  // namespace

TEST_CASE("router keeps only the best groups", "[router]") {
  // Four groups of two. Expert 6 has the highest score of all, but its partner is weak, so its
  // group's top-2 sum (0.953 + 0.018) loses to groups 0 (0.731 * 2) and 1 (0.690 + 0.711).
  const std::vector<double> l = {1.0, 1.0, 0.8, 0.9, -1.0, -1.0, 3.0, -4.0};
  Tensor logits = tensor_of(l, {1, 8});

  Routed limited = route(logits, options(2, 4, 2));
  // Experts 0 and 1 tie; the lower index comes first.
  CHECK(indices(limited) == std::vector<int32_t>{0, 1});
  CHECK(close(limited.weight.ptr<double>()[0], 0.5));
  CHECK(close(limited.weight.ptr<double>()[1], 0.5));
  for (int e = 0; e < 8; ++e) CHECK(close(limited.scores.ptr<double>()[e], sigmoid(l[e])));

  // Keeping every group, expert 6 wins: the limit above is what excluded it.
  Routed open = route(logits, options(2, 4, 4));
  CHECK(indices(open) == std::vector<int32_t>{6, 0});

  // topk_groups = 3 keeps groups 0, 1 and 3 (group 2's sum 0.54 is the lowest), so expert 6 is back.
  Routed three = route(logits, options(3, 4, 3));
  CHECK(indices(three) == std::vector<int32_t>{6, 0, 1});
  // topk_groups = 2 with top_k = 3 reaches into group 1: its best expert is 3 (0.9 > 0.8).
  Routed two = route(logits, options(3, 4, 2));
  CHECK(indices(two) == std::vector<int32_t>{0, 1, 3});
}

TEST_CASE("router bias moves the selection, not the weights", "[router]") {
  const std::vector<double> l = {0.5, 0.4, 0.3, 0.2};
  Tensor logits = tensor_of(l, {1, 4});
  Tensor bias = tensor_of({0.0, 0.0, 0.5, 0.0}, {4});
  Routed r = route(logits, options(2, 1, 1, true, 2.5), &bias);
  REQUIRE(indices(r) == std::vector<int32_t>{2, 0});
  const double s0 = sigmoid(0.5), s2 = sigmoid(0.3);
  CHECK(close(r.weight.ptr<double>()[0], 2.5 * s2 / (s0 + s2)));
  CHECK(close(r.weight.ptr<double>()[1], 2.5 * s0 / (s0 + s2)));
  // Scores saved for backward are the unbiased ones.
  CHECK(close(r.scores.ptr<double>()[2], s2));

  Routed unbiased = route(logits, options(2, 1, 1, true, 2.5));
  CHECK(indices(unbiased) == std::vector<int32_t>{0, 1});
}

TEST_CASE("router noise is added to the selection scores", "[router]") {
  Tensor logits = tensor_of({0.5, 0.4, 0.3, 0.2, 0.5, 0.4, 0.3, 0.2}, {2, 4});
  Tensor noise = tensor_of({0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0}, {2, 4});
  Routed r = route(logits, options(1, 1, 1), nullptr, &noise);
  CHECK(indices(r, 0) == std::vector<int32_t>{3});
  CHECK(indices(r, 1) == std::vector<int32_t>{0});
  CHECK(close(r.weight.ptr<double>()[0], 1.0));  // normalised over one expert
}

TEST_CASE("router weights without normalisation are scaled scores", "[router]") {
  const std::vector<double> l = {-0.3, 1.2, 0.7, 0.1, -2.0, 0.4};
  Tensor logits = tensor_of(l, {1, 6});
  Routed r = route(logits, options(3, 1, 1, false, 1.5));
  REQUIRE(indices(r) == std::vector<int32_t>{1, 2, 5});
  CHECK(close(r.weight.ptr<double>()[0], 1.5 * sigmoid(1.2)));
  CHECK(close(r.weight.ptr<double>()[1], 1.5 * sigmoid(0.7)));
  CHECK(close(r.weight.ptr<double>()[2], 1.5 * sigmoid(0.4)));
}

TEST_CASE("router ties go to the lower index", "[router]") {
  Tensor logits = tensor_of(std::vector<double>(8, 0.25), {1, 8});
  CHECK(indices(route(logits, options(3, 1, 1))) == std::vector<int32_t>{0, 1, 2});
  // Tied groups: the lower group wins too.
  CHECK(indices(route(logits, options(2, 4, 1))) == std::vector<int32_t>{0, 1});
  CHECK(indices(route(logits, options(4, 4, 2))) == std::vector<int32_t>{0, 1, 2, 3});
}

TEST_CASE("router never picks an expert of a dropped group", "[router]") {
  // Every selection score is negative (bias -1). transformers fills dropped experts with 0.0,
  // which would then beat every kept expert; we exclude them instead.
  Tensor logits = tensor_of({0.1, 0.3, -0.2, -0.1}, {1, 4});
  Tensor bias = tensor_of({-1.0, -1.0, -1.0, -1.0}, {4});
  Routed r = route(logits, options(2, 2, 1), &bias);
  CHECK(indices(r) == std::vector<int32_t>{1, 0});
}

TEST_CASE("router with softmax scoring", "[router]") {
  const std::vector<double> l = {1.0, 2.0, 0.0, -1.0};
  Tensor logits = tensor_of(l, {1, 4});
  Routed r = route(logits, options(2, 1, 1, false, 1.0, RouterScoring::kSoftmax));
  double z = 0.0;
  for (double x : l) z += std::exp(x);
  for (int e = 0; e < 4; ++e) CHECK(close(r.scores.ptr<double>()[e], std::exp(l[e]) / z));
  CHECK(indices(r) == std::vector<int32_t>{1, 0});
  CHECK(close(r.weight.ptr<double>()[0], std::exp(2.0) / z));

  // Group score is the top-2 sum for softmax as well: group 0 has the single best expert
  // (e^2 vs e^1.8) but group 1's pair sums higher, so group 1 is kept (a max rule would keep 0).
  Tensor grouped = tensor_of({2.0, -5.0, 1.8, 1.8}, {1, 4});
  Routed g = route(grouped, options(1, 2, 1, true, 1.0, RouterScoring::kSoftmax));
  CHECK(indices(g) == std::vector<int32_t>{2});
  CHECK(close(g.weight.ptr<double>()[0], 1.0));
}

TEST_CASE("router in float selects like double on separated scores", "[router]") {
  Tensor logits64 = random_tensor({6, 16}, DType::kF64, 5, 0.1, 3.0);
  Tensor logits32({6, 16}, DType::kF32);
  for (int64_t i = 0; i < logits64.numel(); ++i) logits32.ptr<float>()[i] = static_cast<float>(logits64.ptr<double>()[i]);
  Routed r64 = route<double>(logits64, options(4, 4, 2, true, 2.0));
  Routed r32 = route<float>(logits32, options(4, 4, 2, true, 2.0));
  for (int64_t i = 0; i < r64.index.numel(); ++i) {
    CHECK(r64.index.ptr<int32_t>()[i] == r32.index.ptr<int32_t>()[i]);
    CHECK(std::fabs(r64.weight.ptr<double>()[i] - r32.weight.ptr<float>()[i]) < 1e-6);
  }
}

TEST_CASE("router backward matches finite differences", "[router][grad]") {
  const int64_t tokens = 5, experts = 8;
  struct Case {
    RouterScoring scoring;
    bool normalize;
    bool extra;
  };
  for (Case cs : {Case{RouterScoring::kSigmoid, true, false}, Case{RouterScoring::kSigmoid, false, true},
                  Case{RouterScoring::kSigmoid, true, true}, Case{RouterScoring::kSoftmax, true, true},
                  Case{RouterScoring::kSoftmax, false, false}}) {
    INFO("softmax " << (cs.scoring == RouterScoring::kSoftmax) << " normalize " << cs.normalize << " extra "
                    << cs.extra);
    RouterArgs opts = options(3, 4, 2, cs.normalize, 2.5, cs.scoring);
    // Logits drawn from well separated levels so no selection or group score is near a tie.
    Tensor logits({tokens, experts}, DType::kF64);
    TestRng rng(17);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> levels;
      for (int64_t e = 0; e < experts; ++e) levels.push_back(-2.0 + 0.5 * static_cast<double>(e));
      for (int64_t e = experts - 1; e > 0; --e) std::swap(levels[e], levels[rng.below(e + 1)]);
      for (int64_t e = 0; e < experts; ++e) logits.ptr<double>()[t * experts + e] = levels[e] + rng.uniform(0.0, 0.1);
    }
    Tensor bias = random_tensor({experts}, DType::kF64, 18, 0.0, 0.05);
    Tensor dweight = random_tensor({tokens, 3}, DType::kF64, 19);
    Tensor dextra = random_tensor({tokens, experts}, DType::kF64, 20);

    Routed base = route(logits, opts, &bias);
    RouterBackwardArgs args;
    Tensor dlogits = random_tensor({tokens, experts}, DType::kF64, 21, 5.0, 9.0);  // overwritten
    args.dlogits = dlogits;
    args.dtopk_weight = dweight;
    if (cs.extra) args.dscores_extra = dextra;
    args.scores = base.scores;
    args.topk_index = base.index;
    args.scoring = cs.scoring;
    args.normalize = cs.normalize;
    args.scaling = opts.scaling;
    cpu::router_backward<double>(args);

    bool selection_changed = false;
    auto loss = [&] {
      Routed r = route(logits, opts, &bias);
      for (int64_t i = 0; i < r.index.numel(); ++i)
        selection_changed |= r.index.ptr<int32_t>()[i] != base.index.ptr<int32_t>()[i];
      double l = moetrain::testing::dot(dweight, r.weight);
      if (cs.extra) l += moetrain::testing::dot(dextra, r.scores);
      return l;
    };
    check(check_gradient(loss, logits, dlogits, "logits"));
    CHECK_FALSE(selection_changed);
  }
}

namespace {

void run_aux_loss(const Tensor& loss, const Tensor& dscores, const Tensor& scores, const Tensor& index,
                  int64_t tokens_per_segment, double coef) {
  AuxLossArgs args{loss, dscores, scores, index, tokens_per_segment, coef};
  cpu::aux_loss<double>(args);
}

}  // namespace

TEST_CASE("aux loss of a perfectly balanced router is the coefficient", "[aux_loss]") {
  // 4 experts, top-2, 4 tokens per segment: every expert chosen twice (f_e = 1) and uniform
  // scores (P_e = 1/4): L = coef * sum_e 1 * 1/4 = coef. Unnormalised uniform scores give the same.
  Tensor scores = tensor_of(std::vector<double>(16, 0.3), {4, 4});
  Tensor index = i32_tensor({0, 1, 2, 3, 1, 2, 3, 0}, {4, 2});
  Tensor index2 = i32_tensor({0, 1, 2, 3, 1, 2, 3, 0, 0, 1, 2, 3, 1, 2, 3, 0}, {8, 2});
  Tensor scores2 = tensor_of(std::vector<double>(32, 0.7), {8, 4});
  Tensor loss({1}, DType::kF64), dscores({4, 4}, DType::kF64), dscores2({8, 4}, DType::kF64);
  run_aux_loss(loss, dscores, scores, index, 2, 0.01);
  CHECK(close(loss.ptr<double>()[0], 0.01));
  run_aux_loss(loss, dscores2, scores2, index2, 4, 0.25);
  CHECK(close(loss.ptr<double>()[0], 0.25));

  // All tokens on experts 0 and 1 with all score mass there: f = (2, 2, 0, 0), P = (1/2, 1/2, 0, 0).
  Tensor skewed = tensor_of({0.5, 0.5, 0, 0, 0.5, 0.5, 0, 0}, {2, 4});
  Tensor skewed_index = i32_tensor({0, 1, 1, 0}, {2, 2});
  Tensor d2({2, 4}, DType::kF64);
  run_aux_loss(loss, d2, skewed, skewed_index, 2, 1.0);
  CHECK(close(loss.ptr<double>()[0], 2.0));
}

TEST_CASE("aux loss gradient matches finite differences", "[aux_loss][grad]") {
  const int64_t tokens = 6, experts = 5, top_k = 2;
  Tensor scores({tokens, experts}, DType::kF64);
  TestRng rng(3);
  for (int64_t i = 0; i < scores.numel(); ++i) scores.ptr<double>()[i] = rng.uniform(0.05, 1.0);
  Tensor index = i32_tensor({0, 1, 2, 0, 4, 3, 1, 2, 0, 3, 4, 1}, {tokens, top_k});
  Tensor loss({1}, DType::kF64), scratch({1}, DType::kF64);
  Tensor dscores = random_tensor({tokens, experts}, DType::kF64, 9, 5.0, 9.0);  // overwritten
  Tensor scratch_d({tokens, experts}, DType::kF64);
  for (int64_t segment : {int64_t{3}, int64_t{6}, int64_t{1}}) {
    INFO("tokens_per_segment " << segment);
    run_aux_loss(loss, dscores, scores, index, segment, 0.3);
    auto f = [&] {
      run_aux_loss(scratch, scratch_d, scores, index, segment, 0.3);
      return scratch.ptr<double>()[0];
    };
    check(check_gradient(f, scores, dscores, "scores"));
  }
}

TEST_CASE("aux loss matches its definition", "[aux_loss]") {
  // Recomputes L = coef * mean_g sum_e f_e P_e directly for two segments of three tokens.
  const int64_t tokens = 6, experts = 4, top_k = 2, seg = 3;
  const double coef = 0.7;
  Tensor scores({tokens, experts}, DType::kF64);
  TestRng rng(8);
  for (int64_t i = 0; i < scores.numel(); ++i) scores.ptr<double>()[i] = rng.uniform(0.05, 1.0);
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 3, 3, 2, 1, 2, 2, 3};
  Tensor index = i32_tensor(idx, {tokens, top_k});
  double expected = 0.0;
  for (int64_t g = 0; g < 2; ++g) {
    for (int64_t e = 0; e < experts; ++e) {
      double count = 0.0, p = 0.0;
      for (int64_t t = g * seg; t < (g + 1) * seg; ++t) {
        for (int64_t j = 0; j < top_k; ++j) count += idx[t * top_k + j] == e ? 1.0 : 0.0;
        double row = 0.0;
        for (int64_t x = 0; x < experts; ++x) row += scores.ptr<double>()[t * experts + x];
        p += scores.ptr<double>()[t * experts + e] / row / seg;
      }
      expected += coef / 2.0 * (static_cast<double>(experts) / (top_k * seg) * count) * p;
    }
  }
  Tensor loss({1}, DType::kF64), dscores({tokens, experts}, DType::kF64);
  run_aux_loss(loss, dscores, scores, index, seg, coef);
  CHECK(close(loss.ptr<double>()[0], expected));
}

TEST_CASE("aux loss rejects partial segments and bad experts", "[aux_loss]") {
  Tensor scores = tensor_of(std::vector<double>(12, 0.5), {3, 4});
  Tensor index = i32_tensor({0, 1, 2}, {3, 1});
  Tensor loss({1}, DType::kF64), dscores({3, 4}, DType::kF64);
  CHECK_THROWS_AS(run_aux_loss(loss, dscores, scores, index, 2, 1.0), Error);
  Tensor bad = i32_tensor({0, 4, 2}, {3, 1});
  CHECK_THROWS_AS(run_aux_loss(loss, dscores, scores, bad, 3, 1.0), Error);
}

TEST_CASE("router through the CPU backend", "[router][backend]") {
  auto backend = make_cpu_backend();
  Tensor logits = tensor_of({1.0, 1.0, 0.8, 0.9, -1.0, -1.0, 3.0, -4.0}, {1, 8});
  Tensor scores({1, 8}, DType::kF64), index({1, 2}, DType::kI32), weight({1, 2}, DType::kF64);
  RouterArgs args = options(2, 4, 2, true, 3.0);
  args.scores = scores;
  args.topk_index = index;
  args.topk_weight = weight;
  args.logits = logits;
  backend->router_forward(args);
  CHECK(index.ptr<int32_t>()[0] == 0);
  CHECK(index.ptr<int32_t>()[1] == 1);
  CHECK(close(weight.ptr<double>()[0], 1.5));
}
