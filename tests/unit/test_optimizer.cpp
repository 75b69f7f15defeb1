// AdamW through the backend against a plain AdamW written here from Loshchilov & Hutter
// (decoupled decay, bias-corrected moments), and gradient clipping against hand-computed norms.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/parameter.h"
#include "core/train/optimizer.h"
#include "kernels/ops.h"

using moetrain::AdamW;
using moetrain::AdamWOptions;
using moetrain::DType;
using moetrain::Parameter;
using moetrain::Tensor;

namespace {

Parameter make_param(const std::string& name, const std::vector<double>& value, bool weight_decay = true) {
  Parameter p;
  p.name = name;
  p.value = Tensor({static_cast<int64_t>(value.size())}, DType::kF64);
  p.grad = Tensor::zeros({static_cast<int64_t>(value.size())}, DType::kF64);
  for (size_t i = 0; i < value.size(); ++i) p.value.ptr<double>()[i] = value[i];
  p.weight_decay = weight_decay;
  return p;
}

void set_grad(Parameter& p, const std::vector<double>& grad) {
  for (size_t i = 0; i < grad.size(); ++i) p.grad.ptr<double>()[i] = grad[i];
}

std::vector<double> values(const Tensor& t) {
  return std::vector<double>(t.ptr<double>(), t.ptr<double>() + t.numel());
}

bool near(double a, double b, double tolerance) { return std::abs(a - b) <= tolerance * (1.0 + std::abs(b)); }

// The reference: one scalar parameter's AdamW state.
struct ReferenceAdamW {
  double param, m = 0.0, v = 0.0;
  void step(double grad, double lr, const AdamWOptions& o, double weight_decay, int64_t t) {
    param -= lr * weight_decay * param;  // decoupled: the decay never enters the moments
    m = o.beta1 * m + (1 - o.beta1) * grad;
    v = o.beta2 * v + (1 - o.beta2) * grad * grad;
    const double m_hat = m / (1 - std::pow(o.beta1, static_cast<double>(t)));
    const double v_hat = v / (1 - std::pow(o.beta2, static_cast<double>(t)));
    param -= lr * m_hat / (std::sqrt(v_hat) + o.eps);
  }
};

}  // namespace

TEST_CASE("AdamW matches the textbook update, with decay only where asked") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter decayed = make_param("a", {0.5, -1.25, 2.0});
  Parameter plain = make_param("b", {0.75, -0.3}, /*weight_decay=*/false);
  AdamWOptions options;
  options.beta1 = 0.8;
  options.beta2 = 0.95;
  options.eps = 1e-6;
  options.weight_decay = 0.1;
  AdamW adamw(std::vector<Parameter*>{&decayed, &plain}, options, *backend);

  std::vector<ReferenceAdamW> reference = {{0.5}, {-1.25}, {2.0}, {0.75}, {-0.3}};
  const double lrs[4] = {0.01, 0.02, 0.005, 0.03};
  for (int64_t t = 1; t <= 4; ++t) {
    const double d = static_cast<double>(t);
    const std::vector<double> grads = {0.3 * d, -0.7 / d, 1e-3, 0.2 - 0.1 * d, 0.05 * d * d};
    set_grad(decayed, {grads[0], grads[1], grads[2]});
    set_grad(plain, {grads[3], grads[4]});
    adamw.step(lrs[t - 1]);
    for (size_t i = 0; i < reference.size(); ++i) {
      reference[i].step(grads[i], lrs[t - 1], options, i < 3 ? options.weight_decay : 0.0, t);
    }
    CHECK(adamw.step_count() == t);
    // grads are zeroed for the next accumulation
    for (double g : values(decayed.grad)) CHECK(g == 0.0);
    for (double g : values(plain.grad)) CHECK(g == 0.0);
  }
  const std::vector<double> a = values(decayed.value), b = values(plain.value);
  const std::vector<double> got = {a[0], a[1], a[2], b[0], b[1]};
  for (size_t i = 0; i < reference.size(); ++i) CHECK(near(got[i], reference[i].param, 1e-12));

  // The exposed state is the moments, by name.
  const auto state = adamw.gather_state();
  REQUIRE(state.size() == 2);
  CHECK(state[0].name == "a");
  CHECK(state[1].name == "b");
  CHECK(near(state[0].exp_avg.ptr<double>()[1], reference[1].m, 1e-12));
  CHECK(near(state[1].exp_avg_sq.ptr<double>()[1], reference[4].v, 1e-12));
}

TEST_CASE("weight decay alone shrinks a parameter by lr * wd per step") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter p = make_param("w", {2.0});
  AdamWOptions options;
  options.weight_decay = 0.5;
  AdamW adamw({&p}, options, *backend);
  adamw.step(0.1);  // zero grad: the Adam part is 0 / (0 + eps) = 0
  CHECK(near(values(p.value)[0], 2.0 * (1 - 0.1 * 0.5), 1e-15));
}

