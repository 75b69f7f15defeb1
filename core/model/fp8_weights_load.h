// Loading and initialising FP8 frozen weights (model.weight_format: fp8; WeightSlot::fp8()): the
// codes and F32 block scales of a slot, from the checkpoint's own E4M3 tensors and their
// weight_scale_inv, or quantized per 128 x 128 block from a BF16 / F32 checkpoint or from the
// values a random initialisation gives the BF16 model. Written to the slot whole, per expert, or
// as this rank's FSDP parts of both tensors.
#pragma once

#include <functional>
#include <string>

#include "core/io/hf_index.h"
#include "core/model/fsdp_bucket.h"
#include "core/model/hf_names.h"
#include "core/model/layer.h"

namespace moetrain {

// Where a slot's data goes: the FSDP parts of its codes and scales (both null when not sharded).
struct Fp8Destination {
  const FsdpBucket::OwnedPart* codes = nullptr;
  const FsdpBucket::OwnedPart* scales = nullptr;
};

// A non-routed FP8 slot from the checkpoint tensors of `layout` (stacked along rows, each piece a
// whole tensor whose rows start a 128-row block of the slot).
void load_fp8_slot(const HfCheckpoint& checkpoint, const WeightSlot& slot, const HfLayout& layout,
                   const Fp8Destination& dst, kernels::Backend& backend);

// Routed FP8 experts, one expert at a time.
void load_fp8_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot, kernels::Backend& backend);

// The quantization of the values `fill(values, first_element, count)` writes for the slot's
// elements, one matrix (one expert for routed experts) at a time: a random initialisation, or a
// checkpoint's plain fused experts (transformers 5's gate_up_proj / down_proj).
using Fp8Values = std::function<void(double* values, int64_t first_element, int64_t count)>;
void quantize_fp8_slot(const WeightSlot& slot, bool routed, const Fp8Values& fill, const Fp8Destination& dst,
                       kernels::Backend& backend);

}  // namespace moetrain
