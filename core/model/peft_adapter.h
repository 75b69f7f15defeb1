// PEFT LoRA adapters: reading one into the model's adapters (`--init-adapter`, and the golden
// tests). An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, targets,
// rank_pattern / alpha_pattern) and adapter_model.safetensors with keys
// `base_model.model.<module>.lora_{A,B}.weight`.
//
// Routed experts come in two layouts, both read here:
//   per expert (transformers 4 / vLLM): <...>.mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight
//   fused (transformers 5 + PEFT target_parameters on the 3-D expert tensors): one adapter on
//     gate_up_proj of rank R (r, or what rank_pattern gives `<experts>.gate_up_proj`), whose
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
// With per-module ranks (lora.rank_pattern) "r" and "2r" above read as the model's gate and up
// ranks and their sum. A gate_up adapter whose scale (PEFT: alpha' / R, or alpha' / sqrt(R) with
// rsLoRA) differs from the model adapter's is loaded with B rescaled, so the model computes what
// PEFT computes.
//
// Every other module is read as it is: its rank and alpha in the file (r, lora_alpha and the
// file's rank_pattern / alpha_pattern, matched as PEFT does against the names PEFT used: the
// module, `<module>.weight` for target_parameters, `<experts>.<e>.<proj>` per expert) must be the
// model's (lora.rank / alpha and their patterns), else Error(kBadConfig) naming both sources; a
// file whose tensors do not have the ranks its own config gives is Error(kBadCheckpoint).
// A model with lora.expert_a: shared reads any layout whose experts all hold the same A (what
// moetrain's export of a shared A writes); experts with different A's are refused (kBadConfig).
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
  // rank_pattern / alpha_pattern in the file's order (core/config/lora_patterns.h); PEFT writes
  // {".*\\.gate_up_proj": 2r / 2 alpha} for its fused expert form.
  PatternMap<int64_t> rank_pattern;
  PatternMap<double> alpha_pattern;
};

// Reads <dir>/adapter_config.json. Error(kBadCheckpoint) naming the file and key on anything
// malformed, and on a pattern key moetrain does not evaluate as PEFT does.
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

// Loads every adapter of the model from <dir>. The model's r, lora_alpha and rsLoRA must equal the
// adapter's, and each module's rank and alpha as above; every model adapter must be present and
// every adapter key used (a mismatch names the key and says which config to change). Under expert parallelism each rank reads the rows
// of its own experts. Gradients are left untouched.
void load_peft_adapter(Model& model, const std::string& dir);

// The PEFT key of a moetrain parameter name (a non-stacked adapter).
std::string peft_key(const std::string& parameter_name);

}  // namespace moetrain
