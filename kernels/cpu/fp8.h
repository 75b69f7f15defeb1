// FP8 block-scaled weights, CPU reference (the format: kernels/fp8_format.h). The weights are
// frozen, so the GEMMs that take them (ops.h gemm_fp8, grouped_gemm with an F32 b_scale) have
// no weight gradient; their input gradient is the same op with the other transpose. Each
// dequantizes b into T, every value the double product code x scale rounded once to T (as the
// importer rounds a dequantized FP8 weight, core/io/hf_index.h), then runs the plain GEMM: the
// model on FP8 weights computes exactly what it computes on the importer's dequantized ones.
#pragma once

#include <cstdint>

#include "kernels/fp8_format.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// out [rows, cols] = the weight held by codes [rows, cols] and scales [ceil(rows / 128),
// ceil(cols / 128)], each value rounded to T. Leading dimensions do not fold: one matrix.
template <typename T>
void fp8_dequantize(T* out, const uint8_t* codes, const float* scales, int64_t rows, int64_t cols);

// The grouped GEMM with an FP8 b (shapes checked by the backend): b dequantized into T, then the
// plain op. (gemm_fp8, an op of its own, is declared with the others in reference.h.)
template <typename T>
void grouped_gemm_fp8(const GroupedGemmArgs& args);

}  // namespace moetrain::kernels::cpu
