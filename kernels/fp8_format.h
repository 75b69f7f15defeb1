// FP8 block-scaled weights as DeepSeek-V3 / V3.1 / V3.2 and Kimi K2 ship them (core/io/fp8_block.h
// reads them from safetensors), in the form the GEMMs take them (ops.h GemmArgs::b_scale,
// GroupedGemmArgs::b_scale): a weight [rows, cols] is
//   codes  [rows, cols] U8, one E4M3 (e4m3fn) code per value;
//   scales [ceil(rows / 128), ceil(cols / 128)] F32, one per 128 x 128 block, edge blocks partial;
//   w[r, c] = e4m3(codes[r, c]) * scales[r / 128, c / 128].
// The decoding is written once for the CPU reference and the CUDA kernels, so both read the same
// values; the encoding (fp8_block_quantize) is for weights that reach an FP8 slot from elsewhere (a
// BF16 checkpoint, a random initialisation).
#pragma once

#include <cstdint>
#include <limits>

#include "core/base/host_device.h"

namespace moetrain::kernels {

constexpr int64_t kFp8BlockSize = 128;  // weight_block_size [128, 128], the only one shipped
constexpr double kFp8E4M3Max = 448.0;   // the largest finite E4M3 magnitude

MOETRAIN_HOST_DEVICE inline int64_t fp8_blocks(int64_t extent) {
  return (extent + kFp8BlockSize - 1) / kFp8BlockSize;
}

// The exact value of an E4M3 code (bias 7, no infinities, S.1111.111 is NaN): every one is a
// float, and its product with an F32 scale is exact in double.
MOETRAIN_HOST_DEVICE inline float fp8_e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
#if defined(__CUDA_ARCH__)
    magnitude = nanf("");
#else
    magnitude = std::numeric_limits<float>::quiet_NaN();
#endif
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);  // subnormal: m / 8 * 2^-6
  } else {
    // (8 + m) * 2^(e - 10), built from the exponent bits so host and device agree exactly.
    const int shift = exponent - 10;
    magnitude = static_cast<float>(8 + mantissa) * (shift >= 0 ? static_cast<float>(1 << shift)
                                                                : 1.0f / static_cast<float>(1 << -shift));
  }
  return (code & 0x80) ? -magnitude : magnitude;
}

// Host-side conversions of whole weights (kernels/cpu/fp8.cpp), for code above the kernels.
//
// Quantizes values [rows, cols] (finite) per 128 x 128 block: the scale amax / 448 (F32; 1 for a
// block of zeros), then each value / scale rounded to the nearest E4M3 value, ties to even.
void fp8_block_quantize(uint8_t* codes, float* scales, const double* values, int64_t rows, int64_t cols);
// values [rows, cols] = the weight held by codes [rows, cols] and scales, exactly (double).
void fp8_block_dequantize(double* values, const uint8_t* codes, const float* scales, int64_t rows, int64_t cols);

}  // namespace moetrain::kernels
