#include "core/model/model_spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/base/error.h"

namespace moetrain {

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::kMla: return "mla";
    case MixerKind::kKda: return "kda";
    case MixerKind::kDsa: return "dsa";
  }
  return "?";
}

namespace {

using Json = nlohmann::json;

// Copies one model field, named by its YAML path below `model.`, from `src` to `dst`.
using FieldCopier = std::function<void(ModelConfig& dst, const ModelConfig& src)>;

const std::map<std::string, FieldCopier>& model_field_copiers() {
#define MOETRAIN_FIELD(path, member) {path, [](ModelConfig& d, const ModelConfig& s) { d.member = s.member; }}
  static const std::map<std::string, FieldCopier> copiers = {
      MOETRAIN_FIELD("model_type", model_type),
      MOETRAIN_FIELD("vocab_size", vocab_size),
      MOETRAIN_FIELD("hidden_size", hidden_size),
      MOETRAIN_FIELD("num_layers", num_layers),
      MOETRAIN_FIELD("layers", layers),
      MOETRAIN_FIELD("intermediate_size", intermediate_size),
      MOETRAIN_FIELD("first_k_dense", first_k_dense),
      MOETRAIN_FIELD("rms_norm_eps", rms_norm_eps),
      MOETRAIN_FIELD("tie_word_embeddings", tie_word_embeddings),
      MOETRAIN_FIELD("max_position_embeddings", max_position_embeddings),
      MOETRAIN_FIELD("attention_gate", attention_gate),
      MOETRAIN_FIELD("mla", mla),
      MOETRAIN_FIELD("mla.num_heads", mla.num_heads),
      MOETRAIN_FIELD("mla.q_lora_rank", mla.q_lora_rank),
      MOETRAIN_FIELD("mla.kv_lora_rank", mla.kv_lora_rank),
      MOETRAIN_FIELD("mla.qk_nope_head_dim", mla.qk_nope_head_dim),
      MOETRAIN_FIELD("mla.qk_rope_head_dim", mla.qk_rope_head_dim),
      MOETRAIN_FIELD("mla.v_head_dim", mla.v_head_dim),
      MOETRAIN_FIELD("mla.use_rope", mla.use_rope),
      MOETRAIN_FIELD("mla.rope_theta", mla.rope_theta),
      MOETRAIN_FIELD("mla.rope_scaling", mla.rope_scaling),
      MOETRAIN_FIELD("mla.rope_scaling.type", mla.rope_scaling.type),
      MOETRAIN_FIELD("mla.rope_scaling.factor", mla.rope_scaling.factor),
      MOETRAIN_FIELD("mla.rope_scaling.original_max_position_embeddings",
                     mla.rope_scaling.original_max_position_embeddings),
      MOETRAIN_FIELD("mla.rope_scaling.beta_fast", mla.rope_scaling.beta_fast),
      MOETRAIN_FIELD("mla.rope_scaling.beta_slow", mla.rope_scaling.beta_slow),
      MOETRAIN_FIELD("mla.rope_scaling.mscale", mla.rope_scaling.mscale),
      MOETRAIN_FIELD("mla.rope_scaling.mscale_all_dim", mla.rope_scaling.mscale_all_dim),
      MOETRAIN_FIELD("moe", moe),
      MOETRAIN_FIELD("moe.num_experts", moe.num_experts),
      MOETRAIN_FIELD("moe.top_k", moe.top_k),
      MOETRAIN_FIELD("moe.num_shared_experts", moe.num_shared_experts),
      MOETRAIN_FIELD("moe.expert_intermediate_size", moe.expert_intermediate_size),
      MOETRAIN_FIELD("moe.scoring", moe.scoring),
      MOETRAIN_FIELD("moe.num_groups", moe.num_groups),
      MOETRAIN_FIELD("moe.topk_groups", moe.topk_groups),
      MOETRAIN_FIELD("moe.normalize_topk", moe.normalize_topk),
      MOETRAIN_FIELD("moe.routed_scaling_factor", moe.routed_scaling_factor),
      MOETRAIN_FIELD("moe.score_correction_bias", moe.score_correction_bias),
      MOETRAIN_FIELD("moe.aux_loss_coef", moe.aux_loss_coef),
      MOETRAIN_FIELD("moe.aux_loss_type", moe.aux_loss_type),
      MOETRAIN_FIELD("moe.router_noise", moe.router_noise),
      MOETRAIN_FIELD("moe.bias_update_rate", moe.bias_update_rate),
  };
#undef MOETRAIN_FIELD
  return copiers;
}

std::string read_text_file(const std::string& path, ExitCode code) {
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), code, "cannot read " + path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Typed access to config.json with messages that name the file and key.
class HfJson {
 public:
  HfJson(const Json& json, const std::string& source) : json_(json), source_(source) {}

