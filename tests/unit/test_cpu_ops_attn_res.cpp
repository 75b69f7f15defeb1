// CPU reference backend: Block Attention Residuals' depth mix. Forward against the formula
// written out here (as NeMo AutoModel's kimi_k3 _apply_attn_res computes it); backward against
// central differences in double, for every value; float against double; argument errors.
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

std::vector<TensorView> views(const std::vector<Tensor>& tensors) {
  std::vector<TensorView> out;
  for (const Tensor& t : tensors) out.push_back(t.view());
  return out;
}

// out[t] = sum_i softmax_i(rms_normalized(V_i[t]) . (w * q)) V_i[t], by hand.
std::vector<double> reference_mix(const std::vector<Tensor>& values, const Tensor& w, const Tensor& q, int64_t t,
                                  int64_t dim, double eps) {
  std::vector<double> score;
  for (const Tensor& v : values) {
    double mean_square = 0.0, s = 0.0;
    for (int64_t d = 0; d < dim; ++d) mean_square += get_element(v, t * dim + d) * get_element(v, t * dim + d) / dim;
    for (int64_t d = 0; d < dim; ++d)
      s += get_element(v, t * dim + d) / std::sqrt(mean_square + eps) * get_element(w, d) * get_element(q, d);
    score.push_back(s);
  }
  double top = score[0], total = 0.0;
  for (double s : score) top = std::max(top, s);
  for (double& s : score) total += (s = std::exp(s - top));
  std::vector<double> out(static_cast<size_t>(dim), 0.0);
  for (size_t i = 0; i < values.size(); ++i)
    for (int64_t d = 0; d < dim; ++d) out[d] += score[i] / total * get_element(values[i], t * dim + d);
  return out;
}

}  // namespace

TEST_CASE("attn_res forward matches the formula; backward matches finite differences", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 3, dim = 6;
  const double eps = 1e-5;
  for (const int m : {1, 2, 4}) {
    INFO(m << " values");
    std::vector<Tensor> values;
    for (int i = 0; i < m; ++i) values.push_back(random_tensor({rows, dim}, DType::kF64, 20 + i, 0.1, 2.0));
    // A query large enough that the softmax is far from uniform (and from one-hot).
    Tensor w = random_tensor({dim}, DType::kF64, 5, 0.5, 1.5), q = random_tensor({dim}, DType::kF64, 6, 0.1, 1.0);
    Tensor out({rows, dim}, DType::kF64), probs({rows, m}, DType::kF64);
    backend->attn_res_forward({out, probs, views(values), w, q, eps});
    for (int64_t t = 0; t < rows; ++t) {
      const std::vector<double> expected = reference_mix(values, w, q, t, dim, eps);
      for (int64_t d = 0; d < dim; ++d) CHECK(std::fabs(get_element(out, t * dim + d) - expected[d]) < 1e-12);
    }

    Tensor dout = random_tensor({rows, dim}, DType::kF64, 7);
    std::vector<Tensor> grads;
    for (int i = 0; i < m; ++i) {
      grads.emplace_back(Shape{rows, dim}, DType::kF64);
      // += semantics: start from a known offset and subtract it afterwards.
      for (int64_t e = 0; e < rows * dim; ++e) set_element(grads.back(), e, 0.25);
    }
    backend->attn_res_backward({views(grads), dout, views(values), w, q, probs, eps});
    for (int i = 0; i < m; ++i) {
      for (int64_t e = 0; e < rows * dim; ++e) set_element(grads[i], e, get_element(grads[i], e) - 0.25);
      auto cmp = check_gradient(
          [&] {
            backend->attn_res_forward({out, probs, views(values), w, q, eps});
            return dot(dout, out);
          },
          values[i], grads[i], "value " + std::to_string(i));
      INFO(cmp.message);
      CHECK(cmp.ok);
    }
  }
}

TEST_CASE("attn_res in float agrees with double", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 4, dim = 16, m = 3;
  std::vector<Tensor> v64, v32, g64, g32;
  for (int i = 0; i < m; ++i) {
    v64.push_back(random_tensor({rows, dim}, DType::kF64, 40 + i));
    v32.emplace_back(Shape{rows, dim}, DType::kF32);
    for (int64_t e = 0; e < rows * dim; ++e) set_element(v32.back(), e, get_element(v64.back(), e));
    g64.emplace_back(Shape{rows, dim}, DType::kF64);
    g32.emplace_back(Shape{rows, dim}, DType::kF32);
    backend->fill(g64.back(), 0.0);
    backend->fill(g32.back(), 0.0);
  }
  Tensor w64 = random_tensor({dim}, DType::kF64, 50), q64 = random_tensor({dim}, DType::kF64, 51);
  Tensor d64 = random_tensor({rows, dim}, DType::kF64, 52);
  Tensor w32({dim}, DType::kF32), q32({dim}, DType::kF32), d32({rows, dim}, DType::kF32);
  for (int64_t e = 0; e < dim; ++e) set_element(w32, e, get_element(w64, e)), set_element(q32, e, get_element(q64, e));
  for (int64_t e = 0; e < rows * dim; ++e) set_element(d32, e, get_element(d64, e));
  Tensor o64({rows, dim}, DType::kF64), o32({rows, dim}, DType::kF32);
  Tensor p64({rows, m}, DType::kF64), p32({rows, m}, DType::kF32);
  backend->attn_res_forward({o64, p64, views(v64), w64, q64, 1e-5});
  backend->attn_res_forward({o32, p32, views(v32), w32, q32, 1e-5});
  backend->attn_res_backward({views(g64), d64, views(v64), w64, q64, p64, 1e-5});
  backend->attn_res_backward({views(g32), d32, views(v32), w32, q32, p32, 1e-5});
  for (int64_t e = 0; e < rows * dim; ++e) CHECK(get_element(o32, e) == Approx(get_element(o64, e)).margin(1e-5));
  for (int i = 0; i < m; ++i)
    for (int64_t e = 0; e < rows * dim; ++e)
      CHECK(get_element(g32[i], e) == Approx(get_element(g64[i], e)).margin(1e-4));
}

TEST_CASE("attn_res rejects no values, mismatched shapes and out over a value", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor a({2, 4}, DType::kF64), b({2, 4}, DType::kF64), bad({2, 3}, DType::kF64), out({2, 4}, DType::kF64);
  Tensor w({4}, DType::kF64), q({4}, DType::kF64), p1({2, 1}, DType::kF64), p2({2, 2}, DType::kF64);
  CHECK_THROWS_AS(backend->attn_res_forward({out, p1, {}, w, q, 1e-5}), Error);
  CHECK_THROWS_AS(backend->attn_res_forward({out, p2, {a, bad}, w, q, 1e-5}), Error);
  CHECK_THROWS_AS(backend->attn_res_forward({out, p1, {a, b}, w, q, 1e-5}), Error);  // probs [2, 1] for 2 values
  CHECK_THROWS_AS(backend->attn_res_forward({a, p2, {a, b}, w, q, 1e-5}), Error);
  CHECK_THROWS_AS(backend->attn_res_backward({{a}, out, {a, b}, w, q, p2, 1e-5}), Error);  // one gradient, two values
}
