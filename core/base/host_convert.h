// Dtype conversion between host tensors (f64, f32, bf16, f16, and the integer types among
// themselves): model loading and parameter initialisation run it before data goes to a device.
#pragma once

#include "core/base/tensor.h"

namespace moetrain {

// dst and src: host tensors with the same number of elements. Floating <-> floating rounds to
// nearest even; integer <-> integer must fit (checked); floating <-> integer is refused.
void convert_host(const TensorView& dst, const TensorView& src);

}  // namespace moetrain
