// CPU reference backend: GEMMs, grouped GEMMs, elementwise and memory ops, embedding.
// Every result is compared with a naive computation in double written here.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "catch.h"
#include "core/base/bf16.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

// The grouped GEMM's arguments every case sets; the rest keep their defaults.
GroupedGemmArgs grouped_gemm_args(const TensorView& c, const TensorView& a, const TensorView& b,
                                  const TensorView& group_offsets) {
  GroupedGemmArgs args;
  args.c = c;
  args.a = a;
  args.b = b;
  args.group_offsets = group_offsets;
  return args;
}

// An M-grouped GEMM of 4 rows (k 2) in 2 groups of n 3, F32, with the group offsets given (the
// offsets checks' case).
struct SmallGroupedGemm {
  explicit SmallGroupedGemm(const std::vector<int32_t>& offset_values)
      : offsets(make_i32(offset_values)), args(grouped_gemm_args(c, a, b, offsets)) {}
  Tensor a = random_tensor({4, 2}, DType::kF32, 1), b = random_tensor({2, 3, 2}, DType::kF32, 2);
  Tensor c{Shape{4, 3}, DType::kF32};
  Tensor offsets;
  GroupedGemmArgs args;
};

// Reference: op(a)[i, p] . op(b)[p, j] in double.
double naive_product(const TensorView& a, const TensorView& b, bool ta, bool tb, int64_t i, int64_t j, int64_t k) {
  double s = 0;
  for (int64_t p = 0; p < k; ++p) {
    double av = ta ? get_element(a, p * a.size(1) + i) : get_element(a, i * a.size(1) + p);
    double bv = tb ? get_element(b, j * b.size(1) + p) : get_element(b, p * b.size(1) + j);
    s += av * bv;
  }
  return s;
}

}  // namespace

TEST_CASE("gemm matches a naive product for every transpose and dtype", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // k = 300 spans more than one k block; n = 270 more than one n block.
  const int64_t m = 5, n = 270, k = 300;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, dtype, 1);
        Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, dtype, 2);
        Tensor c = random_tensor({m, n}, dtype, 3);
        Tensor expected({m, n}, DType::kF64);
        const double alpha = 0.75, beta = -0.5;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            set_element(expected, i * n + j,
                        alpha * naive_product(a, b, ta, tb, i, j, k) + beta * get_element(c, i * n + j));
        backend->gemm({c, a, b, ta, tb, alpha, beta});
        const double tol = dtype == DType::kF32 ? 1e-5 : 1e-12;
        auto cmp = compare_tensors(c, expected, tol, tol, "gemm");
        INFO(dtype_name(dtype) << " ta=" << ta << " tb=" << tb << ": " << cmp.message);
        CHECK(cmp.ok);
      }
    }
  }
}

TEST_CASE("gemm with beta 0 ignores what the output held", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor a = random_tensor({3, 4}, DType::kF32, 1), b = random_tensor({4, 2}, DType::kF32, 2);
  Tensor c({3, 2}, DType::kF32);
  for (int i = 0; i < 6; ++i) c.ptr<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  backend->gemm({c, a, b});
  for (int i = 0; i < 6; ++i) CHECK(std::isfinite(c.ptr<float>()[i]));
  CHECK(std::fabs(c.ptr<float>()[0] - naive_product(a, b, false, false, 0, 0, 4)) < 1e-6);
}

TEST_CASE("gemm gives the weight and input gradients of a linear layer", "[cpu_ops]") {
  // y = x . W^T; L = <dy, y>; dx = dy . W, dW = dy^T . x — all through gemm, checked by FD.
  auto backend = make_cpu_backend();
  Tensor x = random_tensor({4, 3}, DType::kF64, 1), w = random_tensor({5, 3}, DType::kF64, 2);
  Tensor dy = random_tensor({4, 5}, DType::kF64, 3), y({4, 5}, DType::kF64);
  Tensor dx({4, 3}, DType::kF64), dw({5, 3}, DType::kF64);
  auto loss = [&] {
    backend->gemm({y, x, w, false, true});
    return dot(dy, y);
  };
  backend->gemm({dx, dy, w});
  backend->gemm({dw, dy, x, true, false});
  check(check_gradient(loss, x, dx, "x"));
  check(check_gradient(loss, w, dw, "w"));
}