TEST_CASE("global grad norm and clipping") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter a = make_param("a", {0, 0}), b = make_param("b", {0});
  AdamW adamw(std::vector<Parameter*>{&a, &b}, AdamWOptions{}, *backend);

  set_grad(a, {3, 4});
  set_grad(b, {12});
  CHECK(near(adamw.global_grad_norm(), 13.0, 1e-15));  // sqrt(9 + 16 + 144)

  SECTION("a norm above the limit is scaled down to it") {
    CHECK(near(adamw.clip_gradients(6.5), 13.0, 1e-15));  // returns the norm before clipping
    CHECK(values(a.grad) == std::vector<double>({1.5, 2.0}));
    CHECK(values(b.grad) == std::vector<double>({6.0}));
    CHECK(near(adamw.global_grad_norm(), 6.5, 1e-15));
  }
  SECTION("a norm below the limit, or clipping off, leaves the grads alone") {
    CHECK(near(adamw.clip_gradients(20.0), 13.0, 1e-15));
    CHECK(near(adamw.clip_gradients(0.0), 13.0, 1e-15));
    CHECK(values(a.grad) == std::vector<double>({3.0, 4.0}));
    CHECK(values(b.grad) == std::vector<double>({12.0}));
  }
  SECTION("a non-finite norm is returned and nothing is touched") {
    set_grad(b, {std::nan("")});
    CHECK(std::isnan(adamw.clip_gradients(1.0)));
    CHECK(values(a.grad) == std::vector<double>({3.0, 4.0}));
    set_grad(b, {INFINITY});
    CHECK(std::isinf(adamw.clip_gradients(1.0)));
    CHECK(values(a.grad) == std::vector<double>({3.0, 4.0}));
  }
  SECTION("zero_grad clears without updating") {
    adamw.zero_grad();
    CHECK(adamw.global_grad_norm() == 0.0);
    CHECK(adamw.step_count() == 0);
  }
}

TEST_CASE("moments start at zero and the step count can be restored") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter p = make_param("w", {1.0, 2.0});
  AdamW adamw({&p}, AdamWOptions{}, *backend);
  for (const auto& s : adamw.gather_state()) {
    CHECK(s.exp_avg.shape == p.value.shape());
    for (int64_t i = 0; i < s.exp_avg.numel(); ++i) {
      CHECK(s.exp_avg.ptr<double>()[i] == 0.0);
      CHECK(s.exp_avg_sq.ptr<double>()[i] == 0.0);
    }
  }
  adamw.set_step_count(41);
  set_grad(p, {1.0, -1.0});
  adamw.step(0.01);
  CHECK(adamw.step_count() == 42);
  // Bias correction at t = 42 with m = 0.1 g, v = 0.001 g^2 from zero moments:
  const double m_hat = 0.1 / (1 - std::pow(0.9, 42.0)), v_hat = 0.001 / (1 - std::pow(0.999, 42.0));
  CHECK(near(values(p.value)[0], 1.0 - 0.01 * m_hat / (std::sqrt(v_hat) + 1e-8), 1e-12));
}

TEST_CASE("loose parameters keep their trained values after the optimizer is gone") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter p = make_param("w", {1.0, 2.0});
  std::vector<double> trained;
  {
    AdamW adamw({&p}, AdamWOptions{}, *backend);
    CHECK_FALSE(p.value.owns_memory());  // a view into the optimizer's flat buffer now
    set_grad(p, {1.0, -1.0});
    adamw.step(0.1);
    trained = values(p.value);
  }
  REQUIRE(p.value.owns_memory());
  REQUIRE(p.grad.owns_memory());
  CHECK(values(p.value) == trained);
  CHECK(trained[0] < 1.0);
  CHECK(values(p.grad) == std::vector<double>({0.0, 0.0}));
}

TEST_CASE("one update over a run of parameters leaves the alignment padding between them at zero") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter a = make_param("a", {1.0, -2.0, 3.0}), b = make_param("b", {0.5, 0.25});
  moetrain::ParameterGroup group("adapters", {&a, &b}, nullptr, nullptr, *backend);
  AdamWOptions options;
  options.weight_decay = 0.1;
  AdamW adamw(std::vector<moetrain::ParameterGroup*>{&group}, options, *backend);
  for (int t = 0; t < 3; ++t) {
    set_grad(a, {0.3, -0.1, 0.2});
    set_grad(b, {1.0, -1.0});
    adamw.step(0.01);
  }
  const double* flat = group.values().ptr<double>();
  for (int64_t i = 3; i < group.offsets()[1]; ++i) CHECK(flat[i] == 0.0);  // between a and b
  for (int64_t i = group.offsets()[1] + 2; i < group.values().numel(); ++i) CHECK(flat[i] == 0.0);
  CHECK(values(a.value)[0] < 1.0);
  CHECK(values(b.value)[0] < 0.5);   // gradient +1: down
  CHECK(values(b.value)[1] > 0.25);  // gradient -1: up
}
