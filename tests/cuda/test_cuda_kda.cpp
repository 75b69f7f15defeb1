// The CUDA KDA ops against the CPU reference (F64) on the same inputs: the short convolution,
// l2norm, the KDA gate (both forms), sigmoid, the gated RMSNorm, and KDA itself forward and
// backward (every gradient) at head dims 128 and 64 (and padded ones: 96/72, 16, 4/5), lengths
// 1, 63, 64, 65 and 200, and packed segments (an empty one, ones shorter than the conv width and
// than a chunk, ones spanning several chunks), with and without each optional state (initial and
// final state forward, final state's gradient and initial state's gradient backward), and one
// window cut into two calls chained through those states. Inputs BF16 and F32; outputs poisoned
// with NaN first, so an element a kernel forgets to write fails. KDA runs on BF16 tensor cores
// whatever the input dtype, so its outputs are held to a BF16-operand tolerance (relative L2 ~1e-2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

// Rows of the last dim scaled to unit L2 norm (q and k of KDA come out of an l2norm).
Operand unit_rows(Shape shape, DType dtype, uint64_t seed) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, 0.05, 1.0);
  const int64_t dim = shape[shape.ndim() - 1];
  double* p = t.ptr<double>();
  for (int64_t r = 0; r < t.numel() / dim; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < dim; ++j) sum += p[r * dim + j] * p[r * dim + j];
    for (int64_t j = 0; j < dim; ++j) p[r * dim + j] /= std::sqrt(sum);
  }
  return operand_from_host(std::move(t), dtype);
}

// Values in [lo, hi] (both of one sign) in F32, e.g. log decays g < 0 or beta in (0, 1).
Operand uniform_f32(Shape shape, uint64_t seed, double lo, double hi) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, 0.0, 1.0);
  double* p = t.ptr<double>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = lo + (hi - lo) * std::fabs(p[i]);
  return operand_from_host(std::move(t), DType::kF32);
}

// KDA's tensor-core products round operands to BF16. A double-precision model of the kernels'
// roundings puts every output and gradient at 2e-3 .. 5e-3 relative L2 (largest element error
// under 7e-3 of the largest element) at these shapes and decays: limits about 3x that.
constexpr Tolerance kKdaOut{1e-2, 5e-2, 1.5e-2};
constexpr Tolerance kKdaGrad{1.5e-2, 1e-1, 2e-2};

// ---------------------------------------------------------------------------------------------
// KDA

struct KdaCase {
  std::vector<int32_t> cu;
  int64_t heads;
  int64_t k_dim;
  int64_t v_dim;
  double g_lo, g_hi;  // log decay per token, uniform in [g_lo, g_hi] (<= 0)
};

// The optional states a case passes (KdaArgs, KdaBackwardArgs).
struct KdaStates {
  bool initial = false;
  bool final = false;
  bool dfinal = false;
  bool dinitial = false;
  std::string label() const {
    std::string s = "states:";
    if (initial) s += " initial";
    if (final) s += " final";
    if (dfinal) s += " dfinal";
    if (dinitial) s += " dinitial";
    return s;
  }
};
constexpr KdaStates kAllStates{true, true, true, true};

