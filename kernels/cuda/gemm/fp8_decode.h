// FP8 block-scaled weights (kernels/fp8_format.h) decoded to BF16 on the device, for the GEMMs
// that take them (ops.h gemm_fp8, grouped_gemm with an F32 b_scale) where the kernel decoding
// inside its mainloop (grouped_gemm_fp8.h) refuses the shape or device: the whole weight into BF16
// scratch, then the BF16 GEMM on it. The same products, at the cost of one pass over the weight and
// a transient BF16 copy of it (the FP8 weight itself is what stays resident and what the FSDP
// buckets move).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::kernels::cuda_ops {

// out [matrices, rows, cols] BF16 = codes [matrices, rows, cols] U8 (E4M3) x scales
// [matrices, ceil(rows / 128), ceil(cols / 128)] F32, each value the exact product rounded once
// to BF16 (round to nearest even), as the CPU reference rounds it to its compute dtype.
void launch_fp8_decode_bf16(void* out, const void* codes, const float* scales, int64_t matrices, int64_t rows,
                            int64_t cols, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
