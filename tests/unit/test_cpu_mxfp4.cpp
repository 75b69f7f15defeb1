// MXFP4 (kernels/cpu/mxfp4.h): E2M1 codes and E8M0 scales against the OCP Microscaling formats'
// tables written out here, the nibble order and the rounding rule on a hand-packed example, the
// round trip of representable weights, and the grouped GEMM's MXFP4 form against a product
// computed here from the same table.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

// OCP MX v1.0, table "FP4 E2M1": codes 0b0000 .. 0b1111 (sign, two exponent bits, mantissa).
const double kE2m1[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

TensorView host_view(void* data, DType dtype, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  return v;
}

// The hand-packed example: two groups of 32 (one row of 64 columns).
//   group 0, scale byte 127 (2^0): 6 -6 3 0.5 | 0.25 0.75 1.25 1.75 2.5 3.5 5 (the ties) | -0 -1 1.4 -2.9 0.1 | 0...
//   group 1, scale byte 120 (2^-7): 6 -1 1.5 0.375 (all x 2^-7) | 0...
// Codes: 7 F 5 1 | 0 2 2 4 4 6 6 | 8 A 3 D 0 | 0..., and 7 A 3 1 | 0...; low nibble first.
// A row of the example's shape: group 0 starting with `g0`, group 1 with `g1` times 2^-7, zeros after.
std::vector<double> example_row(const std::array<double, 16>& g0, const std::array<double, 4>& g1) {
  std::vector<double> v(64, 0.0);
  for (int i = 0; i < 16; ++i) v[i] = g0[i];
  for (int i = 0; i < 4; ++i) v[32 + i] = std::ldexp(g1[i], -7);
  return v;
}
std::vector<double> example_values() {
  return example_row({6.0, -6.0, 3.0, 0.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -1.0, 1.4, -2.9, 0.1},
                     {6.0, -1.0, 1.5, 0.375});
}
const uint8_t kExamplePacked[32] = {0xF7, 0x15, 0x20, 0x42, 0x64, 0x86, 0x3A, 0x0D, 0, 0, 0, 0, 0, 0, 0, 0,
                                    0xA7, 0x13, 0,    0,    0,    0,    0,    0,    0, 0, 0, 0, 0, 0, 0, 0};
const uint8_t kExampleScales[2] = {127, 120};
// What the example decodes to: the nearest representable values (ties to the even mantissa).
std::vector<double> example_decoded() {
  return example_row({6.0, -6.0, 3.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, 1.5, -3.0, 0.0},
                     {6.0, -1.0, 1.5, 0.5});
}

}  // namespace

TEST_CASE("mxfp4: each of the 16 E2M1 codes decodes to the OCP table's value", "[cpu_ops]") {
  for (int code = 0; code < 16; ++code) {
    INFO("code " << code);
    const double got = cpu::e2m1_value(static_cast<uint8_t>(code));
    CHECK(got == kE2m1[code]);
    CHECK(std::signbit(got) == (code >= 8));
  }
  // Only the low nibble is a code.
  CHECK(cpu::e2m1_value(0xF3) == 1.5);
}

TEST_CASE("mxfp4: E8M0 scales are 2^(bits - 127), 0xFF is NaN", "[cpu_ops]") {
  CHECK(cpu::e8m0_value(0) == 0x1p-127);
  CHECK(cpu::e8m0_value(1) == 0x1p-126);
  CHECK(cpu::e8m0_value(126) == 0.5);
  CHECK(cpu::e8m0_value(127) == 1.0);
  CHECK(cpu::e8m0_value(128) == 2.0);
  CHECK(cpu::e8m0_value(254) == 0x1p127);
  CHECK(std::isnan(cpu::e8m0_value(255)));
}