void check_kda_case(const KdaCase& kc, DType dtype, uint64_t seed, const KdaStates& states = {}) {
  const int64_t tokens = kc.cu.back();
  INFO(std::string(dtype_name(dtype)) + " heads " + std::to_string(kc.heads) + " dims " + std::to_string(kc.k_dim) +
       "/" + std::to_string(kc.v_dim) + " g in [" + std::to_string(kc.g_lo) + ", " + std::to_string(kc.g_hi) + "] " +
       cu_seqlens_label(kc.cu) + " " + states.label());
  const Shape qk{tokens, kc.heads, kc.k_dim}, vs{tokens, kc.heads, kc.v_dim}, bs{tokens, kc.heads};
  const Shape ss{kc.heads, kc.k_dim, kc.v_dim};
  const Operand cu = cu_seqlens_operand(kc.cu);
  const Operand q = unit_rows(qk, dtype, seed);
  const Operand k = unit_rows(qk, dtype, seed + 1);
  const Operand v = random_operand(vs, dtype, seed + 2, 0.05, 1.0);
  const Operand g = uniform_f32(qk, seed + 3, kc.g_lo, kc.g_hi);
  const Operand beta = uniform_f32(bs, seed + 4, 0.05, 0.95);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kc.k_dim));
  // States of the magnitude a segment builds up (sums of k v^T with unit k), F32 as CUDA takes them.
  const Operand initial = random_operand(ss, DType::kF32, seed + 6, 0.05, 1.0);
  const Operand dfinal = random_operand(ss, DType::kF32, seed + 7, 0.05, 1.0);
  const auto optional = [](bool given, BackendSide on, const Operand& op) { return given ? on(op) : TensorView{}; };

  Operand out = output_operand(vs, dtype), final_state = output_operand(ss, DType::kF32);
  const auto forward_args = [&](BackendSide on) {
    kernels::KdaArgs args;
    args.scale = scale;
    args.out = on(out);
    args.q = on(q);
    args.k = on(k);
    args.v = on(v);
    args.g = on(g);
    args.beta = on(beta);
    args.cu_seqlens = on(cu);
    args.initial_state = optional(states.initial, on, initial);
    args.final_state = optional(states.final, on, final_state);
    return args;
  };
  gpu().kda_forward(forward_args(kGpu));
  cpu().kda_forward(forward_args(kCpu));
  CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), kKdaOut, "kda out");
  if (states.final) CUDA_TEST_EXPECT_CLOSE(final_state.dev, final_state.host.view(), kKdaOut, "kda final_state");

  const Operand dout = random_operand(vs, dtype, seed + 5, 0.05, 1.0);
  Operand dq = output_operand(qk, dtype), dk = output_operand(qk, dtype), dv = output_operand(vs, dtype);
  Operand dg = output_operand(qk, DType::kF32), dbeta = output_operand(bs, DType::kF32);
  Operand dinitial = output_operand(ss, DType::kF32);
  const auto backward_args = [&](BackendSide on) {
    kernels::KdaBackwardArgs args;
    args.scale = scale;
    args.dq = on(dq);
    args.dk = on(dk);
    args.dv = on(dv);
    args.dg = on(dg);
    args.dbeta = on(dbeta);
    args.dout = on(dout);
    args.q = on(q);
    args.k = on(k);
    args.v = on(v);
    args.g = on(g);
    args.beta = on(beta);
    args.cu_seqlens = on(cu);
    args.initial_state = optional(states.initial, on, initial);
    args.dfinal_state = optional(states.dfinal, on, dfinal);
    args.dinitial_state = optional(states.dinitial, on, dinitial);
    return args;
  };
  gpu().kda_backward(backward_args(kGpu));
  const Tensor dq_first = download(dq.dev), dg_first = download(dg.dev);
  cpu().kda_backward(backward_args(kCpu));
  CUDA_TEST_EXPECT_CLOSE(dq.dev, dq.host.view(), kKdaGrad, "kda dq");
  CUDA_TEST_EXPECT_CLOSE(dk.dev, dk.host.view(), kKdaGrad, "kda dk");
  CUDA_TEST_EXPECT_CLOSE(dv.dev, dv.host.view(), kKdaGrad, "kda dv");
  if (tokens > 1 || states.initial) {
    CUDA_TEST_EXPECT_CLOSE(dg.dev, dg.host.view(), kKdaGrad, "kda dg");
  } else {
    // One token: the state it decays is still zero, so dg is 0 in exact arithmetic (the GPU's
    // q dq - k dk cancels to rounding, which no relative tolerance of a zero reference allows).
    const Tensor got = download(dg.dev);
    double worst = 0;
    for (int64_t i = 0; i < got.numel(); ++i) worst = std::max(worst, std::fabs(testing::get_element(got, i)));
    INFO("kda dg of a single token: largest |dg| " << worst);
    CHECK(worst < 1e-5);
  }
  CUDA_TEST_EXPECT_CLOSE(dbeta.dev, dbeta.host.view(), kKdaGrad, "kda dbeta");
  if (states.dinitial) CUDA_TEST_EXPECT_CLOSE(dinitial.dev, dinitial.host.view(), kKdaGrad, "kda dinitial_state");

  // No atomics: a second run gives the same bits.
  gpu().kda_backward(backward_args(kGpu));
  CHECK(same_bytes(download(dq.dev), dq_first));
  CHECK(same_bytes(download(dg.dev), dg_first));
}

