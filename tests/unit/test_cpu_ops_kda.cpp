// CPU reference backend: the KDA family (short conv, l2norm, KDA gate, sigmoid, gated RMSNorm,
// KDA itself). Forwards against naive double computations written here from the formulas of
// transformers' kimi_linear; backwards against central differences in double; the chunked KDA
// (the backend's) against the recurrent oracle, forward and backward.
#include <array>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/cpu/kda.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/kda_inputs.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

double softplus(double x) { return std::log1p(std::exp(x)); }

KdaArgs forward_args(const KdaInputs& in, const TensorView& out) {
  return {out, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale};
}

struct KdaGrads {
  Tensor dq, dk, dv, dg, dbeta;
  explicit KdaGrads(const KdaInputs& in)
      // Filled with garbage: every gradient must be overwritten.
      : dq(random_tensor(in.q.shape(), DType::kF64, 91)),
        dk(random_tensor(in.k.shape(), DType::kF64, 92)),
        dv(random_tensor(in.v.shape(), DType::kF64, 93)),
        dg(random_tensor(in.g.shape(), DType::kF64, 94)),
        dbeta(random_tensor(in.beta.shape(), DType::kF64, 95)) {}
  KdaBackwardArgs args(const KdaInputs& in) const {
    return {dq, dk, dv, dg, dbeta, in.dout, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale};
  }
};

// KDA forward and backward of `in` on `backend`, in F64.
struct KdaRun {
  Tensor out;
  KdaGrads grads;
  KdaRun(Backend& backend, const KdaInputs& in) : out({in.tokens, in.heads, in.vd}, DType::kF64), grads(in) {
    backend.kda_forward(forward_args(in, out));
    backend.kda_backward(grads.args(in));
  }
};

// Every output of KDA forward and backward against the same outputs of another run, named.
void check_kda_outputs(const std::array<TensorView, 6>& got, const std::array<TensorView, 6>& want, double rtol,
                       double atol) {
  const char* names[6] = {"out", "dq", "dk", "dv", "dg", "dbeta"};
  for (size_t i = 0; i < got.size(); ++i) check(compare_tensors(got[i], want[i], rtol, atol, names[i]));
}

using KdaForward = std::function<void(const KdaArgs&)>;
using KdaBackward = std::function<void(const KdaBackwardArgs&)>;

struct KdaForm {
  std::string name;
  KdaForward forward;
  KdaBackward backward;
};

KdaForm recurrent_form() {
  return {"recurrent", cpu::kda_recurrent_forward<double>, cpu::kda_recurrent_backward<double>};
}
KdaForm chunked_form(int64_t chunk) {
  return {"chunked(" + std::to_string(chunk) + ")",
          [chunk](const KdaArgs& a) { cpu::kda_chunked_forward<double>(a, chunk); },
          [chunk](const KdaBackwardArgs& a) { cpu::kda_chunked_backward<double>(a, chunk); }};
}

// The recurrence exactly as the interface writes it, with explicit matrices:
//   S_t = (I - beta k k^T) Diag(exp(g)) S_{t-1} + beta k v^T,  out_t = S_t^T (scale q_t)
Tensor naive_kda(const KdaInputs& in) {
  Tensor out({in.tokens, in.heads, in.vd}, DType::kF64);
  const int32_t* cu = in.cu_seqlens.ptr<int32_t>();
  const int64_t kd = in.kd, vd = in.vd;
  for (int64_t s = 0; s + 1 < in.cu_seqlens.numel(); ++s) {
    for (int64_t h = 0; h < in.heads; ++h) {
      std::vector<double> state(kd * vd, 0.0);
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
        const int64_t row = t * in.heads + h;
        auto k = [&](int64_t a) { return get_element(in.k, row * kd + a); };
        const double beta = get_element(in.beta, row);
        std::vector<double> decayed(kd * vd), next(kd * vd);
        for (int64_t a = 0; a < kd; ++a)
          for (int64_t b = 0; b < vd; ++b)
            decayed[a * vd + b] = std::exp(get_element(in.g, row * kd + a)) * state[a * vd + b];
        for (int64_t a = 0; a < kd; ++a)
          for (int64_t b = 0; b < vd; ++b) {
            double x = decayed[a * vd + b];  // (I - beta k k^T) row a
            for (int64_t c = 0; c < kd; ++c) x -= beta * k(a) * k(c) * decayed[c * vd + b];
            next[a * vd + b] = x + beta * k(a) * get_element(in.v, row * vd + b);
          }
        state = next;
        for (int64_t b = 0; b < vd; ++b) {
          double o = 0;
          for (int64_t a = 0; a < kd; ++a) o += state[a * vd + b] * in.scale * get_element(in.q, row * kd + a);
          set_element(out, row * vd + b, o);
        }
      }
    }
  }
  return out;
}