TEST_CASE("gemm rejects mismatched shapes and unsupported dtypes", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor a = random_tensor({3, 4}, DType::kF32, 1), b = random_tensor({5, 2}, DType::kF32, 2);
  Tensor c({3, 2}, DType::kF32);
  const std::string shape_error = error_message([&] { backend->gemm({c, a, b}); });
  CHECK(contains(shape_error, "gemm"));
  CHECK(contains(shape_error, "inner dimensions"));
  Tensor a16({3, 4}, DType::kBF16), b16({4, 2}, DType::kBF16), c16({3, 2}, DType::kBF16);
  const std::string dtype_error = error_message([&] { backend->gemm({c16, a16, b16}); });
  CHECK(contains(dtype_error, "gemm"));
  CHECK(contains(dtype_error, "BF16"));
  Tensor b64 = random_tensor({4, 2}, DType::kF64, 2);
  CHECK_THROWS_AS(backend->gemm({c, a, b64}), Error);
}

TEST_CASE("grouped gemm equals a gemm per group, empty groups included", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // Groups 0 and 3 and the last are empty.
  Tensor offsets = make_i32({0, 0, 3, 7, 7, 8, 8});
  const int64_t groups = 6, rows = 8, k = 5, n = 4;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    const double tol = dtype == DType::kF32 ? 1e-5 : 1e-12;
    for (bool tb : {true, false}) {
      Tensor a = random_tensor({rows, k}, dtype, 10);
      Tensor b = random_tensor(tb ? Shape{groups, n, k} : Shape{groups, k, n}, dtype, 11);
      Tensor c = random_tensor({rows, n}, dtype, 12);
      Tensor expected = random_tensor({rows, n}, dtype, 12);
      GroupedGemmArgs args = grouped_gemm_args(c, a, b, offsets);
      args.kind = GroupedGemmKind::kMGrouped;
      args.transpose_b = tb;
      args.alpha = 1.5;
      args.beta = 0.25;
      backend->grouped_gemm(args);
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t r0 = offsets.ptr<int32_t>()[g], r1 = offsets.ptr<int32_t>()[g + 1];
        if (r0 == r1) continue;
        TensorView bg = b.view().slice_rows(g, g + 1).reshaped(tb ? Shape{n, k} : Shape{k, n});
        backend->gemm({expected.view().slice_rows(r0, r1), a.view().slice_rows(r0, r1), bg, false, tb, 1.5, 0.25});
      }
      auto cmp = compare_tensors(c, expected, tol, tol, "m-grouped");
      INFO(dtype_name(dtype) << " tb=" << tb << ": " << cmp.message);
      CHECK(cmp.ok);
    }
    // K-grouped: c[g] = a_g^T . b_g; an empty group must come out as beta * c[g] (zero for beta 0).
    const int64_t n_out = 3, n_in = 4;
    Tensor dy = random_tensor({rows, n_out}, dtype, 20), x = random_tensor({rows, n_in}, dtype, 21);
    for (double beta : {0.0, 0.5}) {
      Tensor c = random_tensor({groups, n_out, n_in}, dtype, 22);
      Tensor expected = random_tensor({groups, n_out, n_in}, dtype, 22);
      GroupedGemmArgs args = grouped_gemm_args(c, dy, x, offsets);
      args.kind = GroupedGemmKind::kKGrouped;
      args.beta = beta;
      backend->grouped_gemm(args);
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t r0 = offsets.ptr<int32_t>()[g], r1 = offsets.ptr<int32_t>()[g + 1];
        TensorView cg = expected.view().slice_rows(g, g + 1).reshaped({n_out, n_in});
        if (r0 == r1) {  // what a gemm with k = 0 means
          for (int64_t i = 0; i < cg.numel(); ++i) set_element(cg, i, beta * get_element(cg, i));
          continue;
        }
        backend->gemm({cg, dy.view().slice_rows(r0, r1), x.view().slice_rows(r0, r1), true, false, 1.0, beta});
      }
      auto cmp = compare_tensors(c, expected, tol, tol, "k-grouped");
      INFO(dtype_name(dtype) << " beta=" << beta << ": " << cmp.message);
      CHECK(cmp.ok);
      if (beta == 0.0) CHECK(get_element(c, 0) == 0.0);  // group 0 is empty
    }
  }
}