TEST_CASE("cuda kda forward and backward match the CPU: lengths around a chunk, head dims 128 and 64") {
  uint64_t seed = 9000;
  for (int32_t tokens : {1, 63, 64, 65, 200})
    for (int64_t dim : {int64_t{128}, int64_t{64}}) {
      check_kda_case({{0, tokens}, 2, dim, dim, -0.6, -0.01}, DType::kBF16, seed += 10);
    }
}

TEST_CASE("cuda kda matches the CPU on packed segments, mixed head dims and F32 inputs") {
  uint64_t seed = 9500;
  // An empty segment, one of a single token, segments around the chunk size, one over 3 chunks.
  const std::vector<int32_t> packed = {0, 1, 1, 66, 129, 131, 300};
  check_kda_case({packed, 3, 128, 128, -0.6, -0.01}, DType::kBF16, seed += 10);
  check_kda_case({packed, 2, 64, 128, -0.6, -0.01}, DType::kBF16, seed += 10);
  check_kda_case({packed, 2, 128, 64, -0.6, -0.01}, DType::kF32, seed += 10);
  check_kda_case({{0, 70, 200}, 1, 64, 64, -0.6, -0.01}, DType::kF32, seed += 10);
}

TEST_CASE("cuda kda matches the CPU at head dims the kernels pad (tiny models, odd sizes)") {
  uint64_t seed = 9700;
  check_kda_case({{0, 70, 200}, 2, 16, 16, -0.6, -0.01}, DType::kBF16, seed += 10);
  check_kda_case({{0, 3, 130}, 3, 4, 5, -0.6, -0.01}, DType::kF32, seed += 10);
  check_kda_case({{0, 100}, 2, 96, 72, -0.6, -0.01}, DType::kBF16, seed += 10);
}

TEST_CASE("cuda kda stays finite and matches the CPU under strong and weak decay") {
  uint64_t seed = 9800;
  // Strong: cumulative decays of hundreds inside a chunk (exp(-G) alone would overflow).
  check_kda_case({{0, 150}, 2, 128, 128, -8.0, -2.0}, DType::kBF16, seed += 10);
  // Weak: almost no decay, the delta rule alone.
  check_kda_case({{0, 150}, 2, 128, 128, -1e-3, -1e-5}, DType::kBF16, seed += 10);
}

TEST_CASE("cuda kda matches the CPU with and without each optional state") {
  uint64_t seed = 9900;
  // Packed: the first segment of one token, the last over 2 chunks and not a multiple of 64.
  const std::vector<int32_t> packed = {0, 1, 1, 66, 129, 131, 300};
  const KdaStates each[] = {kAllStates,
                            {true, false, false, false},
                            {false, true, false, false},
                            {false, false, true, false},
                            {false, false, false, true},
                            {true, false, false, true},
                            {false, true, true, false}};
  for (const KdaStates& states : each)
    check_kda_case({packed, 3, 128, 128, -0.6, -0.01}, DType::kBF16, seed += 10, states);
  // The first segment empty (the initial state passes to no token), the last empty (the final
  // state is zero), one segment that is first and last, mixed and padded head dims, F32 inputs.
  check_kda_case({{0, 0, 70, 200}, 2, 128, 128, -0.6, -0.01}, DType::kBF16, seed += 10, kAllStates);
  check_kda_case({{0, 70, 200, 200}, 2, 128, 128, -0.6, -0.01}, DType::kBF16, seed += 10, kAllStates);
  check_kda_case({{0, 130}, 2, 64, 128, -0.6, -0.01}, DType::kF32, seed += 10, kAllStates);
  check_kda_case({{0, 3, 130}, 3, 4, 5, -0.6, -0.01}, DType::kF32, seed += 10, kAllStates);
  check_kda_case({{0, 100}, 2, 96, 72, -0.6, -0.01}, DType::kBF16, seed += 10, kAllStates);
  check_kda_case({{0, 1}, 2, 128, 128, -0.6, -0.01}, DType::kBF16, seed += 10, kAllStates);
}

// The rows [begin, end) of a [tokens, ...] device tensor.
TensorView device_rows(const Operand& op, int64_t begin, int64_t end) { return op.dev.view().slice_rows(begin, end); }

