// FP8 block-scaled GEMMs (kernels/cpu/fp8.h, ops.h GemmArgs::b_scale / GroupedGemmArgs::b_scale):
// the shared E4M3 decoding against the importer's own (core/io/fp8_block.h, written apart), the
// block quantizer's round trip and rounding, the dense and grouped GEMMs on an FP8 b against the
// plain ops on the importer's dequantized weight (bit for bit, edge blocks included), the input
// gradient dy W by finite differences in double, and the argument errors.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch.h"
#include "core/io/fp8_block.h"
#include "kernels/cpu/fp8.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

TensorView host_view(void* data, DType dtype, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  return v;
}

// A random FP8 weight [rows, cols] (no NaN codes) with scales around 2^-8.
struct Fp8Weight {
  int64_t rows, cols;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Fp8Weight(int64_t r, int64_t c, uint64_t seed)
      : rows(r), cols(c), codes(r * c), scales(fp8_blocks(r) * fp8_blocks(c)) {
    TestRng rng(seed);
    for (auto& code : codes) {
      do code = static_cast<uint8_t>(rng.below(256));
      while ((code & 0x7F) == 0x7F);
    }
    for (auto& s : scales) s = static_cast<float>(rng.uniform(0.5, 2.0) * 0x1p-8);
  }
  TensorView codes_view(Shape shape) { return host_view(codes.data(), DType::kU8, shape); }
  TensorView scales_view(Shape shape) { return host_view(scales.data(), DType::kF32, shape); }
  // The importer's dequantization (core/io/fp8_block.h) of rows [r0, r1), as `dtype`.
  Tensor dequantized(DType dtype, int64_t r0 = 0, int64_t r1 = -1) const {
    if (r1 < 0) r1 = rows;
    std::vector<double> wide((r1 - r0) * cols);
    fp8_block_dequantize(wide.data(), codes.data() + r0 * cols, scales.data() + (r0 / 128) * fp8_blocks(cols),
                         Fp8Format::kE4M3, r1 - r0, cols, r0);
    Tensor out({r1 - r0, cols}, dtype);
    for (int64_t i = 0; i < out.numel(); ++i) set_element(out, i, wide[i]);
    return out;
  }
};

}  // namespace

TEST_CASE("fp8 gemm: the kernels' E4M3 decoding equals the importer's for every code", "[cpu_ops][fp8]") {
  for (int code = 0; code < 256; ++code) {
    INFO("code 0x" << std::hex << code);
    const float ours = fp8_e4m3_value(static_cast<uint8_t>(code));
    const float importer = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(importer)) {
      CHECK(std::isnan(ours));
    } else {
      CHECK(ours == importer);
      CHECK(std::signbit(ours) == std::signbit(importer));
    }
  }
}

TEST_CASE("fp8 gemm: block quantization round-trips FP8 weights and rounds to nearest", "[cpu_ops][fp8]") {
  // A weight whose blocks each hold +-448 (so the quantizer picks back the same scale) decodes,
  // quantizes and decodes to itself. 130 x 200: partial blocks on both edges.
  Fp8Weight w(130, 200, 3);
  for (int64_t r = 0; r < w.rows; r += 128)
    for (int64_t c = 0; c < w.cols; c += 128) w.codes[r * w.cols + c] = (r + c) % 256 ? 0x7E : 0xFE;  // +-448
  for (size_t i = 0; i < w.scales.size(); ++i) w.scales[i] = std::ldexp(1.0f, -static_cast<int>(i) - 6);
  std::vector<double> values(w.rows * w.cols), again(w.rows * w.cols);
  fp8_block_dequantize(values.data(), w.codes.data(), w.scales.data(), w.rows, w.cols);
  std::vector<uint8_t> codes(w.codes.size());
  std::vector<float> scales(w.scales.size());
  fp8_block_quantize(codes.data(), scales.data(), values.data(), w.rows, w.cols);
  CHECK(scales == w.scales);
  fp8_block_dequantize(again.data(), codes.data(), scales.data(), w.rows, w.cols);
  CHECK(again == values);

  // Arbitrary values: each lands on one of its two E4M3 neighbours (relative step 2^-3 at most,
  // so within 2^-4 of the value relative to the block's scale x 2^-6 floor), the block's max on 448.
  TestRng rng(5);
  std::vector<double> raw(64 * 64);
  for (auto& v : raw) v = rng.uniform(-3.0, 3.0);
  std::vector<uint8_t> c8(raw.size());
  float scale = 0.0f;
  fp8_block_quantize(c8.data(), &scale, raw.data(), 64, 64);
  double amax = 0.0;
  for (double v : raw) amax = std::max(amax, std::fabs(v));
  CHECK(scale == static_cast<float>(amax / 448.0));
  for (size_t i = 0; i < raw.size(); ++i) {
    const double x = raw[i] / scale, q = fp8_e4m3_value(c8[i]);
    INFO("value " << raw[i] << " -> " << q);
    CHECK(std::fabs(q - x) <= std::max(std::fabs(x) * 0x1p-4, 0x1p-10) * (1 + 1e-12));
    CHECK((q == 0.0 || std::signbit(q) == std::signbit(x)));
  }
}