// Every gradient of `form`'s backward against central differences of its forward.
void check_kda_gradients(const KdaForm& form, const KdaInputs& in) {
  Tensor out({in.tokens, in.heads, in.vd}, DType::kF64);
  auto loss = [&] {
    form.forward(forward_args(in, out));
    return dot(in.dout, out);
  };
  KdaGrads gr(in);
  form.backward(gr.args(in));
  GradCheckOptions options;
  options.max_elements = 48;
  options.atol = 1e-8;
  INFO(form.name << ", " << in.tokens << " tokens");
  check(check_gradient(loss, in.q, gr.dq, "q", options));
  check(check_gradient(loss, in.k, gr.dk, "k", options));
  check(check_gradient(loss, in.v, gr.dv, "v", options));
  check(check_gradient(loss, in.g, gr.dg, "g", options));
  check(check_gradient(loss, in.beta, gr.dbeta, "beta", options));
}

// `form` (forward and every gradient) against the recurrent oracle.
void check_against_recurrent(const KdaForm& form, const KdaInputs& in, double tol) {
  INFO(form.name << ", " << in.tokens << " tokens");
  Tensor expected({in.tokens, in.heads, in.vd}, DType::kF64), actual({in.tokens, in.heads, in.vd}, DType::kF64);
  cpu::kda_recurrent_forward<double>(forward_args(in, expected));
  form.forward(forward_args(in, actual));
  check(compare_tensors(actual, expected, tol, tol, "out"));
  KdaGrads want(in), got(in);
  cpu::kda_recurrent_backward<double>(want.args(in));
  form.backward(got.args(in));
  check(compare_tensors(got.dq, want.dq, tol, tol, "dq"));
  check(compare_tensors(got.dk, want.dk, tol, tol, "dk"));
  check(compare_tensors(got.dv, want.dv, tol, tol, "dv"));
  check(compare_tensors(got.dg, want.dg, tol, tol, "dg"));
  check(compare_tensors(got.dbeta, want.dbeta, tol, tol, "dbeta"));
}

}  // namespace

TEST_CASE("kda recurrent oracle follows the gated delta rule as written", "[cpu_ops][kda]") {
  for (std::vector<int32_t> cu : {std::vector<int32_t>{0, 1}, {0, 9}, {0, 5, 5, 12}}) {
    const KdaInputs in = make_kda_inputs(cu, 2, 4, 3, 10);
    Tensor out({in.tokens, in.heads, in.vd}, DType::kF64);
    cpu::kda_recurrent_forward<double>(forward_args(in, out));
    check(compare_tensors(out, naive_kda(in), 1e-13, 1e-13, "out"));
  }
}

TEST_CASE("kda backward matches finite differences (recurrent and chunked)", "[cpu_ops][kda]") {
  const KdaInputs short_doc = make_kda_inputs({0, 11}, 2, 4, 3, 20);
  check_kda_gradients(recurrent_form(), short_doc);
  check_kda_gradients(chunked_form(4), short_doc);     // several chunks, the last one short
  check_kda_gradients(chunked_form(64), short_doc);    // one partial chunk
  const KdaInputs packed = make_kda_inputs({0, 70, 72, 135}, 1, 3, 2, 30);
  check_kda_gradients(chunked_form(64), packed);       // full + partial chunks, segments inside
  check_kda_gradients(recurrent_form(), packed);
}

TEST_CASE("chunked kda equals the recurrent form, forward and backward", "[cpu_ops][kda]") {
  for (int32_t length : {1, 63, 64, 65, 130}) {
    const KdaInputs in = make_kda_inputs({0, length}, 2, 5, 3, 40 + length);
    check_against_recurrent(chunked_form(cpu::kKdaChunk), in, 1e-10);
    check_against_recurrent(chunked_form(7), in, 1e-10);
  }
  const KdaInputs packed = make_kda_inputs({0, 3, 70, 70, 200}, 2, 4, 4, 50);
  check_against_recurrent(chunked_form(cpu::kKdaChunk), packed, 1e-10);
}

