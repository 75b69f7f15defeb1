// FP8 block-scaled decoding, encoding and the dequantize-then-GEMM ops (see fp8.h).
#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/reference.h"

namespace moetrain::kernels {
namespace {

// The E4M3 code nearest to x (|x| <= 448 after clamping), ties to the even code.
uint8_t e4m3_code(double x) {
  const bool negative = std::signbit(x);
  const double a = std::min(std::fabs(x), kFp8E4M3Max);
  uint8_t magnitude;
  if (a < 0x1.0p-6) {
    // Subnormals step by 2^-9; 8 steps is the smallest normal, whose code is 8 as well.
    magnitude = static_cast<uint8_t>(std::nearbyint(a * 512.0));
  } else {
    int x_exponent = 0;
    std::frexp(a, &x_exponent);  // a = f 2^x_exponent, f in [0.5, 1)
    int e = x_exponent - 1;
    double q = std::nearbyint(std::ldexp(a, 3 - e));  // in [8, 16]
    if (q == 16.0) {
      ++e;
      q = 8.0;
    }
    magnitude = static_cast<uint8_t>(((e + 7) << 3) | (static_cast<int>(q) - 8));
  }
  return static_cast<uint8_t>(magnitude | (negative ? 0x80 : 0x00));
}

}  // namespace

void fp8_block_quantize(uint8_t* codes, float* scales, const double* values, int64_t rows, int64_t cols) {
  const int64_t block_cols = fp8_blocks(cols);
  for (int64_t br = 0; br < fp8_blocks(rows); ++br) {
    const int64_t r0 = br * kFp8BlockSize, r1 = std::min(rows, r0 + kFp8BlockSize);
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t c0 = bc * kFp8BlockSize, c1 = std::min(cols, c0 + kFp8BlockSize);
      double amax = 0.0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(values[r * cols + c]));
      const float scale = amax > 0.0 ? static_cast<float>(amax / kFp8E4M3Max) : 1.0f;
      scales[br * block_cols + bc] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) codes[r * cols + c] = e4m3_code(values[r * cols + c] / scale);
    }
  }
}

namespace cpu {

template <typename T>
void fp8_dequantize(T* out, const uint8_t* codes, const float* scales, int64_t rows, int64_t cols) {
  const int64_t block_cols = fp8_blocks(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scales + (r / kFp8BlockSize) * block_cols;
    for (int64_t c = 0; c < cols; ++c) {
      const double value =
          static_cast<double>(fp8_e4m3_value(codes[r * cols + c])) * static_cast<double>(scale_row[c / kFp8BlockSize]);
      out[r * cols + c] = static_cast<T>(value);
    }
  }
}

// Backend::gemm_fp8 (ops.h).
template <typename T>
void gemm_fp8(const GemmFp8Args& args) {
  const TensorView& b = args.product.b;
  const int64_t rows = b.size(0), cols = b.size(1);
  std::vector<T> decoded(static_cast<size_t>(rows * cols));
  fp8_dequantize(decoded.data(), static_cast<const uint8_t*>(b.data), args.b_scale.ptr<float>(), rows, cols);
  GemmArgs plain = args.product;
  plain.b.data = decoded.data();
  plain.b.dtype = DTypeOf<T>::value;
  gemm<T>(plain);
}

template <typename T>
void grouped_gemm_fp8(const GroupedGemmArgs& args) {
  const int64_t groups = args.b.size(0), rows = args.b.size(1), cols = args.b.size(2);
  const int64_t scales_per_group = fp8_blocks(rows) * fp8_blocks(cols);
  std::vector<T> b(static_cast<size_t>(groups * rows * cols));
  const auto* codes = static_cast<const uint8_t*>(args.b.data);
  for (int64_t g = 0; g < groups; ++g) {
    fp8_dequantize(b.data() + g * rows * cols, codes + g * rows * cols,
                   args.b_scale.ptr<float>() + g * scales_per_group, rows, cols);
  }
  GroupedGemmArgs plain = args;
  plain.b.data = b.data();
  plain.b.dtype = DTypeOf<T>::value;
  plain.b_scale = TensorView{};
  grouped_gemm<T>(plain);
}

}  // namespace cpu

void fp8_block_dequantize(double* values, const uint8_t* codes, const float* scales, int64_t rows, int64_t cols) {
  cpu::fp8_dequantize(values, codes, scales, rows, cols);
}

namespace cpu {

template void fp8_dequantize<float>(float*, const uint8_t*, const float*, int64_t, int64_t);
template void fp8_dequantize<double>(double*, const uint8_t*, const float*, int64_t, int64_t);
MOETRAIN_CPU_INSTANTIATE(gemm_fp8, const GemmFp8Args&)
MOETRAIN_CPU_INSTANTIATE(grouped_gemm_fp8, const GroupedGemmArgs&)

}  // namespace cpu
}  // namespace moetrain::kernels
