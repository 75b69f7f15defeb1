// Random MXFP4 weights made on the device (Backend::random_mxfp4, ops.h).
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void random_mxfp4(const RandomMxfp4Args& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