TEST_CASE("kda on packed documents equals each document alone", "[cpu_ops][kda]") {
  const std::vector<int32_t> lengths = {70, 65};
  const KdaInputs packed = make_kda_inputs({0, 70, 135}, 2, 4, 3, 60);
  auto backend = make_cpu_backend();
  const KdaRun whole(*backend, packed);
  const KdaGrads& gr = whole.grads;
  int64_t start = 0;
  for (int32_t length : lengths) {
    // The document alone: its rows of every input.
    const KdaInputs doc = rows_of(packed, start, start + length, {0, length});
    const KdaRun alone(*backend, doc);
    const KdaGrads& doc_gr = alone.grads;
    INFO("document at " << start);
    auto rows = [&](const Tensor& t) { return t.view().slice_rows(start, start + length); };
    check_kda_outputs({rows(whole.out), rows(gr.dq), rows(gr.dk), rows(gr.dv), rows(gr.dg), rows(gr.dbeta)},
                      {alone.out, doc_gr.dq, doc_gr.dk, doc_gr.dv, doc_gr.dg, doc_gr.dbeta}, 0, 1e-14);
    start += length;
  }
}

TEST_CASE("kda stays finite and exact under very strong decays", "[cpu_ops][kda]") {
  // g down to -80 per token: cumulative decays of exp(-5000) inside a chunk, which a form that
  // divides by exp(G) would turn into inf * 0.
  KdaInputs in = make_kda_inputs({0, 100}, 1, 4, 2, 70);
  for (int64_t i = 0; i < in.g.numel(); i += 3) set_element(in.g, i, -80.0);
  check_against_recurrent(chunked_form(cpu::kKdaChunk), in, 1e-10);
}

TEST_CASE("kda in F32 agrees with F64", "[cpu_ops][kda]") {
  const KdaInputs in = make_kda_inputs({0, 40, 100}, 2, 8, 4, 80);
  auto backend = make_cpu_backend();
  const KdaRun f64(*backend, in);
  const KdaGrads& gr64 = f64.grads;

  Tensor q = copy_as(in.q, DType::kF32), k = copy_as(in.k, DType::kF32), v = copy_as(in.v, DType::kF32);
  Tensor g = copy_as(in.g, DType::kF32), beta = copy_as(in.beta, DType::kF32), dout = copy_as(in.dout, DType::kF32);
  Tensor out({in.tokens, in.heads, in.vd}, DType::kF32);
  backend->kda_forward({out, q, k, v, g, beta, in.cu_seqlens, in.scale});
  Tensor dq(q.shape(), DType::kF32), dk(k.shape(), DType::kF32), dv(v.shape(), DType::kF32);
  Tensor dg(g.shape(), DType::kF32), dbeta(beta.shape(), DType::kF32);
  backend->kda_backward({dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, in.cu_seqlens, in.scale});
  check_kda_outputs({out, dq, dk, dv, dg, dbeta}, {f64.out, gr64.dq, gr64.dk, gr64.dv, gr64.dg, gr64.dbeta}, 1e-4, 1e-5);
}

TEST_CASE("kda rejects bad shapes, dtypes and segments naming the op and tensor", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const KdaInputs in = make_kda_inputs({0, 6}, 2, 4, 3, 90);
  Tensor out({in.tokens, in.heads, in.vd}, DType::kF64);
  KdaArgs args = forward_args(in, out);
  Tensor short_k({in.tokens, in.heads, in.kd - 1}, DType::kF64);
  Tensor beta_flat({in.tokens * in.heads}, DType::kF64);
  Tensor g32({in.tokens, in.heads, in.kd}, DType::kF32);
  Tensor bad_cu = make_i32({0, 5});
  auto message = [&](auto change) {
    KdaArgs a = args;
    change(a);
    return error_message([&] { backend->kda_forward(a); });
  };
  const std::string wrong_k = message([&](KdaArgs& a) { a.k = short_k; });
  CHECK(contains(wrong_k, "kda_forward"));
  CHECK(contains(wrong_k, "k [6, 2, 3]"));
  CHECK(contains(message([&](KdaArgs& a) { a.beta = beta_flat; }), "beta [12]"));
  CHECK(contains(message([&](KdaArgs& a) { a.g = g32; }), "g is F32, expected F64"));
  CHECK(contains(message([&](KdaArgs& a) { a.cu_seqlens = bad_cu; }), "cu_seqlens ends at 5, expected 6"));
  CHECK(contains(message([&](KdaArgs& a) { a.out = in.q; }), "out [6, 2, 4]"));

  KdaGrads gr(in);
  KdaBackwardArgs bargs = gr.args(in);
  bargs.dbeta = beta_flat;
  const std::string wrong_dbeta = error_message([&] { backend->kda_backward(bargs); });
  CHECK(contains(wrong_dbeta, "kda_backward"));
  CHECK(contains(wrong_dbeta, "dbeta [12]"));
}