  bool has(const char* key) const { return json_.contains(key) && !json_.at(key).is_null(); }

  template <typename T>
  T get(const char* key) const {
    MOETRAIN_CHECK(has(key), ExitCode::kBadConfig,
                   fmt::format("{}: missing key \"{}\", which a deepseek_v3 config.json must have", source_, key));
    return get_or<T>(key, T{});
  }

  template <typename T>
  T get_or(const char* key, T fallback) const {
    if (!has(key)) return fallback;
    try {
      return json_.at(key).get<T>();
    } catch (const Json::exception& e) {
      throw Error(ExitCode::kBadConfig, fmt::format("{}: key \"{}\" has the wrong type ({})", source_, key, e.what()));
    }
  }

  const Json& raw() const { return json_; }

 private:
  const Json& json_;
  const std::string& source_;
};

RopeScalingConfig rope_scaling_from_hf(const Json& scaling, int64_t max_position_embeddings,
                                        const std::string& source) {
  RopeScalingConfig rope;
  if (scaling.is_null()) return rope;
  HfJson s(scaling, source);
  std::string type = s.get_or<std::string>("rope_type", s.get_or<std::string>("type", "default"));
  if (type == "default" || type == "none") return rope;
  MOETRAIN_CHECK(type == "yarn", ExitCode::kBadConfig,
                 fmt::format("{}: rope scaling type \"{}\" is not supported (supported: yarn, default)", source, type));
  rope.type = "yarn";
  rope.original_max_position_embeddings =
      s.get_or<int64_t>("original_max_position_embeddings", max_position_embeddings);
  // Without an explicit factor, YaRN stretches the original context to the configured one.
  rope.factor = s.get_or<double>("factor", static_cast<double>(max_position_embeddings) /
                                               static_cast<double>(rope.original_max_position_embeddings));
  rope.beta_fast = s.get_or<double>("beta_fast", 32.0);
  rope.beta_slow = s.get_or<double>("beta_slow", 1.0);
  rope.mscale = s.get_or<double>("mscale", 1.0);
  rope.mscale_all_dim = s.get_or<double>("mscale_all_dim", 0.0);
  return rope;
}

}  // namespace

