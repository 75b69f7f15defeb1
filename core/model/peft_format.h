// The PEFT LoRA adapter format, defined once for its reader (peft_adapter.h: `--init-adapter`)
// and its writer (core/checkpoint/adapter_export.h: `moetrain export`):
//
//   adapter_config.json        peft_type LORA, r, lora_alpha, use_rslora, target_modules,
//                              target_parameters, rank_pattern / alpha_pattern, ...
//   adapter_model.safetensors  `base_model.model.<module>.lora_{A,B}.weight`
//
// Routed experts appear per expert (transformers 4 / vLLM:
// `<...>.mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight`) or as PEFT's 3-D adapters on
// transformers 5's fused expert tensors (target_parameters): one adapter on gate_up_proj and one
// on down_proj, each with A [E R, in] (rows e R .. e R + R-1 are expert e's) and B [out, R E]
// (expert e's rank k in column k E + e). With both targeted, gate_up_proj's keys are
// `experts.base_layer.lora_*` and down_proj's `experts.lora_*`: PEFT nests the wrappers in sorted
// order. moetrain holds expert adapters as stacks A [E, R, in], B [E, out, R]; the functions
// below convert between the two.
//
// The released checkpoint's names (Kimi K3, as NeMo AutoModel saves PEFT adapters): the text
// model under language_model., the MoE's modules under block_sparse_moe, the routed experts'
// projections as w1 / w3 / w2.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/config/config.h"

namespace moetrain {

inline constexpr char kPeftConfigFile[] = "adapter_config.json";
inline constexpr char kPeftWeightsFile[] = "adapter_model.safetensors";
inline constexpr char kPeftPrefix[] = "base_model.model.";

// The PEFT key of a moetrain parameter name (a non-stacked adapter): kPeftPrefix + the name.
std::string peft_key(const std::string& parameter_name);
// The module of a PEFT key: without kPeftPrefix and the `.lora_{A,B}.weight` factor.
std::string peft_module(const std::string& key);
// The keys of PEFT's 3-D adapters on the routed experts `experts_module` (`...mlp.experts`);
// `factor` is "lora_A.weight" or "lora_B.weight". gate_up_proj's adapter is the inner wrapper
// (base_layer) when down_proj is targeted too.
std::string peft_fused_gate_up_key(const std::string& experts_module, bool down_targeted, const std::string& factor);
std::string peft_fused_down_key(const std::string& experts_module, const std::string& factor);

// Our module path (model.layers.L.mlp.experts.E.gate_proj, ...) as the released checkpoint
// names it; text_under_language_model for kimi_k3.
std::string released_module_name(std::string name, bool text_under_language_model);
// An adapter key in our names when it was saved under the released checkpoint's; other keys are
// returned unchanged.
std::string our_adapter_key(std::string key);

// Expert stacks A [E, R, in] / B [E, out, R] as PEFT's 3-D factors A [E R, in] / B [out, R E],
// and back (`experts` = E). F32 or F64; the result has the input's dtype.
Tensor peft_fused_a(const TensorView& stack_a);
Tensor peft_fused_b(const TensorView& stack_b);
Tensor stack_from_peft_a(const TensorView& fused_a, int64_t experts);
Tensor stack_from_peft_b(const TensorView& fused_b, int64_t experts);

// Separate gate and up adapters of the routed experts (stacks of ranks r_g, r_u) as one
// gate_up adapter of rank r_g + r_u: A = [A_gate; A_up] per expert and B [E, 2F, r_g + r_u]
// block diagonal (gate rows in the gate ranks, up rows in the up ranks), each block times its
// factor. This is what PEFT makes of per-expert adapters on its fused gate_up_proj.
struct ExpertStacks {
  Tensor a, b;
};
ExpertStacks gate_up_side_by_side(const TensorView& gate_a, const TensorView& gate_b, const TensorView& up_a,
                                  const TensorView& up_b, double gate_factor, double up_factor);

// adapter_config.json's fields that moetrain reads and writes.
struct PeftAdapterConfig {
  int64_t rank = 0;
  double alpha = 0.0;
  bool rslora = false;
  std::vector<std::string> target_parameters;  // the 3-D expert tensors PEFT targeted, if any
  // rank_pattern / alpha_pattern in the file's order (core/config/lora_patterns.h); PEFT writes
  // {".*\\.gate_up_proj": 2r / 2 alpha} for its fused expert form.
  PatternMap<int64_t> rank_pattern;
  PatternMap<double> alpha_pattern;
  // Written, not read back:
  std::vector<std::string> target_modules;
  std::optional<std::string> base_model;  // base_model_name_or_path, null if none
};

// Reads <dir>/adapter_config.json. Error(kBadCheckpoint) naming the file and key on anything
// malformed, and on a pattern key moetrain does not evaluate as PEFT does.
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

// The text of adapter_config.json for `config` (keys sorted, PEFT's inference defaults for the
// fields moetrain does not use), as PEFT and vLLM load it.
std::string peft_adapter_config_text(const PeftAdapterConfig& config);

}  // namespace moetrain
