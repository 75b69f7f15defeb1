// CPU reference backend: cross-entropy and AdamW.
#include <cmath>
#include <vector>

#include "catch.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

TEST_CASE("cross-entropy loss and gradient match a naive computation", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 4, vocab = 7;
  Tensor labels = make_i32({3, -1, 0, 6});  // row 1 is not a target
  const double grad_scale = 0.25;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    // Logits around +100: exp() of them overflows float, so only a max-subtracted version works.
    Tensor logits = random_tensor({rows, vocab}, dtype, 1, 0.1, 3.0);
    for (int64_t i = 0; i < logits.numel(); ++i) set_element(logits, i, get_element(logits, i) + 100.0);
    Tensor loss = random_tensor({rows}, dtype, 2), dlogits = random_tensor({rows, vocab}, dtype, 3);
    backend->cross_entropy({loss, dlogits, logits, labels, grad_scale});
    Tensor expected_loss({rows}, DType::kF64), expected_grad({rows, vocab}, DType::kF64);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t label = labels.ptr<int32_t>()[r];
      double sum = 0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(get_element(logits, r * vocab + j) - 100.0);
      const double lse = 100.0 + std::log(sum);
      set_element(expected_loss, r, label < 0 ? 0.0 : lse - get_element(logits, r * vocab + label));
      for (int64_t j = 0; j < vocab; ++j) {
        const double p = std::exp(get_element(logits, r * vocab + j) - lse);
        set_element(expected_grad, r * vocab + j, label < 0 ? 0.0 : (p - (j == label ? 1.0 : 0.0)) * grad_scale);
      }
    }
    // float logits near 100 carry ~1e-5 absolute error of their own in the lse
    const double tol = dtype == DType::kF32 ? 2e-5 : 1e-12;
    auto cl = compare_tensors(loss, expected_loss, tol, tol, "loss");
    INFO(dtype_name(dtype) << ": " << cl.message);
    CHECK(cl.ok);
    auto cg = compare_tensors(dlogits, expected_grad, tol, tol, "dlogits");
    INFO(dtype_name(dtype) << ": " << cg.message);
    CHECK(cg.ok);
    CHECK(get_element(loss, 1) == 0.0);

    // dlogits may alias logits.
    backend->cross_entropy({loss, logits, logits, labels, grad_scale});
    check(compare_tensors(logits, dlogits, 0.0, 0.0, "aliased dlogits"));
  }
}

TEST_CASE("cross-entropy gradient matches finite differences of the scaled loss", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 3, vocab = 5;
  Tensor labels = make_i32({4, 0, -7});
  Tensor logits = random_tensor({rows, vocab}, DType::kF64, 1, 0.1, 2.0);
  Tensor loss({rows}, DType::kF64), dlogits({rows, vocab}, DType::kF64);
  const double grad_scale = 1.5;
  backend->cross_entropy({loss, dlogits, logits, labels, grad_scale});
  auto scaled_loss = [&] {
    backend->cross_entropy({loss, TensorView{}, logits, labels, grad_scale});  // loss only
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += get_element(loss, r);
    return grad_scale * sum;
  };
  check(check_gradient(scaled_loss, logits, dlogits, "logits"));
}

TEST_CASE("cross-entropy rejects a label past the vocabulary", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor logits = random_tensor({2, 3}, DType::kF32, 1);
  Tensor loss({2}, DType::kF32), dlogits({2, 3}, DType::kF32);
  Tensor labels = make_i32({0, 3});
  CHECK(contains(error_message([&] { backend->cross_entropy({loss, dlogits, logits, labels, 1.0}); }), "label 3"));
}

TEST_CASE("adamw follows the AdamW formula over two steps", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t n = 5;
  const double lr = 1e-2, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1;
  Tensor p0 = random_tensor({n}, DType::kF64, 1), g1 = random_tensor({n}, DType::kF64, 2),
         g2 = random_tensor({n}, DType::kF64, 3);

  // The textbook form (Loshchilov & Hutter with PyTorch's placement of eps), in double.
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = get_element(p0, i);
  for (int step = 1; step <= 2; ++step) {
    const Tensor& g = step == 1 ? g1 : g2;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = get_element(g, i);
      p[i] = p[i] - lr * weight_decay * p[i];
      m[i] = beta1 * m[i] + (1 - beta1) * gi;
      v[i] = beta2 * v[i] + (1 - beta2) * gi * gi;
      const double m_hat = m[i] / (1 - std::pow(beta1, step));
      const double v_hat = v[i] / (1 - std::pow(beta2, step));
      p[i] = p[i] - lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }

  for (DType dtype : {DType::kF32, DType::kF64}) {
    Tensor param({n}, dtype), grad({n}, dtype), exp_avg = Tensor::zeros({n}, dtype),
                              exp_avg_sq = Tensor::zeros({n}, dtype);
    for (int64_t i = 0; i < n; ++i) set_element(param, i, get_element(p0, i));
    for (int step = 1; step <= 2; ++step) {
      const Tensor& g = step == 1 ? g1 : g2;
      for (int64_t i = 0; i < n; ++i) set_element(grad, i, get_element(g, i));
      backend->adamw({param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step});
    }
    const double tol = dtype == DType::kF32 ? 1e-6 : 1e-14;
    for (int64_t i = 0; i < n; ++i) {
      INFO(dtype_name(dtype) << " element " << i);
      CHECK(within_tolerance(get_element(param, i), p[i], tol, tol));
      CHECK(within_tolerance(get_element(exp_avg, i), m[i], tol, tol));
      CHECK(within_tolerance(get_element(exp_avg_sq, i), v[i], tol, tol));
    }
  }
}

TEST_CASE("adamw's first step moves each parameter by lr against its gradient's sign", "[cpu_ops]") {
  // With bias correction, step 1 without weight decay is p -= lr * g / (|g| + eps).
  auto backend = make_cpu_backend();
  Tensor param({3}, DType::kF64), grad({3}, DType::kF64), m = Tensor::zeros({3}, DType::kF64),
                                  v = Tensor::zeros({3}, DType::kF64);
  const double p_init[3] = {1.0, -2.0, 0.5}, g[3] = {0.3, -4.0, 1e-3};
  for (int i = 0; i < 3; ++i) {
    set_element(param, i, p_init[i]);
    set_element(grad, i, g[i]);
  }
  backend->adamw({param, grad, m, v, 0.1, 0.9, 0.999, 1e-8, 0.0, 1});
  CHECK(std::fabs(get_element(param, 0) - 0.9) < 1e-7);
  CHECK(std::fabs(get_element(param, 1) - -1.9) < 1e-7);
  CHECK(std::fabs(get_element(param, 2) - 0.4) < 1e-6);
  CHECK_THROWS_AS(backend->adamw({param, grad, m, v, 0.1, 0.9, 0.999, 1e-8, 0.0, 0}), Error);  // steps are 1-based
}
