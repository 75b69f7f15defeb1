// CPU reference of the vision tower's ops: GELU (exact and tanh) against known values and finite
// differences; non-causal attention against the full-matrix definition and finite differences;
// the adjacent-pair RoPE against complex multiplication; the position embedding's bilinear resize
// and the patch merger against values worked out by hand.
#include <cmath>
#include <complex>
#include <limits>
#include <tuple>
#include <vector>

#include "catch.h"
#include "kernels/cpu/reference.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

TEST_CASE("gelu matches known values; its backward matches finite differences", "[cpu_ops][vision]") {
  auto backend = make_cpu_backend();
  // gelu(1) = Phi(1) = 0.841344746...; the tanh form gives 0.841191990...; gelu(-2) = -2 Phi(-2).
  Tensor x = tensor_of({1.0, -2.0}, {1, 2});
  Tensor y({1, 2}, DType::kF64);
  backend->gelu_forward({y, x, GeluApproximation::kExact});
  CHECK(std::fabs(get_element(y, 0) - 0.8413447460685429) < 1e-14);
  CHECK(std::fabs(get_element(y, 1) - -0.04550026389635842) < 1e-14);
  backend->gelu_forward({y, x, GeluApproximation::kTanh});
  CHECK(std::fabs(get_element(y, 0) - 0.8411919906082768) < 1e-14);

  const int64_t rows = 3, width = 7;
  Tensor xs = random_tensor({rows, width}, DType::kF64, 5, -4.0, 4.0);
  Tensor dy = random_tensor({rows, width}, DType::kF64, 6, -1.0, 1.0);
  Tensor ys({rows, width}, DType::kF64), dx({rows, width}, DType::kF64);
  for (const GeluApproximation a : {GeluApproximation::kExact, GeluApproximation::kTanh}) {
    INFO("tanh " << (a == GeluApproximation::kTanh));
    backend->gelu_backward({dx, dy, xs, a});
    check(check_gradient(
        [&] {
          backend->gelu_forward({ys, xs, a});
          return dot(dy, ys);
        },
        xs, dx, "x"));
  }
}

