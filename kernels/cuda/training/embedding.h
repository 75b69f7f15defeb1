// Token embedding on the CUDA backend. Ids are validated on the host by the caller (one copy
// of the ids per call, which waits for the stream; cheap next to a training step).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/base/tensor.h"
#include "kernels/cuda/common/scratch.h"

namespace moetrain::kernels::cuda_ops {

// out[t, :] = table[ids[t], :]; out and table each BF16 or F32.
void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids, cudaStream_t stream);

// dtable[ids[t], :] += dout[t, :] in token order, without atomics: the host groups the token
// positions by id (a CSR: distinct ids, then their positions in token order), and one thread per
// (distinct id, column) adds its tokens' rows in that order, exactly as the CPU reference does.
void embedding_backward(const TensorView& dtable, const TensorView& dout, const std::vector<int32_t>& host_ids,
                        DeviceScratch& scratch, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