TEST_CASE("mxfp4: dequantization of a hand-packed row, nibble order and scale extremes", "[cpu_ops]") {
  std::vector<uint8_t> packed(kExamplePacked, kExamplePacked + 32);
  std::vector<uint8_t> scales(kExampleScales, kExampleScales + 2);
  const std::vector<double> expected = example_decoded();
  std::vector<double> out64(64);
  std::vector<float> out32(64);
  cpu::mxfp4_dequantize(host_view(out64.data(), DType::kF64, {1, 64}), host_view(packed.data(), DType::kU8, {1, 32}),
                        host_view(scales.data(), DType::kU8, {1, 2}));
  cpu::mxfp4_dequantize(host_view(out32.data(), DType::kF32, {1, 64}), host_view(packed.data(), DType::kU8, {1, 32}),
                        host_view(scales.data(), DType::kU8, {1, 2}));
  for (int i = 0; i < 64; ++i) {
    INFO("column " << i);
    CHECK(out64[i] == expected[i]);
    CHECK(std::signbit(out64[i]) == std::signbit(expected[i]));
    CHECK(static_cast<double>(out32[i]) == expected[i]);
  }
  // Byte 0x71: code 1 (0.5) in the even column, code 7 (6) in the odd one. Scales 0 (2^-127),
  // 254 (2^127) and 255 (NaN): F64 holds every product, F32 makes 0.5 * 2^-127 a subnormal and
  // 6 * 2^127 infinity.
  std::vector<uint8_t> bytes(48, 0x71);
  const uint8_t extremes[3] = {0, 254, 255};
  std::vector<double> wide(96);
  std::vector<float> narrow(96);
  cpu::mxfp4_dequantize(wide.data(), bytes.data(), extremes, 3, 32);
  cpu::mxfp4_dequantize(narrow.data(), bytes.data(), extremes, 3, 32);
  CHECK(wide[0] == 0x1p-128);
  CHECK(wide[1] == 6 * 0x1p-127);
  CHECK(static_cast<double>(narrow[0]) == 0x1p-128);
  CHECK(std::fpclassify(narrow[0]) == FP_SUBNORMAL);
  CHECK(wide[32] == 0x1p126);
  CHECK(wide[33] == 6 * 0x1p127);
  CHECK(narrow[32] == 0x1p126f);
  CHECK(std::isinf(narrow[33]));
  CHECK(std::isnan(wide[64]));
  CHECK(std::isnan(narrow[65]));
}

TEST_CASE("mxfp4: quantizing the hand-built row gives the hand-packed bytes", "[cpu_ops]") {
  const std::vector<double> values = example_values();
  std::vector<uint8_t> packed(32, 0xEE), scales(2, 0xEE);
  cpu::mxfp4_quantize(packed.data(), scales.data(), values.data(), 1, 64);
  for (int j = 0; j < 32; ++j) {
    INFO("byte " << j);
    CHECK(static_cast<int>(packed[j]) == static_cast<int>(kExamplePacked[j]));
  }
  CHECK(static_cast<int>(scales[0]) == 127);
  CHECK(static_cast<int>(scales[1]) == 120);
  // The scale is the smallest power of two that keeps max |v| <= 6 * scale: 6.0001 needs 2^1.
  std::vector<double> above(32, 0.0);
  above[5] = 6.0001;
  cpu::mxfp4_quantize(packed.data(), scales.data(), above.data(), 1, 32);
  CHECK(static_cast<int>(scales[0]) == 128);
  CHECK(static_cast<int>(packed[2] >> 4) == 0x5);  // 6.0001 / 2 rounds to 3 (code 5), odd column 5
}

TEST_CASE("mxfp4: representable weights survive quantize -> dequantize exactly", "[cpu_ops]") {
  const int64_t rows = 7, cols = 96;
  TestRng rng(5);
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
  for (auto& b : packed) b = static_cast<uint8_t>(rng.below(256));
  for (auto& s : scales) s = static_cast<uint8_t>(10 + rng.below(231));
  std::vector<double> values(rows * cols), again(rows * cols);
  cpu::mxfp4_dequantize(values.data(), packed.data(), scales.data(), rows, cols);
  std::vector<uint8_t> packed2(packed.size()), scales2(scales.size());
  cpu::mxfp4_quantize(packed2.data(), scales2.data(), values.data(), rows, cols);
  cpu::mxfp4_dequantize(again.data(), packed2.data(), scales2.data(), rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    INFO("element " << i);
    REQUIRE(again[i] == values[i]);
  }
  // Arbitrary values: the error is at most half the grid step, 2^e for a group scaled by 2^e.
  std::vector<double> random(rows * cols);
  for (auto& v : random) v = rng.nonzero(1e-3, 3.0);
  cpu::mxfp4_quantize(packed2.data(), scales2.data(), random.data(), rows, cols);
  cpu::mxfp4_dequantize(again.data(), packed2.data(), scales2.data(), rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double step = cpu::e8m0_value(scales2[i / 32]);
    REQUIRE(std::fabs(again[i] - random[i]) <= step);
  }
}