namespace {

// Full-matrix attention of every pair of tokens in one segment, no causal mask.
std::vector<double> naive_bidirectional(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const std::vector<int32_t>& cu, double scale) {
  const int64_t heads = q.shape()[1], dim = q.shape()[2], vd = v.shape()[2];
  std::vector<double> out(static_cast<size_t>(q.shape()[0] * heads * vd), 0.0);
  for (size_t seg = 0; seg + 1 < cu.size(); ++seg) {
    for (int64_t t = cu[seg]; t < cu[seg + 1]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> p;
        double total = 0.0;
        for (int64_t s = cu[seg]; s < cu[seg + 1]; ++s) {
          double d = 0.0;
          for (int64_t c = 0; c < dim; ++c)
            d += get_element(q, (t * heads + h) * dim + c) * get_element(k, (s * heads + h) * dim + c);
          p.push_back(std::exp(scale * d));
          total += p.back();
        }
        for (int64_t s = cu[seg]; s < cu[seg + 1]; ++s)
          for (int64_t c = 0; c < vd; ++c)
            out[(t * heads + h) * vd + c] += p[s - cu[seg]] / total * get_element(v, (s * heads + h) * vd + c);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("non-causal attention sees its whole segment and nothing else", "[cpu_ops][vision][attention]") {
  auto backend = make_cpu_backend();
  const std::vector<int32_t> cu_values{0, 4, 5, 11};  // two images and a one-patch one
  const int64_t tokens = 11, heads = 2, dim = 4;
  const double scale = 0.5;
  Tensor q = random_tensor({tokens, heads, dim}, DType::kF64, 1, -1.0, 1.0);
  Tensor k = random_tensor({tokens, heads, dim}, DType::kF64, 2, -1.0, 1.0);
  Tensor v = random_tensor({tokens, heads, dim}, DType::kF64, 3, -1.0, 1.0);
  Tensor cu = make_i32(cu_values);
  Tensor out({tokens, heads, dim}, DType::kF64), lse({tokens, heads}, DType::kF64);
  AttentionArgs args{out, lse, q, k, v, cu, scale};
  args.causal = false;
  backend->attention_forward(args);
  check(compare_tensors(out, tensor_of(naive_bidirectional(q, k, v, cu_values, scale), {tokens, heads, dim}), 1e-12,
                        1e-13, "out"));

  Tensor dout = random_tensor({tokens, heads, dim}, DType::kF64, 4, -1.0, 1.0);
  Tensor dq(q.shape(), DType::kF64), dk(k.shape(), DType::kF64), dv(v.shape(), DType::kF64);
  AttentionBackwardArgs bargs{dq, dk, dv, dout, q, k, v, out, lse, cu, scale};
  bargs.causal = false;
  backend->attention_backward(bargs);
  Tensor scratch(out.shape(), DType::kF64), scratch_lse(lse.shape(), DType::kF64);
  auto loss = [&] {
    AttentionArgs a{scratch, scratch_lse, q, k, v, cu, scale};
    a.causal = false;
    backend->attention_forward(a);
    return dot(dout, scratch);
  };
  GradCheckOptions options;
  options.max_elements = 200;
  for (auto [input, grad, name] :
       {std::tuple<const Tensor*, const Tensor*, const char*>{&q, &dq, "q"}, {&k, &dk, "k"}, {&v, &dv, "v"}}) {
    check(check_gradient(loss, *input, *grad, name, options));
  }
  // Key segments of their own are a causal-only feature.
  args.cu_seqlens_k = cu;
  CHECK_THROWS_AS(backend->attention_forward(args), Error);
}

TEST_CASE("adjacent-pair rope is complex multiplication, its inverse the backward", "[cpu_ops][vision][rope]") {
  auto backend = make_cpu_backend();
  const int64_t tokens = 3, heads = 2, dim = 8, half = dim / 2;
  Tensor x = random_tensor({tokens * heads, dim}, DType::kF64, 8, -1.0, 1.0);
  Tensor angle = random_tensor({tokens, half}, DType::kF64, 9, -3.0, 3.0);
  Tensor cos({tokens, half}, DType::kF64), sin({tokens, half}, DType::kF64);
  for (int64_t i = 0; i < angle.numel(); ++i) {
    set_element(cos, i, std::cos(get_element(angle, i)));
    set_element(sin, i, std::sin(get_element(angle, i)));
  }
  Tensor positions = make_i32({0, 1, 2});  // a table row per token
  Tensor out({tokens * heads, dim}, DType::kF64);
  RopeArgs args{out, x, positions, cos, sin, heads, 0, dim, RopeLayout::kAdjacent, false};
  backend->rope(args);
  for (int64_t r = 0; r < tokens * heads; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const std::complex<double> z(get_element(x, r * dim + 2 * i), get_element(x, r * dim + 2 * i + 1));
      const std::complex<double> w = z * std::polar(1.0, get_element(angle, (r / heads) * half + i));
      CHECK(std::fabs(get_element(out, r * dim + 2 * i) - w.real()) < 1e-14);
      CHECK(std::fabs(get_element(out, r * dim + 2 * i + 1) - w.imag()) < 1e-14);
    }
  }
  Tensor dout = random_tensor(out.shape(), DType::kF64, 10, -1.0, 1.0);
  Tensor dx(x.shape(), DType::kF64);
  backend->rope(RopeArgs{dx, dout, positions, cos, sin, heads, 0, dim, RopeLayout::kAdjacent, true});
  check(check_gradient(
      [&] {
        backend->rope(args);
        return dot(dout, out);
      },
      x, dx, "x"));
}

TEST_CASE("vision_pos_embed resizes the table bilinearly and adds time for several frames",
          "[cpu_ops][vision]") {
  auto backend = make_cpu_backend();
  // A 2 x 3 table of one channel, value 10 * row + column.
  Tensor table = tensor_of({0, 1, 2, 10, 11, 12}, {2, 3, 1});
  SECTION("its own size: the table itself") {
    Tensor x = tensor_of({1, 1, 1, 1, 1, 1}, {6, 1});
    backend->vision_pos_embed({x, table, {}, 1, 2, 3});
    for (int64_t i = 0; i < 6; ++i) CHECK(get_element(x, i) == 1.0 + get_element(table, i));
  }
  SECTION("rows 2 -> 4, columns 3 -> 2") {
    // Rows: sources max(0, (i + 0.5) / 2 - 0.5) = 0, 0.25, 0.75, 1.25 -> 0, 2.5, 7.5, 10 (clamped).
    // Columns: (j + 0.5) * 1.5 - 0.5 = 0.25, 1.75 -> 0.25 and 1.75.
    Tensor x({8, 1}, DType::kF64);
    backend->fill(x, 0.0);
    backend->vision_pos_embed({x, table, {}, 1, 4, 2});
    const std::vector<double> want{0.25, 1.75, 2.75, 4.25, 7.75, 9.25, 10.25, 11.75};
    for (int64_t i = 0; i < 8; ++i) CHECK(std::fabs(get_element(x, i) - want[i]) < 1e-14);
  }
  SECTION("three frames: the same grid plus each frame's time row") {
    Tensor time = tensor_of({100, 200, 300, 400}, {4, 1});
    Tensor x({18, 1}, DType::kF64);
    backend->fill(x, 0.0);
    backend->vision_pos_embed({x, table, time, 3, 2, 3});
    for (int64_t f = 0; f < 3; ++f)
      for (int64_t p = 0; p < 6; ++p) CHECK(get_element(x, f * 6 + p) == get_element(table, p) + 100.0 * (f + 1));
    CHECK_THROWS_AS(backend->vision_pos_embed({x, table, {}, 3, 2, 3}), Error);  // time is needed
  }
}

TEST_CASE("patch_merge averages frames and concatenates 2 x 2 neighbours in raster order", "[cpu_ops][vision]") {
  auto backend = make_cpu_backend();
  // Two frames of a 2 x 4 grid, one channel: frame 0 holds 10 * row + column, frame 1 that + 100.
  std::vector<double> values;
  for (int f = 0; f < 2; ++f)
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 4; ++c) values.push_back(10 * r + c + 100 * f);
  Tensor x = tensor_of(values, {16, 1});
  Tensor out({2, 4}, DType::kF64);
  backend->patch_merge({out, x, 2, 2, 4, 2, 2});
  // Token 0 = patches (0,0) (0,1) (1,0) (1,1); token 1 = (0,2) (0,3) (1,2) (1,3); mean adds 50.
  const std::vector<double> want{50, 51, 60, 61, 52, 53, 62, 63};
  for (int64_t i = 0; i < 8; ++i) CHECK(get_element(out, i) == want[i]);
  Tensor odd({1, 4}, DType::kF64);
  CHECK_THROWS_AS(backend->patch_merge({odd, x, 2, 2, 4, 2, 2}), Error);
  Tensor three_wide = tensor_of({1, 2, 3, 4, 5, 6}, {6, 1});
  CHECK_THROWS_AS(backend->patch_merge({odd, three_wide, 1, 2, 3, 2, 2}), Error);
}
