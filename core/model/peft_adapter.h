// PEFT LoRA adapters: reading one into the model's adapters (`--init-adapter`, and the golden
// tests). An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, targets,
// rank_pattern / alpha_pattern) and adapter_model.safetensors with keys
// `base_model.model.<module>.lora_{A,B}.weight`.
//
// Routed experts come in two layouts, both read here:
//   per expert (transformers 4 / vLLM): <...>.mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight
//   fused (transformers 5 + PEFT target_parameters on the 3-D expert tensors): one adapter on
//     gate_up_proj of rank R (r, or what rank_pattern {".*\\.gate_up_proj": R} says), whose
//     A [E R, D] feeds both gate and up (rows e R .. e R + R-1 are expert e's) and whose B [2F, R E]
//     has expert e's rank k in column k E + e; down_proj likewise at rank r. With both targeted,
//     gate_up_proj's keys are `experts.base_layer.lora_*` and down_proj's `experts.lora_*` (PEFT
//     nests the wrappers in sorted order).
// The model holds its routed experts' gate and up adapters in one of two forms
// (`lora.expert_gate_up`, SwigluExperts):
//   separate  gate and up adapters of rank r each. Holds per-expert adapters, a fused gate_up
//             adapter of rank r (its A copied into both: the same function of x), and one of
//             rank 2r whose B is block diagonal (what PEFT makes of per-expert adapters and what
//             moetrain's own separate adapters export to). A rank-2r B that mixes gate and up
//             rows is refused: set lora.expert_gate_up: fused.
//   fused     PEFT's one adapter of rank 2r, alpha 2 alpha on gate_up_proj. Holds any rank-2r
//             gate_up adapter and per-expert adapters (as the block-diagonal one). A rank-r gate_up
//             adapter is refused: set lora.expert_gate_up: separate.
// A gate_up adapter whose scale (PEFT: alpha' / R, or alpha' / sqrt(R) with rsLoRA) differs from
// the model adapter's is loaded with B rescaled, so the model computes what PEFT computes.
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
  // The routed experts' gate_up_proj adapter: rank_pattern / alpha_pattern {".*\\.gate_up_proj":
  // R / alpha'} when given (PEFT writes 2r / 2 alpha for its fused form), else rank and alpha. No
  // other pattern is supported (moetrain gives every other adapter the same rank).
  int64_t gate_up_rank = 0;
  double gate_up_alpha = 0.0;
};

// Reads <dir>/adapter_config.json. Error(kBadCheckpoint) naming the file and key on anything
// malformed, and on rank_pattern/alpha_pattern entries other than gate_up_proj's.
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

// Loads every adapter of the model from <dir>. The model's LoRA rank and scaling must equal the
// adapter's; every model adapter must be present and every adapter key used (a mismatch names
// the key and says which config to change). Under expert parallelism each rank reads the rows
// of its own experts. Gradients are left untouched.
void load_peft_adapter(Model& model, const std::string& dir);

// The PEFT key of a moetrain parameter name (a non-stacked adapter).
std::string peft_key(const std::string& parameter_name);

}  // namespace moetrain