TEST_CASE("mxfp4: grouped GEMM with an MXFP4 b equals the product with the decoded weight", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  const std::vector<int32_t> offsets = {0, 3, 3, 8};  // groups of 3, 0 and 5 rows
  const int64_t groups = 3, rows = 8;
  for (bool transpose_b : {true, false}) {
    // x W^T with W [n 16, k 64] per group, or dy W with W [k 24, n 32] (packed along n).
    const int64_t k = transpose_b ? 64 : 24, n = transpose_b ? 16 : 32;
    const int64_t outer = transpose_b ? n : k, inner = transpose_b ? k : n;
    TestRng rng(transpose_b ? 11 : 12);
    std::vector<uint8_t> packed(groups * outer * inner / 2), scales(groups * outer * inner / 32);
    for (auto& b : packed) b = static_cast<uint8_t>(rng.below(256));
    for (auto& s : scales) s = static_cast<uint8_t>(120 + rng.below(10));
    Tensor a = random_tensor({rows, k}, DType::kF64, 13);
    Tensor c = random_tensor({rows, n}, DType::kF64, 14);
    Tensor expected({rows, n}, DType::kF64);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r)
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0.0;
          for (int64_t q = 0; q < k; ++q) {
            const int64_t o = transpose_b ? j : q, i = transpose_b ? q : j;  // W[o, i], packed along i
            const int64_t flat = (g * outer + o) * inner + i;
            const uint8_t byte = packed[flat / 2];
            const double w = kE2m1[i % 2 == 0 ? byte & 0xf : byte >> 4] *
                             std::ldexp(1.0, scales[(g * outer + o) * (inner / 32) + i / 32] - 127);
            sum += get_element(a, r * k + q) * w;
          }
          set_element(expected, r * n + j, 0.5 * sum + 2.0 * get_element(c, r * n + j));
        }
    Tensor group_offsets({groups + 1}, DType::kI32);
    std::copy(offsets.begin(), offsets.end(), group_offsets.ptr<int32_t>());
    GroupedGemmArgs args;
    args.c = c;
    args.a = a;
    args.b = host_view(packed.data(), DType::kU8, {groups, outer, inner / 2});
    args.b_scale = host_view(scales.data(), DType::kU8, {groups, outer, inner / 32});
    args.group_offsets = group_offsets;
    args.transpose_b = transpose_b;
    args.alpha = 0.5;
    args.beta = 2.0;
    backend->grouped_gemm(args);
    const Comparison result = compare_tensors(c.view(), expected.view(), 1e-13, 1e-13, "c");
    INFO("transpose_b " << transpose_b << ": " << result.message);
    CHECK(result.ok);
  }
}

TEST_CASE("mxfp4: grouped GEMM argument errors name the operand", "[cpu_ops]") {
  auto backend = make_cpu_backend();
  Tensor a = random_tensor({4, 48}, DType::kF64, 1);
  Tensor c({4, 8}, DType::kF64);
  Tensor group_offsets({2}, DType::kI32);
  group_offsets.ptr<int32_t>()[0] = 0;
  group_offsets.ptr<int32_t>()[1] = 4;
  std::vector<uint8_t> bytes(8 * 24), exponents(8 * 2);
  GroupedGemmArgs args;
  args.c = c;
  args.a = a;
  args.group_offsets = group_offsets;
  args.b = host_view(bytes.data(), DType::kU8, {1, 8, 24});
  args.b_scale = host_view(exponents.data(), DType::kU8, {1, 8, 2});
  // k = 48 is not whole groups of 32.
  CHECK(error_message([&] { backend->grouped_gemm(args); }).find("not a multiple of 32") != std::string::npos);
  args.kind = GroupedGemmKind::kKGrouped;
  CHECK(error_message([&] { backend->grouped_gemm(args); }).find("M-grouped only") != std::string::npos);
}
