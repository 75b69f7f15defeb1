// CPU reference backend: RMSNorm, rotary embedding and SwiGLU. Forwards against naive double
// computations written here; backwards against central differences in double.
#include <cmath>
#include <cstring>
#include <vector>

#include "catch.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

// Standard rotary tables: angle(p, i) = p * base^(-2i / rope_dim).
void make_rope_tables(Tensor* cos_table, Tensor* sin_table, int64_t positions, int64_t rope_dim, DType dtype) {
  *cos_table = Tensor({positions, rope_dim / 2}, dtype);
  *sin_table = Tensor({positions, rope_dim / 2}, dtype);
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < rope_dim / 2; ++i) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(i) / rope_dim);
      set_element(*cos_table, p * (rope_dim / 2) + i, std::cos(angle));
      set_element(*sin_table, p * (rope_dim / 2) + i, std::sin(angle));
    }
}

// transformers' formulation, literally: optionally de-interleave (view(d/2, 2).transpose), then
// q * cos + rotate_half(q) * sin with cos/sin repeated over both halves.
std::vector<double> naive_rope_row(const std::vector<double>& x, const std::vector<double>& c,
                                   const std::vector<double>& s, bool interleaved) {
  const size_t d = x.size(), half = d / 2;
  std::vector<double> q(d);
  for (size_t i = 0; i < half; ++i) {
    q[i] = interleaved ? x[2 * i] : x[i];
    q[i + half] = interleaved ? x[2 * i + 1] : x[i + half];
  }
  std::vector<double> out(d);
  for (size_t j = 0; j < d; ++j) {
    const double rotated = j < half ? -q[j + half] : q[j - half];
    out[j] = q[j] * c[j % half] + rotated * s[j % half];
  }
  return out;
}

}  // namespace

TEST_CASE("rmsnorm forward matches a naive computation", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 4, dim = 6;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    Tensor x = random_tensor({rows, dim}, dtype, 1, 0.1, 3.0), w = random_tensor({dim}, dtype, 2);
    Tensor y({rows, dim}, dtype), rstd({rows}, dtype);
    Tensor expected_y({rows, dim}, DType::kF64), expected_rstd({rows}, DType::kF64);
    const double eps = 1e-5;
    for (int64_t r = 0; r < rows; ++r) {
      double ms = 0;
      for (int64_t j = 0; j < dim; ++j) ms += get_element(x, r * dim + j) * get_element(x, r * dim + j);
      const double s = 1.0 / std::sqrt(ms / dim + eps);
      set_element(expected_rstd, r, s);
      for (int64_t j = 0; j < dim; ++j)
        set_element(expected_y, r * dim + j, get_element(x, r * dim + j) * s * get_element(w, j));
    }
    backend->rmsnorm_forward({y, rstd, x, w, eps});
    const double tol = dtype == DType::kF32 ? 1e-6 : 1e-14;
    check(compare_tensors(y, expected_y, tol, tol, "y"));
    check(compare_tensors(rstd, expected_rstd, tol, tol, "rstd"));
  }
}

TEST_CASE("rmsnorm backward matches finite differences", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 3, dim = 5;
  Tensor x = random_tensor({rows, dim}, DType::kF64, 1, 0.1, 2.0), w = random_tensor({dim}, DType::kF64, 2);
  Tensor dy = random_tensor({rows, dim}, DType::kF64, 3);
  Tensor y({rows, dim}, DType::kF64), rstd({rows}, DType::kF64);
  auto loss = [&] {
    backend->rmsnorm_forward({y, rstd, x, w, 1e-6});
    return dot(dy, y);
  };
  loss();
  Tensor dx = random_tensor({rows, dim}, DType::kF64, 4), dw = random_tensor({dim}, DType::kF64, 5);
  backend->rmsnorm_backward({dx, dw, dy, x, w, rstd, false});
  check(check_gradient(loss, x, dx, "x"));
  check(check_gradient(loss, w, dw, "weight"));

  SECTION("accumulate adds dx to what is there; no dweight for a frozen norm") {
    Tensor acc = random_tensor({rows, dim}, DType::kF64, 6);
    Tensor expected({rows, dim}, DType::kF64);
    for (int64_t i = 0; i < acc.numel(); ++i) set_element(expected, i, get_element(acc, i) + get_element(dx, i));
    backend->rmsnorm_backward({acc, TensorView{}, dy, x, w, rstd, true});
    check(compare_tensors(acc, expected, 1e-14, 1e-14, "accumulated dx"));
  }

  SECTION("no rows (a rank with no tokens): dweight is zero") {
    Tensor x0({0, dim}, DType::kF64), dy0({0, dim}, DType::kF64), dx0({0, dim}, DType::kF64);
    Tensor rstd0({0}, DType::kF64);
    Tensor dw0 = random_tensor({dim}, DType::kF64, 7);
    backend->rmsnorm_backward({dx0, dw0, dy0, x0, w, rstd0, false});
    for (int64_t i = 0; i < dim; ++i) CHECK(get_element(dw0, i) == 0.0);
  }
}

