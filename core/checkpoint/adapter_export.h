// Export of the trained LoRA weights as a PEFT adapter directory that PEFT
// (PeftModel.from_pretrained) and vLLM load, and that load_peft_adapter reads back (the format's
// names, keys and layouts are core/model/peft_format.h's):
//
//   adapter_config.json        peft_type LORA, r, lora_alpha, use_rslora, target_modules,
//                              base_model_name_or_path, task_type CAUSAL_LM
//   adapter_model.safetensors  base_model.model.<module>.lora_{A,B}.weight, F32;
//                              routed experts split into per-expert 2-D keys:
//                              base_model.model.model.layers.L.mlp.experts.<e>.gate_proj.lora_A.weight
//
// target_modules lists the projections' short names (q_proj, o_proj, gate_proj, ...), as PEFT
// configs usually do. Where such a name also matches a module moetrain did not adapt (e.g.
// gate_proj of a dense MLP when only `experts` were targeted), PEFT adds a LoRA there with
// B = 0, which changes no output.
//
// Per-module ranks and alphas (lora.rank_pattern / alpha_pattern) are written as the
// rank_pattern / alpha_pattern that give each module of the written layout its rank and alpha
// under PEFT's rule, against the names PEFT matches (which are not always moetrain's: the dense
// MLPs' target_parameters are `...mlp.gate_proj.weight`, the routed experts' `...experts.gate_up_proj`):
// `.*\.<name>` where every module of that short name agrees, else one key per module; a module
// at r and lora_alpha needs none.
//
// A shared expert A (lora.expert_a: shared) has no PEFT form: PEFT's expert adapters hold one A
// per expert. It is written expanded, the same A for every expert, which PEFT loads and computes
// identically (load_peft_adapter takes it back into the shared form when all experts' A agree).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/base/tensor.h"
#include "core/config/config.h"
#include "core/model/lora_linear.h"

namespace moetrain {

class CheckpointReader;
class LoraRanks;

// How routed experts (and the MLPs) appear in the adapter.
//   kPerExpert      target_modules with short names; routed experts as per-expert 2-D keys
//                   `...mlp.experts.<e>.gate_proj.lora_A.weight` (transformers 4 / vLLM naming);
//                   cannot hold a fused gate_up adapter (Error kBadConfig).
//   kTransformers5  what PEFT builds on transformers 5's fused expert tensors: attention in
//                   target_modules; the dense MLP and shared experts through target_parameters
//                   ("gate_proj.weight", ...; same keys as above); routed experts as PEFT's 3-D
//                   adapters on mlp.experts.gate_up_proj / down_proj: A [E r', in] (expert-major
//                   rows), B [out, r' E] (column k E + e). gate_up_proj's adapter has rank 2r and
//                   alpha 2 alpha (rank_pattern / alpha_pattern, as PEFT writes its fused form):
//                   with lora.expert_gate_up: fused the model's own adapter; with separate gate and
//                   up adapters those side by side with a block-diagonal B, as PEFT itself
//                   converts per-expert adapters (B scaled by 1/sqrt 2 under rsLoRA, where PEFT's
//                   scale for (2r, 2 alpha) is sqrt 2 times alpha / sqrt r). (PEFT on transformers 5 rewrites gate_proj/up_proj/down_proj in
//                   target_modules onto the fused experts and drops the dense MLP's adapters,
//                   which this layout avoids.)
//   kReleased       kPerExpert under the released checkpoint's names, as NeMo AutoModel saves a
//                   Kimi K3 adapter: the MoE's modules under block_sparse_moe, the routed
//                   experts' projections w1 / w3 / w2 (`...block_sparse_moe.experts.<e>.w1.lora_A
//                   .weight`), and for kimi_k3 the text model under language_model.
enum class AdapterLayout { kPerExpert, kTransformers5, kReleased };

struct AdapterExportSettings {
  AdapterLayout layout = AdapterLayout::kTransformers5;
  int64_t rank = 8;
  double alpha = 16.0;
  bool rslora = false;
  PatternMap<int64_t> rank_pattern;  // the model's lora.rank_pattern / alpha_pattern: each
  PatternMap<double> alpha_pattern;  // module's alpha (its rank is its A's shape, checked)
  std::optional<std::string> base_model;  // base_model_name_or_path (model.hf_dir), null if none
  bool text_under_language_model = false;  // kReleased of a kimi_k3 model: keys under language_model.
};

AdapterExportSettings adapter_export_settings(const Config& config);

// "model.layers.1.mlp.experts.gate_proj.lora_A.weight" -> ("model.layers.1.mlp.experts",
// "gate_proj", "lora_A.weight").
struct AdapterName {
  std::string module, projection, factor;
};
AdapterName split_adapter_name(const std::string& name);

// Each module's rank and alpha (and so its scale) as the settings give them, checked against its
// A's rank. Shared by the adapter export and the merged export (merged_export.h).
class ModuleSettings {
 public:
  explicit ModuleSettings(const AdapterExportSettings& settings);
  ~ModuleSettings();
  // `module` (moetrain's name) whose A has `rank` rows per expert; fused: the routed experts'
  // gate_up adapter of `module`'s experts. A rank other than the settings' is Error(kBadConfig).
  LoraSettings of(const std::string& module, int64_t rank, bool fused = false);

 private:
  std::unique_ptr<LoraRanks> ranks_;
  bool rslora_;
};

// The LoRA factors' parameter names in a checkpoint (its "param/" keys without the prefix that
// hold ".lora_"), sorted.
std::vector<std::string> checkpoint_adapter_names(const CheckpointReader& reader);


// Writes the adapter from host tensors named by Parameter name (2-D, the stacked 3-D routed-expert
// adapters, or a shared 2-D A beside their 3-D B). Files are replaced atomically; the directory is
// created. A module whose rank is not what the settings' rank and rank_pattern give it is
// Error(kBadConfig) naming it.
void write_peft_adapter(const std::string& out_dir, const std::vector<std::pair<std::string, TensorView>>& params,
                        const AdapterExportSettings& settings);

// `moetrain export`: the adapter of a committed checkpoint (or a root's newest one), whatever
// the world size that saved it. The LoRA settings come from the checkpoint's resolved config;
// `overrides` ("key.path=value", as --set) may change the keys export_override_keys() lists
// (checkpoint.export_layout), and any other key is Error(kBadConfig) naming it.
void export_checkpoint_adapter(const std::string& checkpoint, const std::string& out_dir,
                               const std::vector<std::string>& overrides = {});
const std::vector<std::string>& export_override_keys();

}  // namespace moetrain