// A packed window cut at token `split` inside one of its segments: that segment ends the first
// call and goes on in the second. The second call's offsets count from the cut.
std::vector<int32_t> cu_before(const std::vector<int32_t>& cu, int32_t split) {
  std::vector<int32_t> part;
  for (int32_t b : cu)
    if (b < split) part.push_back(b);
  part.push_back(split);
  return part;
}
std::vector<int32_t> cu_after(const std::vector<int32_t>& cu, int32_t split) {
  std::vector<int32_t> part = {0};
  for (int32_t b : cu)
    if (b > split) part.push_back(b - split);
  return part;
}

// One window in two calls chained through the states (the first call's final_state is the
// second's initial_state; backward, the second's dinitial_state is the first's dfinal_state)
// equals one call over the whole window: against the CPU's whole call, and (a cut on a chunk
// boundary computes the same chunks) to rounding against the GPU's whole call there.
void check_kda_chained(const std::vector<int32_t>& cu, int32_t split, uint64_t seed) {
  const int64_t tokens = cu.back(), heads = 2, dim = 128;
  INFO(cu_seqlens_label(cu) + " cut at " + std::to_string(split));
  const Shape qk{tokens, heads, dim}, bs{tokens, heads}, ss{heads, dim, dim};
  const Operand cu_whole = cu_seqlens_operand(cu), cu_a = cu_seqlens_operand(cu_before(cu, split)),
                cu_b = cu_seqlens_operand(cu_after(cu, split));
  const Operand q = unit_rows(qk, DType::kBF16, seed), k = unit_rows(qk, DType::kBF16, seed + 1);
  const Operand v = random_operand(qk, DType::kBF16, seed + 2, 0.05, 1.0);
  const Operand g = uniform_f32(qk, seed + 3, -0.6, -0.01), beta = uniform_f32(bs, seed + 4, 0.05, 0.95);
  const Operand dout = random_operand(qk, DType::kBF16, seed + 5, 0.05, 1.0);
  const Operand initial = random_operand(ss, DType::kF32, seed + 6, 0.05, 1.0);
  const Operand dfinal = random_operand(ss, DType::kF32, seed + 7, 0.05, 1.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));

  // The whole window, on both backends: outputs, final state; every gradient and dinitial_state.
  Operand out = output_operand(qk, DType::kBF16), final_state = output_operand(ss, DType::kF32);
  Operand dq = output_operand(qk, DType::kBF16), dk = output_operand(qk, DType::kBF16),
          dv = output_operand(qk, DType::kBF16), dg = output_operand(qk, DType::kF32),
          dbeta = output_operand(bs, DType::kF32), dinitial = output_operand(ss, DType::kF32);
  const auto whole = [&](BackendSide on) {
    kernels::Backend& backend = on.device ? gpu() : cpu();
    backend.kda_forward(
        {on(out), on(q), on(k), on(v), on(g), on(beta), on(cu_whole), scale, on(initial), on(final_state)});
    backend.kda_backward({on(dq), on(dk), on(dv), on(dg), on(dbeta), on(dout), on(q), on(k), on(v), on(g), on(beta),
                          on(cu_whole), scale, on(initial), on(dfinal), on(dinitial)});
  };
  whole(kCpu);
  whole(kGpu);
  const std::vector<std::pair<Operand*, const char*>> rows = {
      {&out, "out"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}, {&dg, "dg"}, {&dbeta, "dbeta"}};
  std::vector<Tensor> gpu_whole;
  for (const auto& [op, name] : rows) gpu_whole.push_back(download(op->dev));
  const Tensor gpu_final = download(final_state.dev), gpu_dinitial = download(dinitial.dev);

  // The two calls, into the same outputs (poisoned again), the state between them on the device.
  for (const auto& [op, name] : rows) op->dev = poisoned(op->dev.shape(), op->dev.dtype());
  final_state.dev = poisoned(ss, DType::kF32);
  dinitial.dev = poisoned(ss, DType::kF32);
  const Tensor mid = poisoned(ss, DType::kF32), dmid = poisoned(ss, DType::kF32);
  const auto part = [&](const Operand& op, bool first) {
    return first ? device_rows(op, 0, split) : device_rows(op, split, tokens);
  };
  for (bool first : {true, false}) {
    gpu().kda_forward({part(out, first), part(q, first), part(k, first), part(v, first), part(g, first),
                       part(beta, first), first ? cu_a.dev : cu_b.dev, scale, first ? initial.dev.view() : mid.view(),
                       first ? mid.view() : final_state.dev.view()});
  }
  for (bool first : {false, true}) {
    gpu().kda_backward({part(dq, first), part(dk, first), part(dv, first), part(dg, first), part(dbeta, first),
                        part(dout, first), part(q, first), part(k, first), part(v, first), part(g, first),
                        part(beta, first), first ? cu_a.dev : cu_b.dev, scale, first ? initial.dev.view() : mid.view(),
                        first ? dmid.view() : dfinal.dev.view(), first ? dinitial.dev.view() : dmid.view()});
  }
  const bool on_chunk_boundary = split % 64 == 0;
  constexpr Tolerance kSameChunks{1e-5, 1e-4, 1e-5};
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string name = std::string("chained kda ") + rows[i].second;
    CUDA_TEST_EXPECT_CLOSE(rows[i].first->dev, rows[i].first->host.view(), i == 0 ? kKdaOut : kKdaGrad, name);
    if (on_chunk_boundary)
      CUDA_TEST_EXPECT_CLOSE(rows[i].first->dev, gpu_whole[i].view(), kSameChunks, name + " (GPU)");
  }
  CUDA_TEST_EXPECT_CLOSE(final_state.dev, final_state.host.view(), kKdaOut, "chained kda final_state");
  CUDA_TEST_EXPECT_CLOSE(dinitial.dev, dinitial.host.view(), kKdaGrad, "chained kda dinitial_state");
  if (on_chunk_boundary) {
    CUDA_TEST_EXPECT_CLOSE(final_state.dev, gpu_final.view(), kSameChunks, "chained kda final_state (GPU)");
    CUDA_TEST_EXPECT_CLOSE(dinitial.dev, gpu_dinitial.view(), kSameChunks, "chained kda dinitial_state (GPU)");
  }
}