TEST_CASE("grouped gemm's second product equals one product over both inner dimensions", "[cpu_ops]") {
  // c = alpha (a op(b) + a2 op(b2)) + beta c is a op(b) with a' = [a | a2] and b' = [b | b2] along k.
  auto backend = make_cpu_backend();
  Tensor offsets = make_i32({0, 3, 3, 7});
  const int64_t groups = 3, rows = 7, k = 5, k2 = 3, n = 4;
  for (bool tb : {true, false}) {
    Tensor a = random_tensor({rows, k}, DType::kF64, 30), a2 = random_tensor({rows, k2}, DType::kF64, 31);
    Tensor b = random_tensor(tb ? Shape{groups, n, k} : Shape{groups, k, n}, DType::kF64, 32);
    Tensor b2 = random_tensor(tb ? Shape{groups, n, k2} : Shape{groups, k2, n}, DType::kF64, 33);
    Tensor joined_a({rows, k + k2}, DType::kF64);
    Tensor joined_b(tb ? Shape{groups, n, k + k2} : Shape{groups, k + k2, n}, DType::kF64);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < k + k2; ++p)
        set_element(joined_a, r * (k + k2) + p,
                    p < k ? get_element(a, r * k + p) : get_element(a2, r * k2 + p - k));
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k + k2; ++p) {
          const double v = p < k ? get_element(b, tb ? (g * n + j) * k + p : (g * k + p) * n + j)
                                 : get_element(b2, tb ? (g * n + j) * k2 + p - k : (g * k2 + p - k) * n + j);
          set_element(joined_b, tb ? (g * n + j) * (k + k2) + p : (g * (k + k2) + p) * n + j, v);
        }
    Tensor c = random_tensor({rows, n}, DType::kF64, 34), expected = random_tensor({rows, n}, DType::kF64, 34);
    GroupedGemmArgs args = grouped_gemm_args(c, a, b, offsets);
    args.a2 = a2;
    args.b2 = b2;
    args.transpose_b = tb;
    args.alpha = 1.5;
    args.beta = 0.25;
    backend->grouped_gemm(args);
    GroupedGemmArgs joined = args;
    joined.c = expected;
    joined.a = joined_a;
    joined.b = joined_b;
    joined.a2 = TensorView();
    joined.b2 = TensorView();
    backend->grouped_gemm(joined);
    auto cmp = compare_tensors(c, expected, 1e-12, 1e-12, "second product");
    INFO("tb=" << tb << ": " << cmp.message);
    CHECK(cmp.ok);
  }
  // b2 must match a2's inner dimension and b's groups and columns; a k-grouped GEMM has none.
  Tensor a = random_tensor({rows, k}, DType::kF64, 40), a2 = random_tensor({rows, k2}, DType::kF64, 41);
  Tensor b = random_tensor({groups, n, k}, DType::kF64, 42), wrong_b2 = random_tensor({groups, n, k}, DType::kF64, 43);
  Tensor c({rows, n}, DType::kF64);
  GroupedGemmArgs args = grouped_gemm_args(c, a, b, offsets);
  args.a2 = a2;
  args.b2 = wrong_b2;
  CHECK(contains(error_message([&] { backend->grouped_gemm(args); }), "b2"));
  args.b2 = TensorView();
  CHECK(contains(error_message([&] { backend->grouped_gemm(args); }), "a2 and b2"));
}