TEST_CASE("fp8 gemm: dense GEMM on an FP8 b equals the GEMM on the dequantized weight", "[cpu_ops][fp8]") {
  auto backend = make_cpu_backend();
  // W [out 200, in 136]: 2 x 2 blocks, both partial at the far edge.
  Fp8Weight w(200, 136, 7);
  for (DType dtype : {DType::kF32, DType::kF64}) {
    for (bool transpose_b : {true, false}) {
      INFO(dtype_name(dtype) << " transpose_b " << transpose_b);
      const int64_t rows = 5, k = transpose_b ? w.cols : w.rows, n = transpose_b ? w.rows : w.cols;
      Tensor a = random_tensor({rows, k}, dtype, 11);
      Tensor c = random_tensor({rows, n}, dtype, 12);
      Tensor expected = copy_as(c, dtype);
      const Tensor decoded = w.dequantized(dtype);
      backend->gemm(GemmArgs{expected, a, decoded, false, transpose_b, 0.5, 2.0});
      backend->gemm_fp8(GemmFp8Args{GemmArgs{c, a, w.codes_view({w.rows, w.cols}), false, transpose_b, 0.5, 2.0},
                                    w.scales_view({fp8_blocks(w.rows), fp8_blocks(w.cols)})});
      const Comparison result = compare_tensors(c.view(), expected.view(), 0.0, 0.0, "c");
      INFO(result.message);
      CHECK(result.ok);
    }
  }
}

TEST_CASE("fp8 gemm: grouped GEMM on FP8 experts equals the grouped GEMM on dequantized ones", "[cpu_ops][fp8]") {
  auto backend = make_cpu_backend();
  const std::vector<int32_t> offsets = {0, 3, 3, 8};  // groups of 3, 0 and 5 rows
  const int64_t groups = 3, rows = 8, out = 144, in = 72;  // partial blocks: 144 = 128 + 16, 72 < 128
  Tensor group_offsets = make_i32(offsets);
  for (bool transpose_b : {true, false}) {
    INFO("transpose_b " << transpose_b);
    const int64_t k = transpose_b ? in : out, n = transpose_b ? out : in;
    std::vector<Fp8Weight> experts;
    for (int64_t g = 0; g < groups; ++g) experts.emplace_back(out, in, 20 + g);
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    Tensor decoded({groups, out, in}, DType::kF64);
    for (int64_t g = 0; g < groups; ++g) {
      codes.insert(codes.end(), experts[g].codes.begin(), experts[g].codes.end());
      scales.insert(scales.end(), experts[g].scales.begin(), experts[g].scales.end());
      const Tensor one = experts[g].dequantized(DType::kF64);
      for (int64_t i = 0; i < one.numel(); ++i) set_element(decoded, g * out * in + i, get_element(one, i));
    }
    Tensor a = random_tensor({rows, k}, DType::kF64, 31);
    Tensor c = random_tensor({rows, n}, DType::kF64, 32);
    Tensor expected = copy_as(c, DType::kF64);
    GroupedGemmArgs args;
    args.c = expected;
    args.a = a;
    args.b = decoded;
    args.group_offsets = group_offsets;
    args.transpose_b = transpose_b;
    args.alpha = 0.5;
    args.beta = 2.0;
    backend->grouped_gemm(args);
    args.c = c;
    args.b = host_view(codes.data(), DType::kU8, {groups, out, in});
    args.b_scale = host_view(scales.data(), DType::kF32, {groups, fp8_blocks(out), fp8_blocks(in)});
    backend->grouped_gemm(args);
    const Comparison result = compare_tensors(c.view(), expected.view(), 0.0, 0.0, "c");
    INFO(result.message);
    CHECK(result.ok);
  }
}

