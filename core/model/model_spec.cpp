#include "core/model/model_spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
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
      MOETRAIN_FIELD("hidden_act", hidden_act),
      MOETRAIN_FIELD("situ_beta", situ_beta),
      MOETRAIN_FIELD("situ_linear_beta", situ_linear_beta),
      MOETRAIN_FIELD("attn_res_block_size", attn_res_block_size),
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
      MOETRAIN_FIELD("kda", kda),
      MOETRAIN_FIELD("kda.num_heads", kda.num_heads),
      MOETRAIN_FIELD("kda.head_dim", kda.head_dim),
      MOETRAIN_FIELD("kda.conv_width", kda.conv_width),
      MOETRAIN_FIELD("kda.lower_bound", kda.lower_bound),
      MOETRAIN_FIELD("kda.fused_qkv", kda.fused_qkv),
      MOETRAIN_FIELD("kda.full_rank_output_gate", kda.full_rank_output_gate),
      MOETRAIN_FIELD("dsa", dsa),
      MOETRAIN_FIELD("dsa.index_n_heads", dsa.index_n_heads),
      MOETRAIN_FIELD("dsa.index_head_dim", dsa.index_head_dim),
      MOETRAIN_FIELD("dsa.index_topk", dsa.index_topk),
      MOETRAIN_FIELD("dsa.indexer_rope_interleave", dsa.indexer_rope_interleave),
      MOETRAIN_FIELD("vision", vision),
      MOETRAIN_FIELD("vision.enabled", vision.enabled),
      MOETRAIN_FIELD("vision.patch_size", vision.patch_size),
      MOETRAIN_FIELD("vision.pos_emb_height", vision.pos_emb_height),
      MOETRAIN_FIELD("vision.pos_emb_width", vision.pos_emb_width),
      MOETRAIN_FIELD("vision.pos_emb_time", vision.pos_emb_time),
      MOETRAIN_FIELD("vision.num_layers", vision.num_layers),
      MOETRAIN_FIELD("vision.hidden_size", vision.hidden_size),
      MOETRAIN_FIELD("vision.num_heads", vision.num_heads),
      MOETRAIN_FIELD("vision.qkv_hidden_size", vision.qkv_hidden_size),
      MOETRAIN_FIELD("vision.intermediate_size", vision.intermediate_size),
      MOETRAIN_FIELD("vision.merge_size", vision.merge_size),
      MOETRAIN_FIELD("vision.norm_eps", vision.norm_eps),
      MOETRAIN_FIELD("vision.projector_eps", vision.projector_eps),
      MOETRAIN_FIELD("vision.placeholder_token_id", vision.placeholder_token_id),
      MOETRAIN_FIELD("vision.projector_train", vision.projector_train),
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
      MOETRAIN_FIELD("moe.latent_size", moe.latent_size),
      MOETRAIN_FIELD("moe.use_latent_norm", moe.use_latent_norm),
      MOETRAIN_FIELD("moe.expert_format", moe.expert_format),
      MOETRAIN_FIELD("weight_format", weight_format),
  };
#undef MOETRAIN_FIELD
  return copiers;
}

std::string read_hf_config_json(const std::string& hf_dir, const std::string& path) {
  std::error_code ec;
  MOETRAIN_CHECK(std::filesystem::is_directory(hf_dir, ec), ExitCode::kBadConfig,
                 fmt::format("model.hf_dir: {} is not a directory (set model.hf_dir to a Hugging Face model "
                             "directory holding config.json and the safetensors)",
                             hf_dir));
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), ExitCode::kBadConfig,
                 fmt::format("model.hf_dir: cannot read {} ({}): a Hugging Face model directory holds config.json",
                             path, std::strerror(errno)));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

ModelSpec resolve_model_spec(const Config& config) {
  ModelSpec spec;
  spec.config = config.model;
  // Where the merged model keys come from, for the rules' messages: config.json's keys, except
  // those the YAML set.
  std::map<std::string, std::string> sources;
  if (config.model.hf_dir) {
    std::string path = *config.model.hf_dir + "/config.json";
    const std::string json_text = read_hf_config_json(*config.model.hf_dir, path);
    ModelConfig merged = model_config_from_hf_json(json_text, path);
    sources = hf_config_key_sources(json_text, path);
    merged.hf_dir = config.model.hf_dir;
    const auto& copiers = model_field_copiers();
    for (const std::string& key : config.explicit_model_keys) {
      std::string field = key.rfind("model.", 0) == 0 ? key.substr(6) : key;
      sources.erase("model." + field);
      if (field == "hf_dir") continue;
      auto it = copiers.find(field);
      MOETRAIN_ASSERT(it != copiers.end(), "no copier for model field " + field);
      it->second(merged, config.model);
    }
    spec.config = merged;
  }
  ModelConfig& m = spec.config;
  // The merged model section must satisfy the same rules as one written in YAML (and before
  // its sizes are used below).
  Config merged_config = config;
  merged_config.model = m;
  validate_config(merged_config, sources);
  if (m.layers.empty()) m.layers.assign(static_cast<size_t>(m.num_layers), "mla");
  MOETRAIN_CHECK(static_cast<int64_t>(m.layers.size()) == m.num_layers, ExitCode::kBadConfig,
                 fmt::format("model.layers has {} entries but model.num_layers is {}", m.layers.size(), m.num_layers));
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const std::string& kind = m.layers[i];
    MOETRAIN_CHECK(kind == "mla" || kind == "kda" || kind == "dsa", ExitCode::kBadConfig,
                   fmt::format("model.layers[{}] is \"{}\"; expected mla, kda or dsa", i, kind));
    spec.mixers.push_back(kind == "kda" ? MixerKind::kKda : kind == "dsa" ? MixerKind::kDsa : MixerKind::kMla);
    spec.ffns.push_back(static_cast<int64_t>(i) < m.first_k_dense ? FfnKind::kDense : FfnKind::kMoe);
  }
  return spec;
}

}  // namespace moetrain