TEST_CASE("grouped gemm rejects offsets that do not cover the rows", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const SmallGroupedGemm gemm({0, 3, 5});
  CHECK(contains(error_message([&] { backend->grouped_gemm(gemm.args); }), "group_offsets"));
}

TEST_CASE("grouped gemm checks a host copy of the offsets against the offsets", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  SmallGroupedGemm gemm({0, 3, 4});
  GroupedGemmArgs& args = gemm.args;
  const int32_t same[3] = {0, 3, 4}, stale[3] = {0, 2, 4};
  args.host_group_offsets = same;
  backend->grouped_gemm(args);
  args.host_group_offsets = stale;
  CHECK(contains(error_message([&] { backend->grouped_gemm(args); }), "host_group_offsets[1] = 2"));
}

TEST_CASE("axpby, sum_squares and fill", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor x = random_tensor({2, 3}, DType::kF64, 1), y = random_tensor({2, 3}, DType::kF64, 2);
  std::vector<double> y0(static_cast<double*>(y.data()), static_cast<double*>(y.data()) + 6);
  backend->axpby(y, x, 2.0, -3.0);
  double expected_ss = 0;
  for (int i = 0; i < 6; ++i) {
    const double e = 2.0 * get_element(x, i) - 3.0 * y0[i];
    CHECK(std::fabs(get_element(y, i) - e) < 1e-14);
    expected_ss += e * e;
  }
  CHECK(std::fabs(backend->sum_squares(y) - expected_ss) < 1e-12);
  Tensor f({7}, DType::kF32);
  backend->fill(f, 0.1);
  for (int i = 0; i < 7; ++i) CHECK(f.ptr<float>()[i] == 0.1f);
  Tensor fb({3}, DType::kBF16);
  backend->fill(fb, 1.0);
  CHECK(fb.view().ptr_u16()[2] == 0x3f80);
  Tensor fi({3}, DType::kI32);
  backend->fill(fi, -2.0);
  CHECK(fi.ptr<int32_t>()[1] == -2);
}

TEST_CASE("copy_columns splits, broadcasts and accumulates head parts", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // src [2 tokens, 5], dst [2 tokens * 3 heads, 6]: dst[r, 1..3] (+)= src[r / 3, 2..4]
  Tensor src = random_tensor({2, 5}, DType::kF64, 1);
  for (bool accumulate : {false, true}) {
    Tensor dst = random_tensor({6, 6}, DType::kF64, 2);
    Tensor before = random_tensor({6, 6}, DType::kF64, 2);
    backend->copy_columns({dst, src, 1, 2, 3, 3, accumulate});
    for (int64_t r = 0; r < 6; ++r) {
      for (int64_t c = 0; c < 6; ++c) {
        double expected = get_element(before, r * 6 + c);
        if (c >= 1 && c < 4) {
          const double s = get_element(src, (r / 3) * 5 + 2 + (c - 1));
          expected = accumulate ? expected + s : s;
        }
        CHECK(get_element(dst, r * 6 + c) == expected);
      }
    }
  }
  Tensor dst({6, 6}, DType::kF64);
  CHECK_THROWS_AS(backend->copy_columns({dst, src, 4, 2, 3, 3, false}), Error);  // past dst's width
  CHECK_THROWS_AS(backend->copy_columns({dst, src, 1, 2, 3, 2, false}), Error);  // 2 * 2 rows != 6
}