TEST_CASE("cuda kda over two calls chained through the states equals one call over the window") {
  uint64_t seed = 9950;
  const std::vector<int32_t> packed = {0, 40, 250, 300};
  check_kda_chained(packed, 100, seed += 10);  // inside a chunk of the second segment
  check_kda_chained(packed, 168, seed += 10);  // on a chunk boundary of it (40 + 2 * 64)
  check_kda_chained({0, 300}, 128, seed += 10);  // one document, on a chunk boundary
  check_kda_chained({0, 300}, 1, seed += 10);    // the first call a single token
}

// ---------------------------------------------------------------------------------------------
// Short convolution

// Channels 200 take the 8-channel vector path, 203 the scalar one; widths up to 4 the short window,
// 6 the long one; 300 tokens span several tiles.
TEST_CASE("cuda short_conv forward and backward match the CPU, packed, with and without SiLU") {
  uint64_t seed = 7000;
  const std::vector<std::vector<int32_t>> layouts = {{0, 1}, {0, 2, 2, 5, 140, 300}, {0, 257}};
  for (const auto& cu_values : layouts)
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (bool silu : {true, false})
        for (int64_t width : {int64_t{4}, int64_t{3}, int64_t{6}})
          for (int64_t channels : {int64_t{200}, int64_t{203}}) {
            const int64_t tokens = cu_values.back();
            INFO(std::string(dtype_name(dtype)) + (silu ? " silu" : " linear") + " width " + std::to_string(width) +
                 " channels " + std::to_string(channels) + " " + cu_seqlens_label(cu_values));
            const Operand cu = cu_seqlens_operand(cu_values);
            const Operand x = random_operand({tokens, channels}, dtype, ++seed);
            const Operand weight = random_operand({channels, width}, dtype, ++seed, 0.1, 0.8);
            Operand y = output_operand({tokens, channels}, dtype);
            const auto forward_args = [&](BackendSide on) {
              kernels::ShortConvArgs args;
              args.silu = silu;
              args.y = on(y);
              args.x = on(x);
              args.weight = on(weight);
              args.cu_seqlens = on(cu);
              return args;
            };
            gpu().short_conv_forward(forward_args(kGpu));
            cpu().short_conv_forward(forward_args(kCpu));
            CUDA_TEST_EXPECT_CLOSE(y.dev, y.host.view(), tolerance_for(dtype), "short_conv y");

            for (bool with_dweight : {true, false}) {
              const Operand dy = random_operand({tokens, channels}, dtype, ++seed);
              Operand dx = output_operand({tokens, channels}, dtype);
              Operand dweight = output_operand({channels, width}, DType::kF32);
              const auto backward_args = [&](BackendSide on) {
                kernels::ShortConvBackwardArgs args;
                args.silu = silu;
                args.dx = on(dx);
                args.dweight = with_dweight ? on(dweight) : TensorView{};
                args.dy = on(dy);
                args.x = on(x);
                args.weight = on(weight);
                args.cu_seqlens = on(cu);
                return args;
              };
              gpu().short_conv_backward(backward_args(kGpu));
              cpu().short_conv_backward(backward_args(kCpu));
              CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tolerance_for(dtype), "short_conv dx");
              if (with_dweight)
                CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32),
                                       "short_conv dweight");
            }
          }
}

