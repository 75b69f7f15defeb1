// What every layer's forward and backward sees: the backend, the compute dtype, and the
// micro-batch's index tensors on the backend's device.
#pragma once

#include "core/base/tensor.h"
#include "kernels/ops.h"

namespace moetrain {

// The batch's integer tensors, on the backend's device (int32).
struct BatchTensors {
  Tensor input_ids;   // [tokens]
  Tensor labels;      // [tokens], -1: not a target
  Tensor positions;   // [tokens], position within the token's segment
  Tensor cu_seqlens;  // [segments + 1]
  int64_t num_tokens = 0;
  int64_t seq_len = 0;  // window length (segments never span windows)
};

struct LayerContext {
  kernels::Backend& backend;
  DType dtype;                  // compute dtype of activations (F32/F64 on CPU, BF16 on CUDA)
  const BatchTensors& batch;

  Tensor alloc(Shape shape) const { return Tensor(shape, dtype, backend.allocator()); }
  Tensor alloc(Shape shape, DType type) const { return Tensor(shape, type, backend.allocator()); }
};

}  // namespace moetrain