TEST_CASE("copy_block copies, scales and accumulates a rectangle of every matrix of a batch", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // src [2, 4, 5], dst [2, 6, 3]: dst[b, 2 + i, 1 + j] (+)= 0.5 * src[b, 1 + i, 3 + j], i < 3, j < 2
  Tensor src = random_tensor({2, 4, 5}, DType::kF64, 1);
  for (bool accumulate : {false, true}) {
    Tensor dst = random_tensor({2, 6, 3}, DType::kF64, 2);
    Tensor before = random_tensor({2, 6, 3}, DType::kF64, 2);
    CopyBlockArgs args{dst, src, 2, 1, 1, 3, 3, 2, 0.5, accumulate};
    backend->copy_block(args);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t r = 0; r < 6; ++r) {
        for (int64_t c = 0; c < 3; ++c) {
          const int64_t at = (b * 6 + r) * 3 + c;
          double expected = get_element(before, at);
          if (r >= 2 && r < 5 && c >= 1) {
            const double v = 0.5 * get_element(src, (b * 4 + 1 + (r - 2)) * 5 + 3 + (c - 1));
            expected = accumulate ? expected + v : v;
          }
          CHECK(get_element(dst, at) == expected);
        }
      }
    }
  }
  Tensor dst({2, 6, 3}, DType::kF64);
  CHECK_THROWS_AS(backend->copy_block({dst, src, 4, 1, 1, 3, 3, 2, 1.0, false}), Error);  // rows 4..7 of 6
  CHECK_THROWS_AS(backend->copy_block({dst, src, 2, 1, 1, 4, 3, 2, 1.0, false}), Error);  // columns 4..6 of 5
  Tensor other_batch({3, 6, 3}, DType::kF64);
  CHECK_THROWS_AS(backend->copy_block({other_batch, src, 0, 0, 0, 0, 1, 1, 1.0, false}), Error);
  Tensor flat({36}, DType::kF64);
  CHECK_THROWS_AS(backend->copy_block({flat, src, 0, 0, 0, 0, 1, 1, 1.0, false}), Error);  // not 3-D
}

TEST_CASE("sum_over_heads sums each token's heads", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor src = random_tensor({3, 4, 2}, DType::kF32, 1);
  Tensor dst = random_tensor({3, 2}, DType::kF32, 2);
  backend->sum_over_heads(dst, src);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t d = 0; d < 2; ++d) {
      double s = 0;
      for (int64_t h = 0; h < 4; ++h) s += get_element(src, (t * 4 + h) * 2 + d);
      CHECK(std::fabs(get_element(dst, t * 2 + d) - s) < 1e-6);
    }
}

