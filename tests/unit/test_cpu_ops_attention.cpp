// CPU causal attention: forward against a naive full-matrix implementation written here (masking
// by segment and causality, a plain softmax), backward by finite differences in double.
#include <cmath>
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

namespace {

struct Problem {
  int64_t tokens, heads, qk_dim, v_dim;
  std::vector<int32_t> cu_seqlens;
  double scale;
};

// Segments of 3, 1, 0 and 5 tokens: a single-token segment and an empty one; qk_dim != v_dim.
Problem default_problem() { return Problem{9, 2, 5, 3, {0, 3, 4, 4, 9}, 0.45}; }

// The textbook definition: the full [tokens, tokens] score matrix per head, -inf where a key is
// in another segment or in the future, softmax over each row, then P . V.
void naive_attention(std::vector<double>& out, std::vector<double>& lse, const Problem& pb, const Tensor& q,
                     const Tensor& k, const Tensor& v) {
  const int64_t n = pb.tokens;
  std::vector<int64_t> segment_of(n);
  for (size_t s = 0; s + 1 < pb.cu_seqlens.size(); ++s)
    for (int64_t t = pb.cu_seqlens[s]; t < pb.cu_seqlens[s + 1]; ++t) segment_of[t] = static_cast<int64_t>(s);
  out.assign(n * pb.heads * pb.v_dim, 0.0);
  lse.assign(n * pb.heads, 0.0);
  const double* qp = q.ptr<double>();
  const double* kp = k.ptr<double>();
  const double* vp = v.ptr<double>();
  for (int64_t h = 0; h < pb.heads; ++h) {
    std::vector<double> scores(n * n);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s = 0; s < n; ++s) {
        double dot = 0.0;
        for (int64_t c = 0; c < pb.qk_dim; ++c)
          dot += qp[(t * pb.heads + h) * pb.qk_dim + c] * kp[(s * pb.heads + h) * pb.qk_dim + c];
        const bool visible = segment_of[s] == segment_of[t] && s <= t;
        scores[t * n + s] = visible ? pb.scale * dot : -std::numeric_limits<double>::infinity();
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      double total = 0.0;
      for (int64_t s = 0; s < n; ++s) total += std::exp(scores[t * n + s]);
      lse[t * pb.heads + h] = std::log(total);
      for (int64_t s = 0; s < n; ++s) {
        const double p = std::exp(scores[t * n + s]) / total;
        for (int64_t c = 0; c < pb.v_dim; ++c)
          out[(t * pb.heads + h) * pb.v_dim + c] += p * vp[(s * pb.heads + h) * pb.v_dim + c];
      }
    }
  }
}

template <typename T>
void run_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& cu, double scale) {
  AttentionArgs args{out, lse, q, k, v, cu, scale};
  cpu::attention_forward<T>(args);
}

}  // namespace

TEST_CASE("attention forward matches the full-matrix definition", "[attention]") {
  const Problem pb = default_problem();
  Tensor q = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 1, 0.1, 1.5);
  Tensor k = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 2, 0.1, 1.5);
  Tensor v = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF64, 3);
  Tensor cu = make_i32(pb.cu_seqlens);
  std::vector<double> want_out, want_lse;
  naive_attention(want_out, want_lse, pb, q, k, v);
  Tensor expected_out = tensor_of(want_out, {pb.tokens, pb.heads, pb.v_dim}, DType::kF64);
  Tensor expected_lse = tensor_of(want_lse, {pb.tokens, pb.heads}, DType::kF64);

  SECTION("double") {
    Tensor out({pb.tokens, pb.heads, pb.v_dim}, DType::kF64), lse({pb.tokens, pb.heads}, DType::kF64);
    run_forward<double>(out, lse, q, k, v, cu, pb.scale);
    check(compare_tensors(out, expected_out, 1e-12, 1e-13, "out"));
    check(compare_tensors(lse, expected_lse, 1e-12, 1e-13, "lse"));
    // The single-token segment (token 3) attends only to itself: out = v exactly.
    for (int64_t h = 0; h < pb.heads; ++h)
      for (int64_t c2 = 0; c2 < pb.v_dim; ++c2)
        CHECK(out.ptr<double>()[(3 * pb.heads + h) * pb.v_dim + c2] ==
              v.ptr<double>()[(3 * pb.heads + h) * pb.v_dim + c2]);
  }
  SECTION("float") {
    Tensor qf = copy_as(q, DType::kF32), kf = copy_as(k, DType::kF32), vf = copy_as(v, DType::kF32);
    Tensor out({pb.tokens, pb.heads, pb.v_dim}, DType::kF32), lse({pb.tokens, pb.heads}, DType::kF32);
    run_forward<float>(out, lse, qf, kf, vf, cu, pb.scale);
    check(compare_tensors(out, expected_out, 1e-5, 1e-6, "out"));
    check(compare_tensors(lse, expected_lse, 1e-5, 1e-6, "lse"));
  }
}

TEST_CASE("attention forward is stable for large logits", "[attention]") {
  // Scores of several hundred would overflow exp() without the max subtraction.
  Problem pb{4, 1, 2, 2, {0, 4}, 100.0};
  Tensor q = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF32, 11, 1.0, 3.0);
  Tensor k = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF32, 12, 1.0, 3.0);
  Tensor v = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF32, 13);
  Tensor out({pb.tokens, pb.heads, pb.v_dim}, DType::kF32), lse({pb.tokens, pb.heads}, DType::kF32);
  Tensor cu = make_i32(pb.cu_seqlens);
  run_forward<float>(out, lse, q, k, v, cu, pb.scale);
  for (int64_t i = 0; i < out.numel(); ++i) CHECK(std::isfinite(out.ptr<float>()[i]));
  for (int64_t i = 0; i < lse.numel(); ++i) CHECK(std::isfinite(lse.ptr<float>()[i]));
}

