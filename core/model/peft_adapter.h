// PEFT LoRA adapters: reading one into the model's adapters (`--init-adapter`, and the golden
// tests). An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, targets)
// and adapter_model.safetensors with keys `base_model.model.<module>.lora_{A,B}.weight`.
//
// Routed experts come in two layouts, both read here:
//   per expert (transformers 4 / vLLM): <...>.mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight
//   fused (transformers 5 + PEFT target_parameters on the 3-D expert tensors): one rank-r
//     adapter on gate_up_proj, whose A [E r, D] is shared by gate and up (rows e r .. e r + r-1
//     are expert e's) and whose B [2F, r E] has expert e's rank k in column k E + e; down_proj
//     likewise. With both targeted, gate_up_proj's keys are `experts.base_layer.lora_*` and
//     down_proj's `experts.lora_*` (PEFT nests the wrappers in sorted order).
// moetrain keeps separate gate and up adapters per expert, so a fused adapter loads with A
// copied into both (the same function of x); training may then untie them.
// Kimi-Linear's KDA modules: keys may use our (the released checkpoint's) module names or
// transformers 5's (forget_gate.f_a_proj for f_a_proj, ...; core/model/hf_names.h).
#pragma once

#include <string>
#include <vector>

#include "core/model/model.h"

namespace moetrain {

struct PeftAdapterConfig {
  int64_t rank = 0;
  double alpha = 0.0;
  bool rslora = false;
  std::vector<std::string> target_parameters;  // the 3-D expert tensors PEFT targeted, if any
  // rank_pattern / alpha_pattern {".*\\.gate_up_proj": 2r / 2 alpha}: the fused gate_up adapter
  // holds the gate and up adapters as one of rank 2r with a block-diagonal B (what moetrain's
  // transformers5 export writes, and what PEFT makes of per-expert adapters). Any other pattern
  // is not supported.
  bool gate_up_rank_doubled = false;
};

// Reads <dir>/adapter_config.json. Error(kBadCheckpoint) naming the file and key on anything
// malformed, and on rank_pattern/alpha_pattern other than the doubled gate_up rank above.
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

// Loads every adapter of the model from <dir>. The model's LoRA rank and scaling must equal the
// adapter's; every model adapter must be present and every adapter key used (a mismatch names
// the key and says which config to change). Gradients are left untouched.
void load_peft_adapter(Model& model, const std::string& dir);

// The PEFT key of a moetrain parameter name (a non-stacked adapter).
std::string peft_key(const std::string& parameter_name);

}  // namespace moetrain
