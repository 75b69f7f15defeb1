// FP8 decoding and block dequantization (core/io/fp8_block.h): every code of e4m3fn and e5m2
// against a table built here from the formats' definitions (sign, biased exponent, mantissa;
// OCP 8-bit floating point spec), the block-scale arithmetic on slices, and quantization_config.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.h"
#include "core/base/error.h"
#include "core/io/fp8_block.h"
#include "expected_error.h"

using namespace moetrain;
using moetrain::testing::expected_error;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The value of `code` in a format with `exponent_bits` / `mantissa_bits`, from the definition:
// (-1)^S * 2^(E - bias) * (1 + M / 2^m) for E > 0, (-1)^S * 2^(1 - bias) * (M / 2^m) for E = 0.
// Special codes are the caller's.
double definition_value(uint8_t code, int exponent_bits, int mantissa_bits) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = code & ((1 << mantissa_bits) - 1);
  const double sign = (code >> 7) ? -1.0 : 1.0;
  const double fraction = m / std::pow(2.0, mantissa_bits);
  return e == 0 ? sign * std::pow(2.0, 1 - bias) * fraction : sign * std::pow(2.0, e - bias) * (1.0 + fraction);
}

enum class Kind { kFinite, kNan, kInf };

struct Expected {
  Kind kind;
  double value;
};

// e4m3fn: no infinities; only S.1111.111 is NaN, so S.1111.110 = 448 is finite.
Expected e4m3_table(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return {Kind::kNan, 0};
  return {Kind::kFinite, definition_value(code, 4, 3)};
}

// e5m2: IEEE-like, exponent all ones is infinity (mantissa 0) or NaN.
Expected e5m2_table(uint8_t code) {
  if ((code & 0x7C) == 0x7C) return {(code & 0x03) == 0 ? Kind::kInf : Kind::kNan, (code >> 7) ? -1.0 : 1.0};
  return {Kind::kFinite, definition_value(code, 5, 2)};
}

void check_code(float got, const Expected& want, int code) {
  INFO("code 0x" << std::hex << code);
  switch (want.kind) {
    case Kind::kNan: CHECK(std::isnan(got)); break;
    case Kind::kInf: CHECK((std::isinf(got) && (got > 0) == (want.value > 0))); break;
    case Kind::kFinite:
      CHECK(static_cast<double>(got) == want.value);
      CHECK(std::signbit(got) == ((code & 0x80) != 0));  // -0 stays -0
      break;
  }
}

}  // namespace

TEST_CASE("every e4m3fn code decodes to its value by definition", "[fp8]") {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    const Expected want = e4m3_table(static_cast<uint8_t>(code));
    nans += want.kind == Kind::kNan;
    check_code(fp8_e4m3_to_float(static_cast<uint8_t>(code)), want, code);
    check_code(fp8_to_float(Fp8Format::kE4M3, static_cast<uint8_t>(code)), want, code);
  }
  CHECK(nans == 2);
  // Anchors from the spec: the largest normal, the smallest normal and subnormal.
  CHECK(fp8_e4m3_to_float(0x7E) == 448.0f);
  CHECK(fp8_e4m3_to_float(0xFE) == -448.0f);
  CHECK(fp8_e4m3_to_float(0x08) == std::ldexp(1.0f, -6));
  CHECK(fp8_e4m3_to_float(0x01) == std::ldexp(1.0f, -9));
  CHECK(fp8_e4m3_to_float(0x38) == 1.0f);
  CHECK(fp8_e4m3_to_float(0x78) == 256.0f);  // S.1111.000 is a number in e4m3fn, not infinity
}