TEST_CASE("attention backward matches finite differences", "[attention][grad]") {
  const Problem pb = default_problem();
  Tensor q = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 21, 0.1, 1.5);
  Tensor k = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 22, 0.1, 1.5);
  Tensor v = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF64, 23);
  Tensor dout = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF64, 24);
  Tensor cu = make_i32(pb.cu_seqlens);
  Tensor out({pb.tokens, pb.heads, pb.v_dim}, DType::kF64), lse({pb.tokens, pb.heads}, DType::kF64);
  run_forward<double>(out, lse, q, k, v, cu, pb.scale);

  // Gradients are overwritten: start from garbage.
  Tensor dq = random_tensor(q.shape(), DType::kF64, 91, 5.0, 9.0);
  Tensor dk = random_tensor(k.shape(), DType::kF64, 92, 5.0, 9.0);
  Tensor dv = random_tensor(v.shape(), DType::kF64, 93, 5.0, 9.0);
  AttentionBackwardArgs args{dq, dk, dv, dout, q, k, v, out, lse, cu, pb.scale};
  cpu::attention_backward<double>(args);

  Tensor scratch_out(out.shape(), DType::kF64), scratch_lse(lse.shape(), DType::kF64);
  auto loss = [&] {
    run_forward<double>(scratch_out, scratch_lse, q, k, v, cu, pb.scale);
    return moetrain::testing::dot(dout, scratch_out);
  };
  moetrain::testing::GradCheckOptions options;
  options.max_elements = 200;  // every element
  for (auto [input, grad, name] : {std::tuple<const Tensor*, const Tensor*, const char*>{&q, &dq, "q"},
                                   {&k, &dk, "k"},
                                   {&v, &dv, "v"}}) {
    check(check_gradient(loss, *input, *grad, name, options));
  }
}

TEST_CASE("attention backward in float agrees with double", "[attention][grad]") {
  const Problem pb = default_problem();
  Tensor q = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 31);
  Tensor k = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF64, 32);
  Tensor v = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF64, 33);
  Tensor dout = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF64, 34);
  Tensor cu = make_i32(pb.cu_seqlens);
  auto run = [&](DType dtype, Tensor& dq, Tensor& dk, Tensor& dv) {
    Tensor qx = copy_as(q, dtype), kx = copy_as(k, dtype), vx = copy_as(v, dtype), gx = copy_as(dout, dtype);
    Tensor out(v.shape(), dtype), lse({pb.tokens, pb.heads}, dtype);
    dq = Tensor(q.shape(), dtype);
    dk = Tensor(k.shape(), dtype);
    dv = Tensor(v.shape(), dtype);
    AttentionBackwardArgs args{dq, dk, dv, gx, qx, kx, vx, out, lse, cu, pb.scale};
    if (dtype == DType::kF32) {
      run_forward<float>(out, lse, qx, kx, vx, cu, pb.scale);
      cpu::attention_backward<float>(args);
    } else {
      run_forward<double>(out, lse, qx, kx, vx, cu, pb.scale);
      cpu::attention_backward<double>(args);
    }
  };
  Tensor dq64, dk64, dv64, dq32, dk32, dv32;
  run(DType::kF64, dq64, dk64, dv64);
  run(DType::kF32, dq32, dk32, dv32);
  for (auto [a, b, name] : {std::tuple<Tensor*, Tensor*, const char*>{&dq32, &dq64, "dq"},
                            {&dk32, &dk64, "dk"},
                            {&dv32, &dv64, "dv"}}) {
    check(compare_tensors(*a, *b, 1e-4, 1e-5, name));
  }
}

TEST_CASE("attention rejects inconsistent cu_seqlens", "[attention]") {
  Tensor q = random_tensor({4, 1, 2}, DType::kF64, 1), k = random_tensor({4, 1, 2}, DType::kF64, 2);
  Tensor v = random_tensor({4, 1, 2}, DType::kF64, 3);
  Tensor out({4, 1, 2}, DType::kF64), lse({4, 1}, DType::kF64);
  Tensor short_cu = make_i32({0, 3});
  CHECK_THROWS_AS(run_forward<double>(out, lse, q, k, v, short_cu, 1.0), Error);
  Tensor decreasing = make_i32({0, 3, 2, 4});
  CHECK_THROWS_AS(run_forward<double>(out, lse, q, k, v, decreasing, 1.0), Error);
}

TEST_CASE("attention through the CPU backend", "[attention][backend]") {
  const Problem pb = default_problem();
  auto backend = make_cpu_backend();
  Tensor q = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF32, 41);
  Tensor k = random_tensor({pb.tokens, pb.heads, pb.qk_dim}, DType::kF32, 42);
  Tensor v = random_tensor({pb.tokens, pb.heads, pb.v_dim}, DType::kF32, 43);
  Tensor cu = make_i32(pb.cu_seqlens);
  Tensor out({pb.tokens, pb.heads, pb.v_dim}, DType::kF32), lse({pb.tokens, pb.heads}, DType::kF32);
  Tensor direct_out(out.shape(), DType::kF32), direct_lse(lse.shape(), DType::kF32);
  AttentionArgs args{out, lse, q, k, v, cu, pb.scale};
  backend->attention_forward(args);
  run_forward<float>(direct_out, direct_lse, q, k, v, cu, pb.scale);
  check(compare_tensors(out, direct_out, 0.0, 0.0, "backend out"));
  // A mixed-dtype call is refused rather than misread.
  Tensor lse64({pb.tokens, pb.heads}, DType::kF64);
  CHECK_THROWS_AS(backend->attention_forward(AttentionArgs{out, lse64, q, k, v, cu, pb.scale}), Error);
}
