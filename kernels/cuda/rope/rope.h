// Rotary embedding on the CUDA backend (both layouts, forward and inverse, in place or not).
// x/out BF16 or F32; cos/sin F32; positions int32. A position outside the cos/sin table is a
// bug upstream: the positions stay on the device, so instead of a host check the kernel writes
// NaN into that row's rotated columns (never reading outside the table), which the trainer's
// NaN check then reports.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// The largest rope_dim the kernel's shared-memory staging handles.
constexpr int64_t kMaxRopeDim = 8192;

void rope(const RopeArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