TEST_CASE("rope forward matches transformers' formulation for both layouts", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // 3 tokens x 2 heads, rows of width 9 with the rope part at columns [3, 9).
  const int64_t tokens = 3, heads = 2, width = 9, col_offset = 3, rope_dim = 6;
  Tensor positions = make_i32({5, 0, 11});
  for (DType dtype : {DType::kF32, DType::kF64}) {
    Tensor cos_table, sin_table;
    make_rope_tables(&cos_table, &sin_table, 16, rope_dim, dtype);
    for (RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
      Tensor x = random_tensor({tokens * heads, width}, dtype, 1);
      Tensor out = random_tensor({tokens * heads, width}, dtype, 2);
      Tensor expected({tokens * heads, width}, DType::kF64);
      for (int64_t r = 0; r < tokens * heads; ++r) {
        const int32_t p = positions.ptr<int32_t>()[r / heads];
        std::vector<double> xr(rope_dim), c(rope_dim / 2), s(rope_dim / 2);
        for (int64_t j = 0; j < rope_dim; ++j) xr[j] = get_element(x, r * width + col_offset + j);
        for (int64_t i = 0; i < rope_dim / 2; ++i) {
          c[i] = std::cos(p * std::pow(10000.0, -2.0 * i / rope_dim));
          s[i] = std::sin(p * std::pow(10000.0, -2.0 * i / rope_dim));
        }
        std::vector<double> o = naive_rope_row(xr, c, s, layout == RopeLayout::kInterleaved);
        for (int64_t j = 0; j < width; ++j)
          set_element(expected, r * width + j,
                      j < col_offset ? get_element(x, r * width + j) : o[j - col_offset]);
      }
      RopeArgs args{out, x, positions, cos_table, sin_table, heads, col_offset, rope_dim, layout, false};
      backend->rope(args);
      const double tol = dtype == DType::kF32 ? 1e-6 : 1e-13;
      auto cmp = compare_tensors(out, expected, tol, tol, "rope");
      INFO(dtype_name(dtype) << (layout == RopeLayout::kInterleaved ? " interleaved: " : " half-split: ") << cmp.message);
      CHECK(cmp.ok);

      // In place gives the same result.
      Tensor in_place({tokens * heads, width}, dtype);
      std::memcpy(in_place.data(), x.data(), x.nbytes());
      args.out = in_place;
      args.x = in_place;
      backend->rope(args);
      CHECK(std::memcmp(in_place.data(), out.data(), out.nbytes()) == 0);

      // inverse undoes it, in place too.
      args.inverse = true;
      backend->rope(args);
      check(compare_tensors(in_place, x, tol, tol, "rope then inverse"));
    }
  }
}

TEST_CASE("rope inverse is the transpose of the forward (its backward)", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t tokens = 2, heads = 3, width = 6, col_offset = 1, rope_dim = 4;
  Tensor positions = make_i32({7, 2});
  Tensor cos_table, sin_table;
  make_rope_tables(&cos_table, &sin_table, 8, rope_dim, DType::kF64);
  for (RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    Tensor x = random_tensor({tokens * heads, width}, DType::kF64, 1);
    Tensor dy = random_tensor({tokens * heads, width}, DType::kF64, 2);
    Tensor y({tokens * heads, width}, DType::kF64), dx({tokens * heads, width}, DType::kF64);
    auto loss = [&] {
      backend->rope({y, x, positions, cos_table, sin_table, heads, col_offset, rope_dim, layout, false});
      return dot(dy, y);
    };
    backend->rope({dx, dy, positions, cos_table, sin_table, heads, col_offset, rope_dim, layout, true});
    auto cmp = check_gradient(loss, x, dx, "x");
    INFO((layout == RopeLayout::kInterleaved ? "interleaved: " : "half-split: ") << cmp.message);
    CHECK(cmp.ok);
  }
}

TEST_CASE("rope rejects positions past its table and odd rope_dim", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor cos_table, sin_table;
  make_rope_tables(&cos_table, &sin_table, 4, 4, DType::kF32);
  Tensor x = random_tensor({2, 4}, DType::kF32, 1);
  Tensor far = make_i32({1, 4});
  CHECK(contains(error_message([&] { backend->rope({x, x, far, cos_table, sin_table, 1, 0, 4}); }), "position 4"));
  Tensor ok = make_i32({1, 2});
  CHECK_THROWS_AS(backend->rope({x, x, ok, cos_table, sin_table, 1, 0, 3}), Error);
  CHECK_THROWS_AS(backend->rope({x, x, ok, cos_table, sin_table, 2, 0, 4}), Error);  // 2 rows != 2 tokens * 2 heads
}

TEST_CASE("swiglu forward matches silu(gate) * up; backward matches finite differences", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 3, width = 4;
  Tensor gate_up = random_tensor({rows, 2 * width}, DType::kF64, 1, 0.05, 4.0);
  Tensor h({rows, width}, DType::kF64);
  backend->swiglu_forward(h, gate_up);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) {
      const double g = get_element(gate_up, r * 2 * width + j), u = get_element(gate_up, r * 2 * width + width + j);
      CHECK(std::fabs(get_element(h, r * width + j) - g / (1.0 + std::exp(-g)) * u) < 1e-14);
    }
  Tensor dh = random_tensor({rows, width}, DType::kF64, 2);
  Tensor dgate_up({rows, 2 * width}, DType::kF64);
  backend->swiglu_backward({dgate_up, dh, gate_up});
  auto cmp = check_gradient([&] { backend->swiglu_forward(h, gate_up); return dot(dh, h); }, gate_up, dgate_up,
                            "gate_up");
  INFO(cmp.message);
  CHECK(cmp.ok);

  // float agrees with double to float precision, and saturates cleanly at large |gate|.
  Tensor gf({1, 4}, DType::kF32), hf({1, 2}, DType::kF32);
  float* g = gf.ptr<float>();
  g[0] = -100.0f;
  g[1] = 100.0f;
  g[2] = 2.0f;
  g[3] = 3.0f;
  backend->swiglu_forward(hf, gf);
  CHECK(hf.ptr<float>()[0] == -0.0f);
  CHECK(hf.ptr<float>()[1] == 300.0f);
}
