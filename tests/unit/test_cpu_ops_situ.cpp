// CPU reference backend: SiTU (Kimi K3's gated activation). Forward against the formula
// written out here; backward against central differences in double; argument errors.
#include <cmath>
#include <string>

#include "catch.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

// The K3 formula, independently of the backend: beta*tanh(g/beta)*sigmoid(g) * cap(u).
double situ_reference(double g, double u, double beta, double linear_beta) {
  const double v = linear_beta > 0.0 ? linear_beta * std::tanh(u / linear_beta) : u;
  return beta * std::tanh(g / beta) / (1.0 + std::exp(-g)) * v;
}

}  // namespace

TEST_CASE("situ forward matches the formula; backward matches finite differences", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 3, width = 5;
  // Magnitudes up to 40 put gates past beta 4 and up values past linear_beta 25, so both tanh
  // caps are exercised away from their linear region.
  Tensor gate_up = random_tensor({rows, 2 * width}, DType::kF64, 11, 0.05, 40.0);
  Tensor h({rows, width}, DType::kF64);
  Tensor dh = random_tensor({rows, width}, DType::kF64, 12);
  for (const double linear_beta : {25.0, 0.0}) {
    INFO("linear_beta " << linear_beta);
    const double beta = 4.0;
    backend->situ_forward({h, gate_up, beta, linear_beta});
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < width; ++j) {
        const double g = get_element(gate_up, r * 2 * width + j), u = get_element(gate_up, r * 2 * width + width + j);
        CHECK(std::fabs(get_element(h, r * width + j) - situ_reference(g, u, beta, linear_beta)) < 1e-12);
      }
    Tensor dgate_up({rows, 2 * width}, DType::kF64);
    backend->situ_backward({dgate_up, dh, gate_up, beta, linear_beta});
    auto cmp = check_gradient(
        [&] {
          backend->situ_forward({h, gate_up, beta, linear_beta});
          return dot(dh, h);
        },
        gate_up, dgate_up, "gate_up");
    INFO(cmp.message);
    CHECK(cmp.ok);
  }
}

TEST_CASE("situ caps: the gate stays below beta and the up branch inside linear_beta", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor gu({1, 6}, DType::kF32), h({1, 3}, DType::kF32);
  float* g = gu.ptr<float>();
  g[0] = 1000.0f;   // gate -> beta * 1 * 1 = 4
  g[1] = -1000.0f;  // gate -> 0
  g[2] = 1000.0f;
  g[3] = 1000.0f;  // up -> linear_beta = 25
  g[4] = 7.0f;
  g[5] = -1000.0f;  // up -> -25
  backend->situ_forward({h, gu, 4.0, 25.0});
  CHECK(h.ptr<float>()[0] == Approx(100.0f));
  CHECK(h.ptr<float>()[1] == 0.0f);
  CHECK(h.ptr<float>()[2] == Approx(-100.0f));

  // float and the in-place backward (dgate_up over gate_up) agree with double.
  Tensor g64 = random_tensor({2, 8}, DType::kF64, 3, 0.05, 30.0);
  Tensor g32({2, 8}, DType::kF32), dh64 = random_tensor({2, 4}, DType::kF64, 4), dh32({2, 4}, DType::kF32);
  for (int64_t i = 0; i < 16; ++i) set_element(g32, i, get_element(g64, i));
  for (int64_t i = 0; i < 8; ++i) set_element(dh32, i, get_element(dh64, i));
  Tensor d64({2, 8}, DType::kF64);
  backend->situ_backward({d64, dh64, g64, 4.0, 25.0});
  backend->situ_backward({g32, dh32, g32, 4.0, 25.0});
  for (int64_t i = 0; i < 16; ++i) CHECK(get_element(g32, i) == Approx(get_element(d64, i)).margin(1e-5));
}

TEST_CASE("situ rejects a non-positive beta, a negative linear_beta and mismatched shapes", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor gu({2, 4}, DType::kF64), h({2, 2}, DType::kF64), bad({2, 3}, DType::kF64);
  CHECK_THROWS_AS(backend->situ_forward({h, gu, 0.0, 25.0}), Error);
  CHECK_THROWS_AS(backend->situ_forward({h, gu, 4.0, -1.0}), Error);
  CHECK_THROWS_AS(backend->situ_forward({bad, gu, 4.0, 25.0}), Error);
  CHECK_THROWS_AS(backend->situ_backward({bad, h, gu, 4.0, 25.0}), Error);
}