// ---------------------------------------------------------------------------------------------
// Short convolution

namespace {

// y[t, c] = act(sum_i w[c, i] x[t - W + 1 + i, c]) with x zero before the segment's start.
Tensor naive_short_conv(const Tensor& x, const Tensor& w, const std::vector<int32_t>& cu, bool silu) {
  const int64_t channels = x.size(1), width = w.size(1);
  Tensor y(x.shape(), DType::kF64);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      for (int64_t c = 0; c < channels; ++c) {
        double z = 0;
        for (int64_t i = 0; i < width; ++i) {
          const int64_t src = t - width + 1 + i;
          if (src >= cu[s]) z += get_element(w, c * width + i) * get_element(x, src * channels + c);
        }
        set_element(y, t * channels + c, silu ? z * sigmoid(z) : z);
      }
  return y;
}

}  // namespace

TEST_CASE("short conv forward matches a naive computation, segments reset its history", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const std::vector<int32_t> cu = {0, 2, 9, 9, 13};  // a segment shorter than the width, an empty one
  const int64_t channels = 5, width = 4;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    for (bool silu : {true, false}) {
      Tensor x = random_tensor({13, channels}, dtype, 1, 0.1, 2.0), w = random_tensor({channels, width}, dtype, 2);
      Tensor y({13, channels}, dtype);
      backend->short_conv_forward({y, x, w, make_i32(cu), silu});
      const double tol = dtype == DType::kF32 ? 1e-6 : 1e-14;
      INFO(dtype_name(dtype) << " silu " << silu);
      check(compare_tensors(y, naive_short_conv(copy_as(x, DType::kF64), copy_as(w, DType::kF64), cu, silu), tol,
                            tol, "y"));
    }
  }
}

TEST_CASE("short conv backward matches finite differences", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const Tensor cu = make_i32({0, 3, 11});
  const int64_t tokens = 11, channels = 3, width = 4;
  for (bool silu : {true, false}) {
    Tensor x = random_tensor({tokens, channels}, DType::kF64, 1, 0.1, 2.0), w = random_tensor({channels, width}, DType::kF64, 2);
    Tensor dy = random_tensor({tokens, channels}, DType::kF64, 3), y({tokens, channels}, DType::kF64);
    auto loss = [&] {
      backend->short_conv_forward({y, x, w, cu, silu});
      return dot(dy, y);
    };
    Tensor dx = random_tensor({tokens, channels}, DType::kF64, 4), dw = random_tensor({channels, width}, DType::kF64, 5);
    backend->short_conv_backward({dx, dw, dy, x, w, cu, silu});
    INFO("silu " << silu);
    check(check_gradient(loss, x, dx, "x"));
    check(check_gradient(loss, w, dw, "weight"));
    // A frozen conv passes no dweight and gets the same dx.
    Tensor dx_frozen({tokens, channels}, DType::kF64);
    backend->short_conv_backward({dx_frozen, TensorView{}, dy, x, w, cu, silu});
    check(compare_tensors(dx_frozen, dx, 0, 0, "dx without dweight"));
  }
}

TEST_CASE("short conv rejects a weight of other channels and bad segments", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  Tensor x = random_tensor({4, 3}, DType::kF64, 1), y({4, 3}, DType::kF64);
  Tensor w = random_tensor({2, 4}, DType::kF64, 2);
  const std::string m = error_message([&] { backend->short_conv_forward({y, x, w, make_i32({0, 4}), true}); });
  CHECK(contains(m, "short_conv_forward"));
  CHECK(contains(m, "weight [2, 4]"));
  Tensor w_ok = random_tensor({3, 4}, DType::kF64, 2);
  CHECK(contains(error_message([&] { backend->short_conv_forward({y, x, w_ok, make_i32({0, 3}), true}); }),
                 "cu_seqlens"));
}

