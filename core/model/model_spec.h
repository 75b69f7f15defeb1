// The resolved shape of a model: the config's model section merged with a Hugging Face
// config.json (when model.hf_dir is set; keys the YAML sets explicitly win), plus what follows
// from it (per-layer mixer and FFN kinds, head dims). Everything the model builder needs.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace moetrain {

enum class MixerKind { kMla, kKda, kDsa };
enum class FfnKind { kDense, kMoe };

const char* mixer_kind_name(MixerKind kind);

struct ModelSpec {
  ModelConfig config;                // the merged model section
  std::vector<MixerKind> mixers;     // one per layer
  std::vector<FfnKind> ffns;         // one per layer

  int64_t qk_head_dim() const { return config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim; }
  int64_t num_layers() const { return config.num_layers; }
};

// Reads `<hf_dir>/config.json` when config.model.hf_dir is set (model_type deepseek_v3,
// deepseek_v32, kimi_k2, kimi_linear or kimi_k3; anything else is Error(kBadConfig) naming the
// type and the supported ones), overlays the YAML's explicit model keys, and derives the per-layer kinds.
ModelSpec resolve_model_spec(const Config& config);

// The model section a Hugging Face config.json describes (core/model/hf_config.cpp; what each
// key maps to is in docs/HF_SEMANTICS.md). `source_name` names the file in messages.
ModelConfig model_config_from_hf_json(const std::string& json_text, const std::string& source_name);

// Where each model key of model_config_from_hf_json's result comes from, for messages: key path
// ("model.moe.num_experts") -> "`source_name` (\"n_routed_experts\")", the config.json key that
// gave it, or "(default of its model_type)" when the file leaves it out.
std::map<std::string, std::string> hf_config_key_sources(const std::string& json_text, const std::string& source_name);

}  // namespace moetrain
