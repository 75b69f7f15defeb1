// FP8 block-scaled weights as DeepSeek-V3 / V3.1 / V3.2 and Kimi K2 ship them (transformers'
// "fp8" quantization, its finegrained_fp8 integration): config.json has
//   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//                           "weight_block_size": [128, 128]}
// and each quantized linear's `X.weight` [out, in] is stored F8_E4M3 (or F8_E5M2) beside
// `X.weight_scale_inv` F32 [ceil(out / 128), ceil(in / 128)]: weight[r, c] = fp8[r, c] *
// scale_inv[r / 128, c / 128], edge blocks partial. Embeddings, norms, the router gate and
// lm_head stay BF16. moetrain dequantizes at import (core/io/hf_index.h), or keeps the codes and
// scales (model.weight_format: fp8; core/model/fp8_storage.h, kernels/fp8_format.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moetrain {

enum class Fp8Format : uint8_t {
  kNone,  // not FP8
  kE4M3,  // e4m3fn: bias 7, no infinities, S.1111.111 is NaN, max 448
  kE5M2,  // IEEE-like: bias 15, S.11111.00 is infinity, S.11111.xx (xx != 0) NaN, max 57344
};

// The safetensors spelling ("F8_E4M3", "F8_E5M2"), and config.json's `fmt` ("e4m3", "e5m2").
const char* fp8_dtype_name(Fp8Format format);
const char* fp8_fmt_name(Fp8Format format);

// The exact value of one code (every FP8 value is a float).
float fp8_e4m3_to_float(uint8_t code);
float fp8_e5m2_to_float(uint8_t code);
float fp8_to_float(Fp8Format format, uint8_t code);

// What config.json's quantization_config says about FP8 weights.
struct Fp8BlockQuantization {
  static constexpr int64_t kBlock = 128;  // the only weight_block_size read: [128, 128]

  Fp8Format format = Fp8Format::kNone;  // kNone: config.json declares no FP8 quantization
  std::vector<std::string> modules_to_not_convert;
  bool declared() const { return format != Fp8Format::kNone; }
  // False for a module modules_to_not_convert names (transformers' matching: the module's
  // name, a dotted prefix of it, or a dotted suffix, e.g. "lm_head" or "mlp.gate").
  bool converts(const std::string& module) const;
};

// Reads `quantization_config` (a JSON object) when its quant_method is "fp8"; any other method
// gives kNone (callers that accept only FP8 say so themselves). fmt other than e4m3 / e5m2 and a
// weight_block_size other than [128, 128] are Error(kBadCheckpoint) naming `source` and the key.
Fp8BlockQuantization fp8_quantization_from_json(const nlohmann::json& quantization_config, const std::string& source);

// The name of the block scales of weight `name`: `X.weight` -> `X.weight_scale_inv`.
std::string fp8_scale_name(const std::string& name);

// dst[r, c] = fp8(codes[r, c]) * scales[(first_row + r) / 128 - first_row / 128, c / 128] for
// rows r of a slice that begins at row first_row of its matrix; scales holds the scale rows of
// the blocks the slice touches, scale_cols = ceil(cols / 128) each. Exact in double.
void fp8_block_dequantize(double* dst, const uint8_t* codes, const float* scales, Fp8Format format, int64_t rows,
                          int64_t cols, int64_t first_row);

}  // namespace moetrain