TEST_CASE("every e5m2 code decodes to its value by definition", "[fp8]") {
  int nans = 0, infs = 0;
  for (int code = 0; code < 256; ++code) {
    const Expected want = e5m2_table(static_cast<uint8_t>(code));
    nans += want.kind == Kind::kNan;
    infs += want.kind == Kind::kInf;
    check_code(fp8_e5m2_to_float(static_cast<uint8_t>(code)), want, code);
    check_code(fp8_to_float(Fp8Format::kE5M2, static_cast<uint8_t>(code)), want, code);
  }
  CHECK(nans == 6);
  CHECK(infs == 2);
  CHECK(fp8_e5m2_to_float(0x7B) == 57344.0f);
  CHECK(fp8_e5m2_to_float(0x04) == std::ldexp(1.0f, -14));
  CHECK(fp8_e5m2_to_float(0x01) == std::ldexp(1.0f, -16));
  CHECK(fp8_e5m2_to_float(0x3C) == 1.0f);
  CHECK(fp8_e5m2_to_float(0xFC) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("block dequantization of a slice uses the scales of the blocks its rows fall in", "[fp8]") {
  // A 200 x 130 matrix: scales [2, 2], the second block row (rows 128..199) and block column
  // (column 128, 129) partial.
  const int64_t rows = 200, cols = 130;
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < codes.size(); ++i) {
    codes[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
    if ((codes[i] & 0x7F) == 0x7F) codes[i] = 0;  // no NaN: the comparison below needs numbers
  }
  const std::vector<float> scales = {0.5f, 3.0f, 1.0f / 3.0f, 1e-3f};
  auto expected = [&](int64_t r, int64_t c) {
    const double value = e4m3_table(codes[static_cast<size_t>(r * cols + c)]).value;
    return value * static_cast<double>(scales[static_cast<size_t>((r / 128) * 2 + c / 128)]);
  };
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 200}, {120, 140}, {128, 200}, {5, 6}, {127, 128}}) {
    std::vector<double> out(static_cast<size_t>((end - begin) * cols));
    const float* first_scales = scales.data() + (begin / 128) * 2;
    fp8_block_dequantize(out.data(), codes.data() + begin * cols, first_scales, Fp8Format::kE4M3, end - begin, cols,
                         begin);
    int64_t wrong = 0;
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < cols; ++c) wrong += out[static_cast<size_t>((r - begin) * cols + c)] != expected(r, c);
    INFO("rows [" << begin << ", " << end << ")");
    CHECK(wrong == 0);
  }
}

TEST_CASE("quantization_config: fp8 with [128, 128] blocks is read; other settings name the key", "[fp8]") {
  using Json = nlohmann::json;
  const Json shipped = Json::parse(R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]})");
  Fp8BlockQuantization q = fp8_quantization_from_json(shipped, "config.json");
  CHECK(q.format == Fp8Format::kE4M3);
  CHECK(q.converts("model.layers.0.mlp.gate_proj"));

  Json e5m2 = shipped;
  e5m2["fmt"] = "e5m2";
  CHECK(fp8_quantization_from_json(e5m2, "config.json").format == Fp8Format::kE5M2);
  Json no_fmt = shipped;  // transformers' FineGrainedFP8Config writes no fmt: e4m3
  no_fmt.erase("fmt");
  CHECK(fp8_quantization_from_json(no_fmt, "config.json").format == Fp8Format::kE4M3);
  CHECK(!fp8_quantization_from_json(Json::parse(R"({"quant_method": "compressed-tensors"})"), "c").declared());

  Json skip = shipped;
  skip["modules_to_not_convert"] = {"lm_head", "mlp.gate"};
  q = fp8_quantization_from_json(skip, "config.json");
  CHECK(!q.converts("lm_head"));
  CHECK(!q.converts("model.layers.3.mlp.gate"));
  CHECK(q.converts("model.layers.3.mlp.gate_proj"));
  CHECK(q.converts("model.layers.3.mlp.experts.0.up_proj"));

  auto error_of = [&](const char* key, const Json& value) {
    Json bad = shipped;
    bad[key] = value;
    return expected_error(ExitCode::kBadCheckpoint, [&] { fp8_quantization_from_json(bad, "dir/config.json"); });
  };
  for (const Json& block : {Json::parse("[64, 64]"), Json::parse("[128]"), Json::parse("[128, 128.5]"), Json("128")}) {
    const std::string message = error_of("weight_block_size", block);
    CHECK(contains(message, "dir/config.json"));
    CHECK(contains(message, "quantization_config.weight_block_size is " + block.dump()));
    CHECK(contains(message, "[128, 128]"));
  }
  Json no_block = shipped;
  no_block.erase("weight_block_size");
  CHECK(contains(expected_error(ExitCode::kBadCheckpoint, [&] { fp8_quantization_from_json(no_block, "c"); }),
                 "weight_block_size is missing"));
  const std::string fmt_message = error_of("fmt", "e3m4");
  CHECK(contains(fmt_message, "quantization_config.fmt is \"e3m4\""));
  CHECK(contains(fmt_message, "\"e4m3\" or \"e5m2\""));
  CHECK(contains(error_of("modules_to_not_convert", "lm_head"), "modules_to_not_convert"));
}
