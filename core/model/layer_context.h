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
  DType dtype;                  // activations and frozen weights (F32/F64 on CPU, BF16 on CUDA)
  const BatchTensors& batch;

  // The "accumulation" dtype of kernels/ops.h: LoRA parameters and gradients, statistics,
  // router logits/scores/weights, losses. F64 when computing in F64, else F32.
  DType accum() const { return dtype == DType::kF64 ? DType::kF64 : DType::kF32; }

  Tensor alloc(Shape shape) const { return Tensor(shape, dtype, backend.allocator()); }
  Tensor alloc(Shape shape, DType type) const { return Tensor(shape, type, backend.allocator()); }
  Tensor alloc_accum(Shape shape) const { return alloc(shape, accum()); }
};

}  // namespace moetrain