// ---------------------------------------------------------------------------------------------
// L2 norm, gate, sigmoid, gated RMSNorm

TEST_CASE("l2norm forward uses eps inside the sqrt; backward matches finite differences", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 4, dim = 5;
  for (double eps : {1e-6, 0.5}) {
    Tensor x = random_tensor({rows, dim}, DType::kF64, 1, 0.05, 1.0);
    Tensor y({rows, dim}, DType::kF64), inv({rows}, DType::kF64), expected({rows, dim}, DType::kF64);
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t c = 0; c < dim; ++c) ss += get_element(x, r * dim + c) * get_element(x, r * dim + c);
      for (int64_t c = 0; c < dim; ++c)
        set_element(expected, r * dim + c, get_element(x, r * dim + c) / std::sqrt(ss + eps));
    }
    backend->l2norm_forward({y, inv, x, eps});
    INFO("eps " << eps);
    check(compare_tensors(y, expected, 1e-14, 1e-14, "y"));
    Tensor dy = random_tensor({rows, dim}, DType::kF64, 2), dx = random_tensor({rows, dim}, DType::kF64, 3);
    auto loss = [&] {
      backend->l2norm_forward({y, inv, x, eps});
      return dot(dy, y);
    };
    loss();
    backend->l2norm_backward({dx, dy, x, inv});
    check(check_gradient(loss, x, dx, "x"));
  }
}

TEST_CASE("kda gate: both forms match the models' formulas; backward matches finite differences",
          "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const int64_t tokens = 3, heads = 2, dim = 4;
  Tensor f = random_tensor({tokens, heads * dim}, DType::kF64, 1, 0.1, 4.0);
  Tensor a_log = random_tensor({heads}, DType::kF64, 2, 0.1, 2.0);
  Tensor dt_bias = random_tensor({heads * dim}, DType::kF64, 3);
  for (double lower_bound : {0.0, -5.0}) {
    Tensor g({tokens, heads, dim}, DType::kF64), expected({tokens, heads, dim}, DType::kF64);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < dim; ++c) {
          const int64_t i = (t * heads + h) * dim + c;
          const double x = get_element(f, i) + get_element(dt_bias, h * dim + c), a = std::exp(get_element(a_log, h));
          set_element(expected, i, lower_bound < 0 ? lower_bound * sigmoid(a * x) : -a * softplus(x));
        }
    backend->kda_gate_forward({g, f, a_log, dt_bias, lower_bound});
    INFO("lower_bound " << lower_bound);
    check(compare_tensors(g, expected, 1e-14, 1e-14, "g"));
    Tensor dg = random_tensor({tokens, heads, dim}, DType::kF64, 4), df = random_tensor(f.shape(), DType::kF64, 5);
    auto loss = [&] {
      backend->kda_gate_forward({g, f, a_log, dt_bias, lower_bound});
      return dot(dg, g);
    };
    backend->kda_gate_backward({df, dg, f, a_log, dt_bias, lower_bound});
    check(check_gradient(loss, f, df, "f"));
  }
  SECTION("softplus of a large input is the input, not inf") {
    Tensor big({1, heads * dim}, DType::kF64), g({1, heads, dim}, DType::kF64);
    for (int64_t i = 0; i < big.numel(); ++i) set_element(big, i, 800.0);
    backend->kda_gate_forward({g, big, a_log, dt_bias, 0.0});
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double x = 800.0 + get_element(dt_bias, i);
      CHECK(get_element(g, i) == Approx(-std::exp(get_element(a_log, i / dim)) * x).epsilon(1e-12));
    }
  }
  SECTION("a positive lower bound and a g of other heads are rejected") {
    Tensor g({tokens, heads, dim}, DType::kF64);
    CHECK(contains(error_message([&] { backend->kda_gate_forward({g, f, a_log, dt_bias, 1.0}); }), "lower_bound"));
    Tensor g3({tokens, 3, dim}, DType::kF64);
    const std::string m = error_message([&] { backend->kda_gate_forward({g3, f, a_log, dt_bias, 0.0}); });
    CHECK(contains(m, "kda_gate_forward"));
    CHECK(contains(m, "a_log"));
  }
}