// ---------------------------------------------------------------------------------------------
// Row norms

TEST_CASE("cuda l2norm forward and backward match the CPU, in place too") {
  uint64_t seed = 7500;
  for (int64_t dim : {int64_t{128}, int64_t{64}, int64_t{37}})
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (bool in_place : {false, true}) {
        INFO(std::string(dtype_name(dtype)) + " dim " + std::to_string(dim) + (in_place ? " in place" : ""));
        const int64_t rows = 45;
        const Operand x = random_operand({rows, dim}, dtype, ++seed);
        Operand y = output_operand({rows, dim}, dtype), inv = output_operand({rows}, DType::kF32);
        const auto forward_args = [&](BackendSide on) {
          kernels::L2NormArgs args;
          args.eps = 1e-6;
          args.y = on(y);
          args.inv_norm = on(inv);
          args.x = on(x);
          return args;
        };
        gpu().l2norm_forward(forward_args(kGpu));
        cpu().l2norm_forward(forward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(y.dev, y.host.view(), tolerance_for(dtype), "l2norm y");
        CUDA_TEST_EXPECT_CLOSE(inv.dev, inv.host.view(), tolerance_for(DType::kF32), "l2norm inv_norm");

        const Operand dy = random_operand({rows, dim}, dtype, ++seed);
        Operand dx = output_operand({rows, dim}, dtype);
        if (in_place) dx.dev = upload(dy.host.view(), dtype);  // on the GPU, dx is dy's memory, holding dy
        const auto backward_args = [&](BackendSide on) {
          kernels::L2NormBackwardArgs args;
          args.dx = on(dx);
          args.dy = on.device && in_place ? on(dx) : on(dy);
          args.x = on(x);
          args.inv_norm = on(inv);  // each side's own (the GPU's in F32)
          return args;
        };
        gpu().l2norm_backward(backward_args(kGpu));
        cpu().l2norm_backward(backward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tolerance_for(dtype), "l2norm dx");
      }
}

TEST_CASE("cuda gated_rmsnorm forward and backward match the CPU") {
  uint64_t seed = 7800;
  for (int64_t dim : {int64_t{128}, int64_t{37}})
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (bool with_dweight : {true, false}) {
        INFO(std::string(dtype_name(dtype)) + " dim " + std::to_string(dim) + (with_dweight ? " dweight" : ""));
        const int64_t rows = 150;  // several dweight chunks would need more; the two stages still run
        const Operand x = random_operand({rows, dim}, dtype, ++seed);
        const Operand gate = random_operand({rows, dim}, dtype, ++seed, 0.1, 3.0);
        const Operand weight = random_operand({dim}, dtype, ++seed, 0.5, 1.5);
        Operand y = output_operand({rows, dim}, dtype), rstd = output_operand({rows}, DType::kF32);
        const auto forward_args = [&](BackendSide on) {
          kernels::GatedRmsNormArgs args;
          args.eps = 1e-5;
          args.y = on(y);
          args.rstd = on(rstd);
          args.x = on(x);
          args.gate = on(gate);
          args.weight = on(weight);
          return args;
        };
        gpu().gated_rmsnorm_forward(forward_args(kGpu));
        cpu().gated_rmsnorm_forward(forward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(y.dev, y.host.view(), tolerance_for(dtype), "gated_rmsnorm y");
        CUDA_TEST_EXPECT_CLOSE(rstd.dev, rstd.host.view(), tolerance_for(DType::kF32), "gated_rmsnorm rstd");

        const Operand dy = random_operand({rows, dim}, dtype, ++seed);
        Operand dx = output_operand({rows, dim}, dtype), dgate = output_operand({rows, dim}, dtype);
        Operand dweight = output_operand({dim}, DType::kF32);
        const auto backward_args = [&](BackendSide on) {
          kernels::GatedRmsNormBackwardArgs args;
          args.dx = on(dx);
          args.dgate = on(dgate);
          args.dweight = with_dweight ? on(dweight) : TensorView{};
          args.dy = on(dy);
          args.x = on(x);
          args.gate = on(gate);
          args.weight = on(weight);
          args.rstd = on(rstd);
          return args;
        };
        gpu().gated_rmsnorm_backward(backward_args(kGpu));
        cpu().gated_rmsnorm_backward(backward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tolerance_for(dtype), "gated_rmsnorm dx");
        CUDA_TEST_EXPECT_CLOSE(dgate.dev, dgate.host.view(), tolerance_for(dtype), "gated_rmsnorm dgate");
        if (with_dweight)
          CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32), "gated_rmsnorm dweight");
      }
}