ModelConfig model_config_from_hf_json(const std::string& json_text, const std::string& source_name) {
  Json json;
  try {
    json = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadConfig, fmt::format("{}: not valid JSON ({})", source_name, e.what()));
  }
  MOETRAIN_CHECK(json.is_object(), ExitCode::kBadConfig, source_name + ": config.json must be a JSON object");
  HfJson hf(json, source_name);
  ModelConfig m;
  m.model_type = hf.get<std::string>("model_type");
  MOETRAIN_CHECK(m.model_type == "deepseek_v3", ExitCode::kBadConfig,
                 fmt::format("{}: model_type \"{}\" is not supported yet (supported: deepseek_v3)", source_name,
                             m.model_type));
  m.vocab_size = hf.get<int64_t>("vocab_size");
  m.hidden_size = hf.get<int64_t>("hidden_size");
  m.num_layers = hf.get<int64_t>("num_hidden_layers");
  m.intermediate_size = hf.get<int64_t>("intermediate_size");
  m.first_k_dense = hf.get_or<int64_t>("first_k_dense_replace", 0);
  m.rms_norm_eps = hf.get_or<double>("rms_norm_eps", 1e-6);
  m.tie_word_embeddings = hf.get_or<bool>("tie_word_embeddings", false);
  m.max_position_embeddings = hf.get_or<int64_t>("max_position_embeddings", 4096);
  m.layers.assign(static_cast<size_t>(m.num_layers), "mla");

  MlaConfig& mla = m.mla;
  mla.num_heads = hf.get<int64_t>("num_attention_heads");
  if (hf.has("q_lora_rank")) mla.q_lora_rank = hf.get<int64_t>("q_lora_rank");
  else mla.q_lora_rank.reset();
  mla.kv_lora_rank = hf.get<int64_t>("kv_lora_rank");
  mla.qk_nope_head_dim = hf.get<int64_t>("qk_nope_head_dim");
  mla.qk_rope_head_dim = hf.get<int64_t>("qk_rope_head_dim");
  mla.v_head_dim = hf.get<int64_t>("v_head_dim");
  mla.use_rope = mla.qk_rope_head_dim > 0;  // DeepSeek rotates; Kimi's mla_use_nope would not
  // transformers 5 keeps rope settings in `rope_parameters`; older files use rope_theta +
  // rope_scaling at the top level.
  if (json.contains("rope_parameters") && json["rope_parameters"].is_object()) {
    const Json& rp = json["rope_parameters"];
    mla.rope_theta = HfJson(rp, source_name).get_or<double>("rope_theta", 10000.0);
    mla.rope_scaling = rope_scaling_from_hf(rp, m.max_position_embeddings, source_name);
  } else {
    mla.rope_theta = hf.get_or<double>("rope_theta", 10000.0);
    mla.rope_scaling = rope_scaling_from_hf(json.value("rope_scaling", Json()), m.max_position_embeddings, source_name);
  }

  MoeConfig& moe = m.moe;
  moe.num_experts = hf.get<int64_t>("n_routed_experts");
  moe.top_k = hf.get<int64_t>("num_experts_per_tok");
  moe.num_shared_experts = hf.get_or<int64_t>("n_shared_experts", 0);
  moe.expert_intermediate_size = hf.get<int64_t>("moe_intermediate_size");
  moe.scoring = hf.get_or<std::string>("scoring_func", "sigmoid");
  moe.num_groups = hf.get_or<int64_t>("n_group", 1);
  moe.topk_groups = hf.get_or<int64_t>("topk_group", 1);
  moe.normalize_topk = hf.get_or<bool>("norm_topk_prob", true);
  moe.routed_scaling_factor = hf.get_or<double>("routed_scaling_factor", 1.0);
  moe.score_correction_bias = true;  // DeepseekV3TopkRouter always has the buffer
  return m;
}

ModelSpec resolve_model_spec(const Config& config) {
  ModelSpec spec;
  spec.config = config.model;
  if (config.model.hf_dir) {
    std::string path = *config.model.hf_dir + "/config.json";
    ModelConfig merged = model_config_from_hf_json(read_text_file(path, ExitCode::kBadConfig), path);
    merged.hf_dir = config.model.hf_dir;
    const auto& copiers = model_field_copiers();
    for (const std::string& key : config.explicit_model_keys) {
      std::string field = key.rfind("model.", 0) == 0 ? key.substr(6) : key;
      if (field == "hf_dir") continue;
      auto it = copiers.find(field);
      MOETRAIN_ASSERT(it != copiers.end(), "no copier for model field " + field);
      it->second(merged, config.model);
    }
    spec.config = merged;
  }
  ModelConfig& m = spec.config;
  if (m.layers.empty()) m.layers.assign(static_cast<size_t>(m.num_layers), "mla");
  MOETRAIN_CHECK(static_cast<int64_t>(m.layers.size()) == m.num_layers, ExitCode::kBadConfig,
                 fmt::format("model.layers has {} entries but model.num_layers is {}", m.layers.size(), m.num_layers));
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const std::string& kind = m.layers[i];
    MOETRAIN_CHECK(kind == "mla", ExitCode::kBadConfig,
                   fmt::format("model.layers[{}] is \"{}\": this build runs mla layers only so far "
                               "(kda and dsa mixers are not implemented yet); use mla",
                               i, kind));
    spec.mixers.push_back(MixerKind::kMla);
    spec.ffns.push_back(static_cast<int64_t>(i) < m.first_k_dense ? FfnKind::kDense : FfnKind::kMoe);
  }
  // The merged model section must satisfy the same rules as one written in YAML.
  Config merged_config = config;
  merged_config.model = m;
  validate_config(merged_config);
  return spec;
}

}  // namespace moetrain