TEST_CASE("sigmoid forward and backward (in place on dy too)", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  Tensor x = random_tensor({3, 4}, DType::kF64, 1, 0.1, 5.0), y({3, 4}, DType::kF64), expected({3, 4}, DType::kF64);
  for (int64_t i = 0; i < x.numel(); ++i) set_element(expected, i, sigmoid(get_element(x, i)));
  backend->sigmoid_forward(y, x);
  check(compare_tensors(y, expected, 1e-15, 1e-15, "y"));
  Tensor dy = random_tensor({3, 4}, DType::kF64, 2), dx({3, 4}, DType::kF64), scratch({3, 4}, DType::kF64);
  auto loss = [&] {
    backend->sigmoid_forward(scratch, x);
    return dot(dy, scratch);
  };
  backend->sigmoid_backward(dx, dy, y);
  check(check_gradient(loss, x, dx, "x"));
  backend->sigmoid_backward(dy, dy, y);
  check(compare_tensors(dy, dx, 0, 0, "dx aliasing dy"));
}

TEST_CASE("gated rmsnorm forward matches the formula; backward matches finite differences", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const int64_t rows = 4, dim = 6;
  for (double eps : {1e-6, 0.3}) {
    Tensor x = random_tensor({rows, dim}, DType::kF64, 1, 0.1, 2.0), gate = random_tensor({rows, dim}, DType::kF64, 2, 0.1, 3.0);
    Tensor w = random_tensor({dim}, DType::kF64, 3);
    Tensor y({rows, dim}, DType::kF64), rstd({rows}, DType::kF64), expected({rows, dim}, DType::kF64);
    for (int64_t r = 0; r < rows; ++r) {
      double ms = 0;
      for (int64_t c = 0; c < dim; ++c) ms += get_element(x, r * dim + c) * get_element(x, r * dim + c) / dim;
      for (int64_t c = 0; c < dim; ++c) {
        const int64_t i = r * dim + c;
        set_element(expected, i, get_element(x, i) / std::sqrt(ms + eps) * get_element(w, c) * sigmoid(get_element(gate, i)));
      }
    }
    backend->gated_rmsnorm_forward({y, rstd, x, gate, w, eps});
    INFO("eps " << eps);
    check(compare_tensors(y, expected, 1e-14, 1e-14, "y"));
    Tensor dy = random_tensor({rows, dim}, DType::kF64, 4);
    auto loss = [&] {
      backend->gated_rmsnorm_forward({y, rstd, x, gate, w, eps});
      return dot(dy, y);
    };
    loss();
    Tensor dx = random_tensor({rows, dim}, DType::kF64, 5), dgate = random_tensor({rows, dim}, DType::kF64, 6);
    Tensor dw = random_tensor({dim}, DType::kF64, 7);
    backend->gated_rmsnorm_backward({dx, dgate, dw, dy, x, gate, w, rstd});
    check(check_gradient(loss, x, dx, "x"));
    check(check_gradient(loss, gate, dgate, "gate"));
    check(check_gradient(loss, w, dw, "weight"));
    Tensor dx_frozen({rows, dim}, DType::kF64), dgate_frozen({rows, dim}, DType::kF64);
    backend->gated_rmsnorm_backward({dx_frozen, dgate_frozen, TensorView{}, dy, x, gate, w, rstd});
    check(compare_tensors(dx_frozen, dx, 0, 0, "dx without dweight"));
    check(compare_tensors(dgate_frozen, dgate, 0, 0, "dgate without dweight"));
  }
  SECTION("a weight of another width is rejected") {
    Tensor x = random_tensor({rows, dim}, DType::kF64, 1), w = random_tensor({dim + 1}, DType::kF64, 3);
    Tensor y({rows, dim}, DType::kF64), rstd({rows}, DType::kF64);
    const std::string m = error_message([&] { backend->gated_rmsnorm_forward({y, rstd, x, x, w, 1e-6}); });
    CHECK(contains(m, "gated_rmsnorm_forward"));
    CHECK(contains(m, "weight [7]"));
  }
}

