// PEFT LoRA adapters: reading one into the model's adapters (`--init-adapter`, and the golden
// tests). The format (files, keys, the two routed-expert layouts) is peft_format.h's.
//
// Routed experts come in two layouts, both read here: per expert, and PEFT's fused one with an
// adapter on gate_up_proj of rank R (r, or what rank_pattern gives `<experts>.gate_up_proj`)
// whose A feeds both gate and up, and one on down_proj at rank r.
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
#include "core/model/peft_format.h"

namespace moetrain {

// Loads every adapter of the model from <dir>. The model's r, lora_alpha and rsLoRA must equal the
// adapter's, and each module's rank and alpha as above; every model adapter must be present and
// every adapter key used (a mismatch names the key and says which config to change). Under expert parallelism each rank reads the rows
// of its own experts. Gradients are left untouched.
void load_peft_adapter(Model& model, const std::string& dir);

}  // namespace moetrain
