// A trainable tensor (a LoRA factor, or a router weight a config unfreezes) with its gradient
// and its name in the exported adapter / checkpoint. Values, gradients and Adam moments are
// fp32 (f64 in gradient-check tests) on the backend's device. In a model, value and grad are
// views into their ParameterGroup's flat buffers (core/model/parameter_group.h).
#pragma once

#include <string>

#include "core/base/tensor.h"

namespace moetrain {

struct Parameter {
  std::string name;       // PEFT key, e.g. "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
  Tensor value;
  Tensor grad;            // accumulated over micro-batches; zeroed by the optimizer step
  bool weight_decay = true;
};

}  // namespace moetrain