TEST_CASE("the small KDA ops in F32 agree with F64", "[cpu_ops][kda]") {
  auto backend = make_cpu_backend();
  const Tensor cu = make_i32({0, 5, 9});
  Tensor x = random_tensor({9, 8}, DType::kF64, 1), w = random_tensor({8, 4}, DType::kF64, 2);
  Tensor gate = random_tensor({9, 8}, DType::kF64, 3), nw = random_tensor({8}, DType::kF64, 4);
  Tensor a_log = random_tensor({2}, DType::kF64, 5), bias = random_tensor({8}, DType::kF64, 6);
  auto run = [&](DType dtype) {
    Tensor xs = copy_as(x, dtype), ws = copy_as(w, dtype), gs = copy_as(gate, dtype), nws = copy_as(nw, dtype);
    Tensor as = copy_as(a_log, dtype), bs = copy_as(bias, dtype);
    Tensor conv({9, 8}, dtype), l2({9, 8}, dtype), inv({9}, dtype), g({9, 2, 4}, dtype), sig({9, 8}, dtype);
    Tensor normed({9, 8}, dtype), rstd({9}, dtype);
    backend->short_conv_forward({conv, xs, ws, cu, true});
    backend->l2norm_forward({l2, inv, conv, 1e-6});
    backend->kda_gate_forward({g, l2, as, bs, -5.0});
    backend->sigmoid_forward(sig, g);
    backend->gated_rmsnorm_forward({normed, rstd, sig, gs, nws, 1e-6});
    return copy_as(normed, DType::kF64);
  };
  check(compare_tensors(run(DType::kF32), run(DType::kF64), 1e-5, 1e-6, "chain of the small ops"));
}

// ---------------------------------------------------------------------------------------------
// The optional states (ops.h KdaArgs): a sequence split in two, the second part starting from the
// first part's final state and handing back the gradient of that state, equals the whole. This
// is what a context-parallel rank does with its neighbours' states.

namespace {

Tensor state_tensor(const KdaInputs& in, uint64_t seed) {
  return random_tensor({in.heads, in.kd, in.vd}, DType::kF64, seed, -1.0, 1.0);
}

// Splits `whole` at `cut` (the segment offsets of each part given) and checks the parts, linked
// by their states, against the whole: forward outputs and every gradient.
void check_split(const KdaForm& form, const KdaInputs& whole, int64_t cut, std::vector<int32_t> first_cu,
                 std::vector<int32_t> second_cu) {
  INFO(form.name << ", cut at " << cut << " of " << whole.tokens);
  Tensor out({whole.tokens, whole.heads, whole.vd}, DType::kF64);
  form.forward(forward_args(whole, out));
  KdaGrads want(whole);
  form.backward(want.args(whole));

  const KdaInputs first = rows_of(whole, 0, cut, first_cu), second = rows_of(whole, cut, whole.tokens, second_cu);
  Tensor first_out({first.tokens, whole.heads, whole.vd}, DType::kF64);
  Tensor second_out({second.tokens, whole.heads, whole.vd}, DType::kF64);
  Tensor handed = state_tensor(whole, 7);  // garbage: the forward must overwrite it
  KdaArgs first_args = forward_args(first, first_out);
  first_args.final_state = handed;
  form.forward(first_args);
  KdaArgs second_args = forward_args(second, second_out);
  second_args.initial_state = handed;
  form.forward(second_args);
  check(compare_tensors(first_out, out.view().slice_rows(0, cut), 1e-12, 1e-12, "out (first part)"));
  check(compare_tensors(second_out, out.view().slice_rows(cut, whole.tokens), 1e-12, 1e-12, "out (second part)"));

  // Backward: the second part gives the handed state's gradient, the first part takes it.
  KdaGrads second_gr(second), first_gr(first);
  Tensor dhanded = state_tensor(whole, 8);
  KdaBackwardArgs second_back = second_gr.args(second);
  second_back.initial_state = handed;
  second_back.dinitial_state = dhanded;
  form.backward(second_back);
  KdaBackwardArgs first_back = first_gr.args(first);
  first_back.dfinal_state = dhanded;
  form.backward(first_back);
  const std::vector<std::pair<const char*, std::pair<const KdaGrads*, int64_t>>> parts = {
      {"first part", {&first_gr, 0}}, {"second part", {&second_gr, cut}}};
  for (const auto& [label, part] : parts) {
    INFO(label);
    const KdaGrads& got = *part.first;
    const int64_t begin = part.second, end = begin + got.dq.size(0);
    check(compare_tensors(got.dq, want.dq.view().slice_rows(begin, end), 1e-12, 1e-12, "dq"));
    check(compare_tensors(got.dk, want.dk.view().slice_rows(begin, end), 1e-12, 1e-12, "dk"));
    check(compare_tensors(got.dv, want.dv.view().slice_rows(begin, end), 1e-12, 1e-12, "dv"));
    check(compare_tensors(got.dg, want.dg.view().slice_rows(begin, end), 1e-12, 1e-12, "dg"));
    check(compare_tensors(got.dbeta, want.dbeta.view().slice_rows(begin, end), 1e-12, 1e-12, "dbeta"));
  }
}

}  // namespace