TEST_CASE("copy and convert between float types round to nearest even", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  // Values exactly representable in bf16 survive f32 -> bf16 -> f32 and bf16 -> f64 -> bf16.
  std::vector<uint16_t> bits = {0x3f80, 0xc0a0, 0x0001, 0x7f7f, 0x8000, 0x3e9a, 0x4049};
  Tensor b16({static_cast<int64_t>(bits.size())}, DType::kBF16);
  std::memcpy(b16.data(), bits.data(), bits.size() * 2);
  Tensor f32({b16.numel()}, DType::kF32), f64({b16.numel()}, DType::kF64), back({b16.numel()}, DType::kBF16);
  backend->convert(f32, b16);
  for (size_t i = 0; i < bits.size(); ++i) CHECK(f32.ptr<float>()[i] == bf16_to_float(bits[i]));
  backend->convert(back, f32);
  CHECK(std::memcmp(back.data(), bits.data(), bits.size() * 2) == 0);
  backend->convert(f64, b16);
  std::memset(back.data(), 0, back.nbytes());
  backend->convert(back, f64);
  CHECK(std::memcmp(back.data(), bits.data(), bits.size() * 2) == 0);

  // Rounding: 1 + 2^-8 is a tie between 1 (even) and 1 + 2^-7; 1 + 3 * 2^-8 rounds up to even.
  Tensor f({3}, DType::kF32), r({3}, DType::kBF16);
  f.ptr<float>()[0] = 1.0f + std::ldexp(1.0f, -8);
  f.ptr<float>()[1] = 1.0f + 3 * std::ldexp(1.0f, -8);
  f.ptr<float>()[2] = -(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20));
  backend->convert(r, f);
  CHECK(r.view().ptr_u16()[0] == 0x3f80);
  CHECK(r.view().ptr_u16()[1] == 0x3f82);
  CHECK(r.view().ptr_u16()[2] == 0xbf81);

  // F64 -> BF16 rounds the double directly: 1 + 2^-8 + 2^-40 is just above the tie, so it rounds
  // up, although rounding it to float first would land exactly on the tie and round down.
  Tensor d({1}, DType::kF64), rd({1}, DType::kBF16);
  d.ptr<double>()[0] = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  backend->convert(rd, d);
  CHECK(rd.view().ptr_u16()[0] == 0x3f81);

  // F16 -> F32 and back.
  Tensor h({2}, DType::kF16), hf({2}, DType::kF32), h2({2}, DType::kF16);
  h.view().ptr_u16()[0] = 0x3555;  // 0.333251953125
  h.view().ptr_u16()[1] = 0xfbff;  // -65504
  backend->convert(hf, h);
  CHECK(hf.ptr<float>()[0] == 0.333251953125f);
  CHECK(hf.ptr<float>()[1] == -65504.0f);
  backend->convert(h2, hf);
  CHECK(std::memcmp(h2.data(), h.data(), 4) == 0);

  Tensor copy_dst({b16.numel()}, DType::kF32);
  backend->copy(copy_dst, f32);
  CHECK(std::memcmp(copy_dst.data(), f32.data(), f32.nbytes()) == 0);
  CHECK_THROWS_AS(backend->copy(copy_dst, f64), Error);  // copy never converts
}

TEST_CASE("embedding gathers rows and accumulates their gradient in token order", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor table = random_tensor({5, 3}, DType::kF64, 1);
  Tensor ids = make_i32({4, 0, 4, 2});
  Tensor out({4, 3}, DType::kF64);
  backend->embedding_forward(out, table, ids);
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t d = 0; d < 3; ++d)
      CHECK(get_element(out, t * 3 + d) == get_element(table, ids.ptr<int32_t>()[t] * 3 + d));

  // Backward accumulates (+=): start from a non-zero dtable and check against FD of <dy, out>.
  Tensor dy = random_tensor({4, 3}, DType::kF64, 2);
  Tensor dtable = Tensor::zeros({5, 3}, DType::kF64);
  backend->embedding_backward(dtable, dy, ids);
  auto cmp = check_gradient([&] { backend->embedding_forward(out, table, ids); return dot(dy, out); }, table,
                            dtable, "table");
  INFO(cmp.message);
  CHECK(cmp.ok);
  // Row 4 is used twice: its gradient is the sum; unused rows 1 and 3 stay zero.
  CHECK(get_element(dtable, 4 * 3) == get_element(dy, 0) + get_element(dy, 2 * 3));
  CHECK(get_element(dtable, 1 * 3) == 0.0);
  Tensor dtable2 = random_tensor({5, 3}, DType::kF64, 3);
  const double before = get_element(dtable2, 3);
  backend->embedding_backward(dtable2, dy, ids);
  CHECK(get_element(dtable2, 3) == before);  // row 1 untouched
}

TEST_CASE("embedding rejects a token id outside the table as bad data", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor table = random_tensor({5, 3}, DType::kF32, 1);
  Tensor out({3, 3}, DType::kF32);
  Tensor ids = make_i32({1, 5, 0});
  try {
    backend->embedding_forward(out, table, ids);
    FAIL("no error for token id 5 with 5 rows");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadData);
    CHECK(contains(e.what(), "token position 1"));
    CHECK(contains(e.what(), "token id 5"));
  }
  Tensor negative = make_i32({1, 0, -1});
  CHECK_THROWS_AS(backend->embedding_forward(out, table, negative), Error);
}
