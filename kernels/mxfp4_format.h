// MXFP4's encoding (kernels/cpu/mxfp4.h describes the format), written once for the CPU reference
// and for CUDA kernels that make MXFP4 weights on the device, so both produce the same bytes.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/base/host_device.h"
#include "core/base/tensor.h"

namespace moetrain::kernels {

constexpr int64_t kMxfp4GroupSize = 32;  // values per E8M0 scale

// The exponent e of a group's E8M0 scale 2^e: the smallest with max |v| <= 6 * 2^e, so nothing
// saturates; clamped to [-127, 127], and -127 for a group of zeros.
MOETRAIN_HOST_DEVICE inline int mxfp4_exponent(double amax) {
  if (!(amax > 0.0)) return -127;
  int x = 0;
#if defined(__CUDA_ARCH__)
  const double f = frexp(amax / 6.0, &x);  // amax / 6 = f 2^x, f in [0.5, 1)
#else
  const double f = std::frexp(amax / 6.0, &x);
#endif
  const int e = f == 0.5 ? x - 1 : x;
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// The E2M1 code of v under the scale 2^exponent: v / 2^e rounded to the nearest magnitude of
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 (larger saturates to 6), ties to the code with an even mantissa bit,
// and v's sign bit. The thresholds are the midpoints between neighbouring magnitudes.
MOETRAIN_HOST_DEVICE inline uint8_t mxfp4_code(double v, int exponent) {
#if defined(__CUDA_ARCH__)
  const double x = fabs(ldexp(v, -exponent));
  const bool negative = signbit(v);
#else
  const double x = std::fabs(std::ldexp(v, -exponent));
  const bool negative = std::signbit(v);
#endif
  const uint8_t magnitude = x <= 0.25   ? 0
                            : x < 0.75  ? 1
                            : x <= 1.25 ? 2
                            : x < 1.75  ? 3
                            : x <= 2.5  ? 4
                            : x < 3.5   ? 5
                            : x <= 5.0  ? 6
                                        : 7;
  return static_cast<uint8_t>(magnitude | (negative ? 0x8 : 0x0));
}

// Host-side conversions of whole weights (kernels/cpu/mxfp4.cpp), for code above the kernels
// that holds MXFP4 weights on the host: loading a checkpoint without packed experts, writing a
// merged model.
//
// Quantizes values [rows, cols] (cols % 32 == 0; finite) per group of 32: the scale of
// mxfp4_exponent, then each value's mxfp4_code.
void mxfp4_quantize(uint8_t* packed, uint8_t* scales, const double* values, int64_t rows, int64_t cols);
// out (host, F64, F32 or BF16 [..., cols]) = the weight held by packed [rows, cols / 2] and
// scales [rows, cols / 32], both U8 on the host.
void mxfp4_dequantize(const TensorView& out, const TensorView& packed, const TensorView& scales);

}  // namespace moetrain::kernels