TEST_CASE("kda states: a sequence cut in two and linked by its state equals the whole", "[cpu_ops][kda]") {
  const KdaInputs one_doc = make_kda_inputs({0, 150}, 2, 4, 3, 80);
  for (const KdaForm& form : {recurrent_form(), chunked_form(cpu::kKdaChunk), chunked_form(5)}) {
    for (int64_t cut : {1, 64, 77, 149}) check_split(form, one_doc, cut, {0, static_cast<int32_t>(cut)},
                                                     {0, static_cast<int32_t>(150 - cut)});
  }
  // Packed documents [0, 40) [40, 100) [100, 130): the state links only the document the cut
  // falls in; the others start from zero on either side.
  const KdaInputs packed = make_kda_inputs({0, 40, 100, 130}, 2, 4, 3, 90);
  for (const KdaForm& form : {recurrent_form(), chunked_form(cpu::kKdaChunk)}) {
    check_split(form, packed, 70, {0, 40, 70}, {0, 30, 60});  // inside the second document
    check_split(form, packed, 20, {0, 20}, {0, 20, 80, 110});  // inside the first
  }
}

TEST_CASE("kda states: gradients of the initial state and through the final state match finite differences",
          "[cpu_ops][kda]") {
  for (const KdaForm& form : {recurrent_form(), chunked_form(4)}) {
    // Two segments: the initial state enters the first, the final state leaves the second.
    KdaInputs in = make_kda_inputs({0, 6, 11}, 2, 3, 2, 100);
    Tensor initial = state_tensor(in, 101), dfinal = state_tensor(in, 102);
    Tensor out({in.tokens, in.heads, in.vd}, DType::kF64), final_state = state_tensor(in, 103);
    auto loss = [&] {  // <dout, out> + <dfinal, final_state>
      KdaArgs args = forward_args(in, out);
      args.initial_state = initial;
      args.final_state = final_state;
      form.forward(args);
      return dot(in.dout, out) + dot(dfinal, final_state);
    };
    KdaGrads gr(in);
    Tensor dinitial = state_tensor(in, 104);
    KdaBackwardArgs back = gr.args(in);
    back.initial_state = initial;
    back.dfinal_state = dfinal;
    back.dinitial_state = dinitial;
    form.backward(back);
    GradCheckOptions options;
    options.max_elements = 48;
    options.atol = 1e-8;
    INFO(form.name);
    check(check_gradient(loss, initial, dinitial, "initial_state", options));
    check(check_gradient(loss, in.q, gr.dq, "q", options));
    check(check_gradient(loss, in.k, gr.dk, "k", options));
    check(check_gradient(loss, in.v, gr.dv, "v", options));
    check(check_gradient(loss, in.g, gr.dg, "g", options));
    check(check_gradient(loss, in.beta, gr.dbeta, "beta", options));
  }
}

TEST_CASE("kda states of the wrong shape are refused naming the op and tensor", "[cpu_ops][kda]") {
  const KdaInputs in = make_kda_inputs({0, 5}, 2, 4, 3, 110);
  auto backend = make_cpu_backend();
  Tensor out({in.tokens, in.heads, in.vd}, DType::kF64), wrong({in.heads, in.vd, in.kd}, DType::kF64);
  KdaArgs args = forward_args(in, out);
  args.initial_state = wrong;
  const std::string message = error_message([&] { backend->kda_forward(args); });
  INFO(message);
  CHECK(contains(message, "kda_forward"));
  CHECK(contains(message, "initial_state"));
}
