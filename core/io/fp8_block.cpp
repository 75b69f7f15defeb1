#include "core/io/fp8_block.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/io/json_integer.h"

namespace moetrain {

const char* fp8_dtype_name(Fp8Format format) {
  switch (format) {
    case Fp8Format::kE4M3: return "F8_E4M3";
    case Fp8Format::kE5M2: return "F8_E5M2";
    case Fp8Format::kNone: break;
  }
  return "none";
}

const char* fp8_fmt_name(Fp8Format format) {
  switch (format) {
    case Fp8Format::kE4M3: return "e4m3";
    case Fp8Format::kE5M2: return "e5m2";
    case Fp8Format::kNone: break;
  }
  return "none";
}

float fp8_e4m3_to_float(uint8_t code) {
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);      // (1 + m/8) * 2^(e-7)
}

float fp8_e5m2_to_float(uint8_t code) {
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  const int exponent = (code >> 2) & 0x1F;
  const int mantissa = code & 0x3;
  if (exponent == 0x1F) return mantissa == 0 ? sign * std::numeric_limits<float>::infinity()
                                             : std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -16);  // subnormal: m/4 * 2^-14
  return sign * std::ldexp(static_cast<float>(4 + mantissa), exponent - 17);      // (1 + m/4) * 2^(e-15)
}

float fp8_to_float(Fp8Format format, uint8_t code) {
  return format == Fp8Format::kE5M2 ? fp8_e5m2_to_float(code) : fp8_e4m3_to_float(code);
}

bool Fp8BlockQuantization::converts(const std::string& module) const {
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const std::string& pattern : modules_to_not_convert) {
    if (module == pattern || module.rfind(pattern + ".", 0) == 0 || ends_with(module, "." + pattern)) return false;
  }
  return true;
}

Fp8BlockQuantization fp8_quantization_from_json(const nlohmann::json& config, const std::string& source) {
  Fp8BlockQuantization q;
  if (!config.is_object() || config.value("quant_method", nlohmann::json()) != "fp8") return q;
  auto bad = [&](const std::string& key, const std::string& value, const char* supported) {
    return Error(ExitCode::kBadCheckpoint,
                 fmt::format("{}: quantization_config.{} is {}; moetrain reads {} (the FP8 block-scaled layout "
                             "DeepSeek-V3 and Kimi K2 ship)",
                             source, key, value, supported));
  };
  const nlohmann::json fmt_value = config.value("fmt", nlohmann::json("e4m3"));
  if (fmt_value == "e4m3") q.format = Fp8Format::kE4M3;
  else if (fmt_value == "e5m2") q.format = Fp8Format::kE5M2;
  else throw bad("fmt", fmt_value.dump(), "\"e4m3\" or \"e5m2\"");
  const nlohmann::json block = config.value("weight_block_size", nlohmann::json());
  int64_t rows = 0, cols = 0;
  if (!block.is_array() || block.size() != 2 || !json_integer(block[0], &rows) || !json_integer(block[1], &cols) ||
      rows != Fp8BlockQuantization::kBlock || cols != Fp8BlockQuantization::kBlock) {
    throw bad("weight_block_size", block.is_null() ? "missing" : block.dump(), "[128, 128]");
  }
  const nlohmann::json skip = config.value("modules_to_not_convert", nlohmann::json());
  if (!skip.is_null()) {
    if (!skip.is_array()) throw bad("modules_to_not_convert", skip.dump(), "a list of module names");
    for (const nlohmann::json& module : skip) {
      if (!module.is_string()) throw bad("modules_to_not_convert", skip.dump(), "a list of module names");
      q.modules_to_not_convert.push_back(module.get<std::string>());
    }
  }
  return q;
}

std::string fp8_scale_name(const std::string& name) { return name + "_scale_inv"; }

void fp8_block_dequantize(double* dst, const uint8_t* codes, const float* scales, Fp8Format format, int64_t rows,
                          int64_t cols, int64_t first_row) {
  constexpr int64_t kBlock = Fp8BlockQuantization::kBlock;
  const int64_t scale_cols = (cols + kBlock - 1) / kBlock;
  const int64_t first_block = first_row / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scales + ((first_row + r) / kBlock - first_block) * scale_cols;
    for (int64_t c = 0; c < cols; ++c) {
      dst[r * cols + c] = static_cast<double>(fp8_to_float(format, codes[r * cols + c])) *
                          static_cast<double>(scale_row[c / kBlock]);
    }
  }
}

}  // namespace moetrain