TEST_CASE("fp8 gemm: the input gradient dy W matches finite differences of x W^T", "[cpu_ops][fp8][gradcheck]") {
  auto backend = make_cpu_backend();
  Fp8Weight w(136, 130, 41);  // partial blocks on both edges
  const TensorView codes = w.codes_view({w.rows, w.cols});
  const TensorView scales = w.scales_view({fp8_blocks(w.rows), fp8_blocks(w.cols)});
  const int64_t rows = 3;
  Tensor x = random_tensor({rows, w.cols}, DType::kF64, 42);
  Tensor dy = random_tensor({rows, w.rows}, DType::kF64, 43);
  Tensor y({rows, w.rows}, DType::kF64);
  auto loss = [&] {
    backend->gemm_fp8(GemmFp8Args{GemmArgs{y, x, codes, false, true, 1.0, 0.0}, scales});
    return dot(y, dy);
  };
  Tensor dx({rows, w.cols}, DType::kF64);
  backend->gemm_fp8(GemmFp8Args{GemmArgs{dx, dy, codes, false, false, 1.0, 0.0}, scales});
  const Comparison result = check_gradient(loss, x, dx, "dx");
  INFO(result.message);
  CHECK(result.ok);
}

TEST_CASE("fp8 gemm: argument errors name the operand", "[cpu_ops][fp8]") {
  auto backend = make_cpu_backend();
  Fp8Weight w(16, 200, 51);
  Tensor a = random_tensor({4, 200}, DType::kF64, 52);
  Tensor c({4, 16}, DType::kF64);
  GemmFp8Args args{GemmArgs{c, a, w.codes_view({16, 200}), false, true, 1.0, 0.0}, w.scales_view({1, 2})};
  backend->gemm_fp8(args);  // well formed
  args.b_scale = w.scales_view({2, 1});
  CHECK(contains(error_message([&] { backend->gemm_fp8(args); }), "b_scale"));
  Tensor wide_b = random_tensor({16, 200}, DType::kF64, 53);
  args.product.b = wide_b;
  args.b_scale = w.scales_view({1, 2});
  CHECK(contains(error_message([&] { backend->gemm_fp8(args); }), "gemm_fp8: b"));

  Tensor group_offsets = make_i32({0, 4});
  GroupedGemmArgs grouped;
  grouped.c = c;
  grouped.a = a;
  grouped.b = w.codes_view({1, 16, 200});
  grouped.b_scale = w.scales_view({1, 1, 2});
  grouped.group_offsets = group_offsets;
  backend->grouped_gemm(grouped);  // well formed
  grouped.b_scale = w.scales_view({1, 2, 2});
  CHECK(contains(error_message([&] { backend->grouped_gemm(grouped); }), "b_scale"));
  grouped.b_scale = w.scales_view({1, 1, 2});
  grouped.a2 = a;
  grouped.b2 = wide_b.view().reshaped({1, 16, 200});
  CHECK(contains(error_message([&] { backend->grouped_gemm(grouped); }), "next to an FP8 b"));
}
