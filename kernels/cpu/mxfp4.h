// MXFP4 weights, CPU reference: the format Kimi K3 ships its routed experts in (compressed-tensors
// `mxfp4-pack-quantized`, the OCP Microscaling MXFP4 element and scale types; docs/HF_SEMANTICS.md
// "MXFP4 experts" has the sources). A weight [rows, cols] (HF's [out, in]) is stored as
//   packed [rows, cols / 2] U8: two E2M1 codes per byte along cols, the even column in the LOW
//                              nibble, the odd one in the high nibble;
//   scales [rows, cols / 32] U8: one E8M0 exponent per 32 consecutive columns;
//   w[r, c] = e2m1(code[r, c]) * e8m0(scales[r, c / 32]).
// E2M1 (sign, 2 exponent bits with bias 1, 1 mantissa bit): exponent 0 is subnormal (0, 0.5),
// otherwise 2^(e - 1) (1 + m / 2): the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. E8M0: 2^(bits - 127),
// bits 255 is NaN. Every decoded value is exact in F64; in F32 and BF16 it is exact or overflows
// (6 * 2^127) or, below 2^-126, is a subnormal of F32 (BF16: rounded like any conversion).
// The weights are frozen, so there is no backward: the grouped GEMM's MXFP4 form (ops.h,
// GroupedGemmArgs::b_scale) dequantizes b here and runs the plain grouped GEMM.
#pragma once

#include <cstdint>

#include "kernels/mxfp4_format.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

using kernels::kMxfp4GroupSize;

double e2m1_value(uint8_t code);  // the low 4 bits
double e8m0_value(uint8_t bits);

// out [rows, cols] = the weight held by packed [rows, cols / 2] and scales [rows, cols / 32]
// (cols % 32 == 0). Leading dimensions fold into rows.
template <typename T>
void mxfp4_dequantize(T* out, const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols);

// The whole-weight conversions on host tensors (kernels/mxfp4_format.h declares them, for code
// above the kernels; defined in mxfp4.cpp). Quantizing, per group of 32: the smallest scale 2^e
// with max |v| <= 6 * 2^e (so nothing saturates; e clamped to [-127, 127]), then each v / 2^e
// rounded to the nearest E2M1 magnitude, ties to the one with an even mantissa bit, keeping v's
// sign bit.
using kernels::mxfp4_dequantize;
using kernels::mxfp4_quantize;

// The grouped GEMM with an MXFP4 b (GroupedGemmArgs::b_scale given; shapes checked by the
// backend): b dequantized into T, then grouped_gemm<T>.
template <typename T>
void grouped_gemm_mxfp4(const GroupedGemmArgs& args);

}  // namespace moetrain::kernels::cpu
