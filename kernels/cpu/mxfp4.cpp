// MXFP4 decoding, encoding and the dequantize-then-GEMM grouped GEMM (see mxfp4.h).
#include "kernels/cpu/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/base/bf16.h"
#include "core/base/random.h"
#include "kernels/arg_checks.h"
#include "kernels/cpu/reference.h"

namespace moetrain::kernels::cpu {

double e2m1_value(uint8_t code) {
  const int sign = (code >> 3) & 1, exponent = (code >> 1) & 3, mantissa = code & 1;
  const double magnitude = exponent == 0 ? 0.5 * mantissa : std::ldexp(1.0 + 0.5 * mantissa, exponent - 1);
  return sign ? -magnitude : magnitude;
}

double e8m0_value(uint8_t bits) {
  return bits == 0xff ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, static_cast<int>(bits) - 127);
}

template <typename T>
void mxfp4_dequantize(T* out, const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols) {
  double codes[16];
  for (int c = 0; c < 16; ++c) codes[c] = e2m1_value(static_cast<uint8_t>(c));
  const int64_t half = cols / 2, groups = cols / kMxfp4GroupSize;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* bytes = packed + r * half;
    const uint8_t* row_scales = scales + r * groups;
    T* row = out + r * cols;
    for (int64_t j = 0; j < half; ++j) {
      const double scale = e8m0_value(row_scales[2 * j / kMxfp4GroupSize]);
      row[2 * j] = static_cast<T>(codes[bytes[j] & 0xf] * scale);
      row[2 * j + 1] = static_cast<T>(codes[bytes[j] >> 4] * scale);
    }
  }
}

}  // namespace moetrain::kernels::cpu

namespace moetrain::kernels {

void mxfp4_dequantize(const TensorView& out, const TensorView& packed, const TensorView& scales) {
  const char* op = "mxfp4_dequantize";
  const int64_t cols = last_dim(op, "out", out), rows = rows_of(out);
  expect(cols % kMxfp4GroupSize == 0, op, describe("out", out) + ": the columns are not whole groups of 32");
  expect_dtype_is(op, "packed", packed, DType::kU8);
  expect_dtype_is(op, "scales", scales, DType::kU8);
  expect_numel(op, "packed", packed, rows * cols / 2);
  expect_numel(op, "scales", scales, rows * cols / kMxfp4GroupSize);
  expect_on(op, "out", out, Device::kCPU);
  expect_on(op, "packed", packed, Device::kCPU);
  expect_on(op, "scales", scales, Device::kCPU);
  const auto* bytes = static_cast<const uint8_t*>(packed.data);
  const auto* exponents = static_cast<const uint8_t*>(scales.data);
  switch (out.dtype) {
    case DType::kF64: cpu::mxfp4_dequantize(out.ptr<double>(), bytes, exponents, rows, cols); return;
    case DType::kF32: cpu::mxfp4_dequantize(out.ptr<float>(), bytes, exponents, rows, cols); return;
    case DType::kBF16: {
      // Every value is a float (or overflows it), so float then bf16 rounds once.
      std::vector<float> wide(static_cast<size_t>(rows * cols));
      cpu::mxfp4_dequantize(wide.data(), bytes, exponents, rows, cols);
      for (size_t i = 0; i < wide.size(); ++i) out.ptr_u16()[i] = float_to_bf16(wide[i]);
      return;
    }
    default: fail(op, describe("out", out) + ": expected F64, F32 or BF16");
  }
}

void mxfp4_quantize(uint8_t* packed, uint8_t* scales, const double* values, int64_t rows, int64_t cols) {
  const int64_t groups = cols / kMxfp4GroupSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const double* v = values + r * cols + g * kMxfp4GroupSize;
      double amax = 0.0;
      for (int64_t i = 0; i < kMxfp4GroupSize; ++i) amax = std::max(amax, std::fabs(v[i]));
      const int exponent = mxfp4_exponent(amax);
      scales[r * groups + g] = static_cast<uint8_t>(exponent + 127);
      uint8_t* bytes = packed + (r * cols + g * kMxfp4GroupSize) / 2;
      for (int64_t i = 0; i < kMxfp4GroupSize; i += 2)
        bytes[i / 2] = static_cast<uint8_t>(mxfp4_code(v[i], exponent) | mxfp4_code(v[i + 1], exponent) << 4);
    }
  }
}

}  // namespace moetrain::kernels

namespace moetrain::kernels::cpu {

// Backend::random_mxfp4 (ops.h): the quantized uniform weights, made one row at a time. T is
// unused (codes and scales are bytes); a template only so the backend dispatches uniformly.
template <typename T>
void random_mxfp4(const RandomMxfp4Args& args) {
  const int64_t cols = 2 * args.codes.size(-1), rows = args.codes.numel() / args.codes.size(-1);
  auto* codes = static_cast<uint8_t*>(args.codes.data);
  auto* scales = static_cast<uint8_t*>(args.scales.data);
  std::vector<double> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t first = args.seed + args.first_element + static_cast<uint64_t>(r * cols);
    for (int64_t c = 0; c < cols; ++c) row[c] = uniform_weight(first + static_cast<uint64_t>(c), args.half_width);
    mxfp4_quantize(codes + r * (cols / 2), scales + r * (cols / kMxfp4GroupSize), row.data(), 1, cols);
  }
}

template <typename T>
void grouped_gemm_mxfp4(const GroupedGemmArgs& args) {
  const int64_t groups = args.group_offsets.numel() - 1, k = args.a.size(1), n = args.c.size(1);
  const int64_t rows = args.transpose_b ? groups * n : groups * k, cols = args.transpose_b ? k : n;
  std::vector<T> b(static_cast<size_t>(rows * cols));
  mxfp4_dequantize(b.data(), static_cast<const uint8_t*>(args.b.data), static_cast<const uint8_t*>(args.b_scale.data),
                   rows, cols);
  GroupedGemmArgs plain = args;
  plain.b.data = b.data();
  plain.b.dtype = DTypeOf<T>::value;
  plain.b.shape = args.transpose_b ? Shape{groups, n, k} : Shape{groups, k, n};
  plain.b_scale = TensorView{};
  grouped_gemm<T>(plain);
}

template void mxfp4_dequantize<float>(float*, const uint8_t*, const uint8_t*, int64_t, int64_t);
template void mxfp4_dequantize<double>(double*, const uint8_t*, const uint8_t*, int64_t, int64_t);
MOETRAIN_CPU_INSTANTIATE(random_mxfp4, const RandomMxfp4Args&)
MOETRAIN_CPU_INSTANTIATE(grouped_gemm_mxfp4, const GroupedGemmArgs&)

}  // namespace moetrain::kernels::cpu