// ---------------------------------------------------------------------------------------------
// Gates

TEST_CASE("cuda kda_gate forward and backward match the CPU: softplus and lower-bound forms") {
  uint64_t seed = 8000;
  const int64_t tokens = 33, heads = 3, dim = 40;
  for (double lower_bound : {0.0, -5.0})
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      INFO(std::string(dtype_name(dtype)) + " lower_bound " + std::to_string(lower_bound));
      // |f + dt_bias| reaches past softplus's threshold of 20.
      const Operand f = random_operand({tokens, heads * dim}, dtype, ++seed, 0.01, 24.0);
      const Operand a_log = random_operand({heads}, DType::kF32, ++seed, 0.1, 2.0);
      const Operand dt_bias = random_operand({heads * dim}, DType::kF32, ++seed, 0.1, 1.0);
      Operand g = output_operand({tokens, heads, dim}, DType::kF32);
      const auto forward_args = [&](BackendSide on) {
        kernels::KdaGateArgs args;
        args.lower_bound = lower_bound;
        args.g = on(g);
        args.f = on(f);
        args.a_log = on(a_log);
        args.dt_bias = on(dt_bias);
        return args;
      };
      gpu().kda_gate_forward(forward_args(kGpu));
      cpu().kda_gate_forward(forward_args(kCpu));
      CUDA_TEST_EXPECT_CLOSE(g.dev, g.host.view(), tolerance_for(DType::kF32), "kda_gate g");

      const Operand dg = random_operand({tokens, heads, dim}, DType::kF32, ++seed);
      Operand df = output_operand({tokens, heads * dim}, dtype);
      const auto backward_args = [&](BackendSide on) {
        kernels::KdaGateBackwardArgs args;
        args.lower_bound = lower_bound;
        args.df = on(df);
        args.dg = on(dg);
        args.f = on(f);
        args.a_log = on(a_log);
        args.dt_bias = on(dt_bias);
        return args;
      };
      gpu().kda_gate_backward(backward_args(kGpu));
      cpu().kda_gate_backward(backward_args(kCpu));
      CUDA_TEST_EXPECT_CLOSE(df.dev, df.host.view(), tolerance_for(dtype), "kda_gate df");
    }
}

TEST_CASE("cuda sigmoid forward and backward match the CPU, backward in place") {
  uint64_t seed = 8500;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dtype));
    const int64_t n = 1001;
    const Operand x = random_operand({n}, dtype, ++seed, 0.01, 6.0);
    Operand y = output_operand({n}, dtype);
    gpu().sigmoid_forward(y.dev, x.dev);
    cpu().sigmoid_forward(y.host, x.host);
    CUDA_TEST_EXPECT_CLOSE(y.dev, y.host.view(), tolerance_for(dtype), "sigmoid y");
    // The CPU gets the GPU's y, so both differentiate at the same point.
    Operand y_used;
    y_used.host = download(y.dev);
    y_used.dev = upload(y_used.host.view(), dtype);
    const Operand dy = random_operand({n}, dtype, ++seed);
    Operand dx;
    dx.host = Tensor::zeros({n}, DType::kF64);
    dx.dev = upload(dy.host.view(), dtype);  // dx is computed over dy
    gpu().sigmoid_backward(dx.dev, dx.dev, y_used.dev);
    cpu().sigmoid_backward(dx.host, dy.host, y_used.host);
    CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tolerance_for(dtype), "sigmoid dx");
  }
}

}  // namespace
