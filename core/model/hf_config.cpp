// Hugging Face config.json -> the model section, for model_type deepseek_v3, deepseek_v32,
// kimi_k2 (DeepSeek-V3's architecture and keys), kimi_linear and kimi_k3.
// docs/HF_SEMANTICS.md says what each key means. Kimi-Linear's config.json comes in two
// spellings: the released checkpoint's (Moonshot's remote code: linear_attn_config, num_experts,
// moe_renormalize, model_max_length, ...) and what transformers 5 writes when it saves one
// (the same keys through its attribute map, plus layer_types / linear_* in some versions); both
// are read.
#include <fmt/format.h>

#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/io/fp8_block.h"
#include "core/io/json_integer.h"
#include "core/model/model_spec.h"

namespace moetrain {
namespace {

using Json = nlohmann::json;

// Typed access to config.json with messages that name the file, the model type and the key.
class HfJson {
 public:
  HfJson(const Json& json, const std::string& source, std::string model_type = "")
      : json_(json), source_(source), model_type_(std::move(model_type)) {}

  bool has(const char* key) const { return json_.contains(key) && !json_.at(key).is_null(); }

  template <typename T>
  T get(const char* key) const {
    MOETRAIN_CHECK(has(key), ExitCode::kBadConfig,
                   fmt::format("{}: missing key \"{}\", which a {} config.json must have", source_, key,
                               model_type_.empty() ? "model" : model_type_));
    return get_or<T>(key, T{});
  }

  template <typename T>
  T get_or(const char* key, T fallback) const {
    if (!has(key)) return fallback;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      T value{};
      if (!json_integer(json_.at(key), &value)) {
        throw Error(ExitCode::kBadConfig, fmt::format("{}: key \"{}\" is {}, expected an integer in [{}, {}]", source_,
                                                      key, json_.at(key).dump(), std::numeric_limits<T>::min(),
                                                      std::numeric_limits<T>::max()));
      }
      return value;
    }
    try {
      return json_.at(key).get<T>();
    } catch (const Json::exception& e) {
      throw Error(ExitCode::kBadConfig, fmt::format("{}: key \"{}\" has the wrong type ({})", source_, key, e.what()));
    }
  }

  // The first of `keys` present (one setting under the names different writers give it).
  const char* first_of(std::initializer_list<const char*> keys) const {
    for (const char* key : keys)
      if (has(key)) return key;
    return nullptr;
  }
  template <typename T>
  T get_any(std::initializer_list<const char*> keys) const {
    const char* key = first_of(keys);
    MOETRAIN_CHECK(key != nullptr, ExitCode::kBadConfig,
                   fmt::format("{}: missing key \"{}\" (or an alias of it), which a {} config.json must have",
                               source_, *keys.begin(), model_type_));
    return get_or<T>(key, T{});
  }
  template <typename T>
  T get_any_or(std::initializer_list<const char*> keys, T fallback) const {
    const char* key = first_of(keys);
    return key ? get_or<T>(key, fallback) : fallback;
  }

  const std::string& source() const { return source_; }

 private:
  const Json& json_;
  const std::string& source_;
  std::string model_type_;
};

// num_hidden_layers, which sizes the per-layer lists below before the config rules see it: a
// count no model has (the rules' limit of 4096 layers) is refused here, naming the key.
int64_t layer_count(const HfJson& hf) {
  const int64_t layers = hf.get<int64_t>("num_hidden_layers");
  MOETRAIN_CHECK(layers >= 1 && layers <= 4096, ExitCode::kBadConfig,
                 fmt::format("{}: \"num_hidden_layers\" = {} must be in 1..4096", hf.source(), layers));
  return layers;
}

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

// The MLA keys DeepSeek-V3 and Kimi-Linear share.
void mla_from_hf(const HfJson& hf, MlaConfig& mla) {
  mla.num_heads = hf.get<int64_t>("num_attention_heads");
  if (hf.has("q_lora_rank")) mla.q_lora_rank = hf.get<int64_t>("q_lora_rank");
  else mla.q_lora_rank.reset();
  mla.kv_lora_rank = hf.get<int64_t>("kv_lora_rank");
  mla.qk_nope_head_dim = hf.get<int64_t>("qk_nope_head_dim");
  mla.qk_rope_head_dim = hf.get<int64_t>("qk_rope_head_dim");
  mla.v_head_dim = hf.get<int64_t>("v_head_dim");
}

// What every family reads alike: the vocabulary, the widths and the layer count.
ModelConfig sizes_from_hf(const HfJson& hf, const std::string& model_type) {
  ModelConfig m;
  m.model_type = model_type;
  m.vocab_size = hf.get<int64_t>("vocab_size");
  m.hidden_size = hf.get<int64_t>("hidden_size");
  m.num_layers = layer_count(hf);
  m.intermediate_size = hf.get<int64_t>("intermediate_size");
  return m;
}

// DeepSeek-V3 / V3.1 / V3.2 and Kimi K2 ship FP8 block-scaled weights (core/io/fp8_block.h),
// kept in FP8 (model.weight_format: fp8) or dequantized at load. Another quantization_config is a
// checkpoint moetrain cannot read.
Fp8BlockQuantization check_deepseek_quantization(const Json& json, const std::string& source,
                                                 const std::string& model_type) {
  auto it = json.find("quantization_config");
  if (it == json.end() || it->is_null()) return {};
  const Json method = it->is_object() ? it->value("quant_method", Json()) : Json();
  MOETRAIN_CHECK(method == "fp8", ExitCode::kBadCheckpoint,
                 fmt::format("{}: quantization_config.quant_method is {}; a {} checkpoint is read in BF16 or in the "
                             "FP8 block-scaled layout it ships in (quant_method \"fp8\")",
                             source, method.is_null() ? "missing" : method.dump(), model_type));
  return fp8_quantization_from_json(*it, source);
}

ModelConfig deepseek_v3_from_hf(const Json& json, const HfJson& hf, const std::string& model_type = "deepseek_v3") {
  const std::string& source_name = hf.source();
  const Fp8BlockQuantization fp8 = check_deepseek_quantization(json, source_name, model_type);
  ModelConfig m = sizes_from_hf(hf, model_type);
  m.fp8_modules_to_not_convert = fp8.modules_to_not_convert;
  m.first_k_dense = hf.get_or<int64_t>("first_k_dense_replace", 0);
  m.rms_norm_eps = hf.get_or<double>("rms_norm_eps", 1e-6);
  m.tie_word_embeddings = hf.get_or<bool>("tie_word_embeddings", false);
  m.max_position_embeddings = hf.get_or<int64_t>("max_position_embeddings", 4096);
  m.layers.assign(static_cast<size_t>(m.num_layers), "mla");

  MlaConfig& mla = m.mla;
  mla_from_hf(hf, mla);
  mla.use_rope = mla.qk_rope_head_dim > 0;
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

// Kimi-Linear's mixer per layer: linear_attn_config's 1-based kda_layers / full_attn_layers
// (the released file), else transformers' layer_types, else its default (every 4th layer full
// attention).
std::vector<std::string> kimi_layers(const Json& json, const HfJson& hf, int64_t num_layers) {
  const std::string& source = hf.source();
  std::vector<std::string> layers(static_cast<size_t>(num_layers));
  const Json linear = json.value("linear_attn_config", Json());
  if (linear.is_object() && linear.contains("kda_layers") && linear.contains("full_attn_layers")) {
    std::set<int64_t> seen;
    for (const char* key : {"kda_layers", "full_attn_layers"}) {
      std::vector<int64_t> listed;
      const Json& list = linear.at(key);
      MOETRAIN_CHECK(list.is_array(), ExitCode::kBadConfig,
                     fmt::format("{}: linear_attn_config.{} must be a list of layer numbers, not {}", source, key,
                                 list.dump()));
      for (const Json& entry : list) {
        int64_t layer = 0;
        MOETRAIN_CHECK(json_integer(entry, &layer), ExitCode::kBadConfig,
                       fmt::format("{}: linear_attn_config.{} must be a list of layer numbers; {} is not an integer",
                                   source, key, entry.dump()));
        listed.push_back(layer);
      }
      for (int64_t layer : listed) {
        MOETRAIN_CHECK(layer >= 1 && layer <= num_layers, ExitCode::kBadConfig,
                       fmt::format("{}: linear_attn_config.{} lists layer {}, outside 1..{} (the lists are 1-based)",
                                   source, key, layer, num_layers));
        MOETRAIN_CHECK(seen.insert(layer).second, ExitCode::kBadConfig,
                       fmt::format("{}: layer {} is listed twice in linear_attn_config's kda_layers / full_attn_layers",
                                   source, layer));
        layers[static_cast<size_t>(layer - 1)] = std::string(key) == "kda_layers" ? "kda" : "mla";
      }
    }
    MOETRAIN_CHECK(static_cast<int64_t>(seen.size()) == num_layers, ExitCode::kBadConfig,
                   fmt::format("{}: linear_attn_config's kda_layers and full_attn_layers name {} of the {} layers; "
                               "every layer must be in exactly one of them",
                               source, seen.size(), num_layers));
    return layers;
  }
  if (hf.has("layer_types")) {
    const auto types = hf.get<std::vector<std::string>>("layer_types");
    MOETRAIN_CHECK(static_cast<int64_t>(types.size()) == num_layers, ExitCode::kBadConfig,
                   fmt::format("{}: layer_types has {} entries for {} layers", source, types.size(), num_layers));
    for (size_t i = 0; i < types.size(); ++i) {
      MOETRAIN_CHECK(types[i] == "linear_attention" || types[i] == "full_attention", ExitCode::kBadConfig,
                     fmt::format("{}: layer_types[{}] is \"{}\" (expected linear_attention or full_attention)", source,
                                 i, types[i]));
      layers[i] = types[i] == "linear_attention" ? "kda" : "mla";
    }
    return layers;
  }
  for (int64_t i = 0; i < num_layers; ++i) layers[static_cast<size_t>(i)] = (i + 1) % 4 == 0 ? "mla" : "kda";
  return layers;
}

// Dense FFN layers first, then MoE: transformers' mlp_layer_types, or first_k_dense_replace
// (default: the model type's).
int64_t first_k_dense_from_hf(const HfJson& hf, int64_t num_layers, int64_t default_first_k) {
  const std::string& source = hf.source();
  MOETRAIN_CHECK(hf.get_or<int64_t>("moe_layer_freq", 1) == 1, ExitCode::kBadConfig,
                 fmt::format("{}: moe_layer_freq {} is not supported (every layer after the dense ones is MoE)", source,
                             hf.get_or<int64_t>("moe_layer_freq", 1)));
  if (!hf.has("mlp_layer_types")) return hf.get_or<int64_t>("first_k_dense_replace", default_first_k);
  const auto types = hf.get<std::vector<std::string>>("mlp_layer_types");
  MOETRAIN_CHECK(static_cast<int64_t>(types.size()) == num_layers, ExitCode::kBadConfig,
                 fmt::format("{}: mlp_layer_types has {} entries for {} layers", source, types.size(), num_layers));
  int64_t dense = 0;
  while (dense < num_layers && types[static_cast<size_t>(dense)] == "dense") ++dense;
  for (int64_t i = dense; i < num_layers; ++i) {
    MOETRAIN_CHECK(types[static_cast<size_t>(i)] == "sparse", ExitCode::kBadConfig,
                   fmt::format("{}: mlp_layer_types[{}] is \"{}\": moetrain runs dense layers first, then MoE "
                               "(\"sparse\") layers only",
                               source, i, types[static_cast<size_t>(i)]));
  }
  return dense;
}

// KDA's heads, head size and conv width: linear_attn_config (released), or transformers' flat
// keys, whose names changed between versions.
KdaConfig kimi_kda(const Json& json, const HfJson& hf) {
  const std::string& source = hf.source();
  KdaConfig kda;
  kda.num_heads = 32;  // transformers' KimiLinearConfig defaults
  kda.head_dim = 128;
  kda.conv_width = 4;
  const Json linear = json.value("linear_attn_config", Json());
  if (linear.is_object()) {
    HfJson l(linear, source, "linear_attn_config");
    kda.num_heads = l.get_or<int64_t>("num_heads", kda.num_heads);
    kda.head_dim = l.get_or<int64_t>("head_dim", kda.head_dim);
    kda.conv_width = l.get_or<int64_t>("short_conv_kernel_size", kda.conv_width);
    kda.full_rank_output_gate = l.get_or<bool>("use_full_rank_gate", false);
    kda.lower_bound = l.get_or<double>("gate_lower_bound", 0.0);
  }
  kda.num_heads = hf.get_any_or<int64_t>({"linear_num_heads", "linear_num_value_heads"}, kda.num_heads);
  kda.head_dim = hf.get_any_or<int64_t>({"linear_head_dim", "linear_value_head_dim"}, kda.head_dim);
  kda.conv_width = hf.get_any_or<int64_t>({"linear_conv_kernel_dim"}, kda.conv_width);
  kda.full_rank_output_gate = hf.get_or<bool>("use_full_rank_output_gate", kda.full_rank_output_gate);
  kda.lower_bound = hf.get_or<double>("forget_gate_lower_bound", kda.lower_bound);
  // One head count and size for q, k and v (as in every released model).
  for (auto [key_name, value_name, value] :
       {std::tuple{"linear_num_key_heads", "num_heads", kda.num_heads},
        std::tuple{"linear_key_head_dim", "head_dim", kda.head_dim}}) {
    MOETRAIN_CHECK(!hf.has(key_name) || hf.get<int64_t>(key_name) == value, ExitCode::kBadConfig,
                   fmt::format("{}: {} = {} differs from the value heads' {} = {}; moetrain's KDA has one head "
                               "layout for q, k and v",
                               source, key_name, hf.get_or<int64_t>(key_name, 0), value_name, value));
  }
  return kda;
}

ModelConfig kimi_linear_from_hf(const Json& json, const HfJson& hf) {
  const std::string& source = hf.source();
  ModelConfig m = sizes_from_hf(hf, "kimi_linear");
  m.first_k_dense = first_k_dense_from_hf(hf, m.num_layers, 1);  // 1: both implementations' default
  m.rms_norm_eps = hf.get_or<double>("rms_norm_eps", 1e-5);
  m.tie_word_embeddings = hf.get_or<bool>("tie_word_embeddings", false);
  m.max_position_embeddings = hf.get_any_or<int64_t>({"model_max_length", "max_position_embeddings"}, 1048576);
  m.layers = kimi_layers(json, hf, m.num_layers);
  m.hidden_act = hf.get_or<std::string>("hidden_act", "silu");
  MOETRAIN_CHECK(m.hidden_act == "silu" || m.hidden_act == "situ", ExitCode::kBadConfig,
                 fmt::format("{}: hidden_act \"{}\" is not supported (silu: SwiGLU, or Kimi K3's situ)", source,
                             m.hidden_act));

  // NoPE MLA: neither Moonshot's code (mla_use_nope) nor transformers' KimiLinearAttention
  // rotates anything; the qk_rope_head_dim part of q and k stays, unrotated.
  mla_from_hf(hf, m.mla);
  m.mla.use_rope = false;
  // Kimi K3's gated MLA: attn * sigmoid(g_proj(x)), g_proj [heads * v_head_dim, hidden].
  if (hf.get_or<bool>("mla_use_output_gate", false)) m.attention_gate = "elementwise";

  m.kda = kimi_kda(json, hf);

  MoeConfig& moe = m.moe;
  moe.num_experts = hf.get_any<int64_t>({"num_experts", "n_routed_experts", "num_local_experts"});
  moe.top_k = hf.get_any<int64_t>({"num_experts_per_token", "num_experts_per_tok"});
  // Absent: transformers' default of one shared expert; null: none (Moonshot's code).
  const char* shared = json.contains("num_shared_experts") ? "num_shared_experts" : "n_shared_experts";
  moe.num_shared_experts = json.contains(shared) ? hf.get_or<int64_t>(shared, 0) : 1;
  moe.expert_intermediate_size = hf.get<int64_t>("moe_intermediate_size");
  moe.scoring = hf.get_any_or<std::string>({"moe_router_activation_func", "scoring_func"}, "sigmoid");
  moe.num_groups = hf.get_any_or<int64_t>({"num_expert_group", "n_group"}, 1);
  moe.topk_groups = hf.get_or<int64_t>("topk_group", 1);
  moe.normalize_topk = hf.get_any_or<bool>({"moe_renormalize", "norm_topk_prob"}, true);
  moe.routed_scaling_factor = hf.get_or<double>("routed_scaling_factor", 2.446);  // transformers' default
  moe.score_correction_bias = true;  // both implementations' routers have the bias
  return m;
}

// A key Kimi K3 gives a default when absent but "no such thing" when null (NeMo AutoModel's
// KimiK3TextConfig: `x: float | None = default`): the default, the value, or `none` for null.
double k3_optional(const Json& text, const HfJson& hf, const char* key, double fallback, double none) {
  if (!text.contains(key)) return fallback;
  return text.at(key).is_null() ? none : hf.get<double>(key);
}

// Kimi K3's vision_config (NeMo AutoModel's KimiK3VisionConfig; docs/HF_SEMANTICS.md §11): absent
// keys take its defaults. The variants moetrain does not build (LayerNorm blocks, biases, bicubic
// position resizing, other projectors or mergers) are refused by name rather than run differently.
VisionConfig kimi_k3_vision_from_hf(const Json& json, int64_t text_hidden, const std::string& source) {
  const Json& vision = json.at("vision_config");
  const std::string vision_source = source + " (vision_config)";
  HfJson hf(vision, vision_source, "kimi_k3");
  auto expect_value = [&](const char* key, const std::string& fallback, const std::string& supported) {
    const std::string value = hf.get_or<std::string>(key, fallback);
    MOETRAIN_CHECK(value == supported, ExitCode::kBadConfig,
                   fmt::format("{}: {} \"{}\" is not supported (moetrain builds Kimi K3's \"{}\")", vision_source, key,
                               value, supported));
  };
  expect_value("norm_type", "rmsnorm", "rmsnorm");
  expect_value("mm_projector_type", "patchmergerv2", "patchmergerv2");
  expect_value("merge_type", "sd2_tpool", "sd2_tpool");
  expect_value("pos_emb_type", "divided_fixed", "divided_fixed");
  expect_value("pos_emb_interpolation_mode", "bilinear", "bilinear");
  expect_value("mlp_type", "mlp2", "mlp2");
  for (const char* key : {"attn_bias", "linear_bias", "patch_embed_proj_bias"}) {
    MOETRAIN_CHECK(!hf.get_or<bool>(key, false), ExitCode::kBadConfig,
                   fmt::format("{}: {} is true; moetrain's vision tower has no biases (Kimi K3's has none)",
                               vision_source, key));
  }
  // The tower is built when the YAML says model.vision.enabled: true (a text-only run of the
  // checkpoint leaves vision_tower.* and mm_projector.* unread, as before).
  VisionConfig v;
  v.patch_size = hf.get_or<int64_t>("patch_size", 14);
  v.pos_emb_height = hf.get_or<int64_t>("init_pos_emb_height", 64);
  v.pos_emb_width = hf.get_or<int64_t>("init_pos_emb_width", 64);
  v.pos_emb_time = hf.get_or<int64_t>("init_pos_emb_time", 4);
  v.num_layers = hf.get_or<int64_t>("vt_num_hidden_layers", 27);
  v.hidden_size = hf.get_or<int64_t>("vt_hidden_size", 1024);
  v.num_heads = hf.get_or<int64_t>("vt_num_attention_heads", 12);
  v.qkv_hidden_size = hf.get_or<int64_t>("qkv_hidden_size", 1536);
  v.intermediate_size = hf.get_or<int64_t>("vt_intermediate_size", 4096);
  const std::vector<int64_t> merge = hf.get_or<std::vector<int64_t>>("merge_kernel_size", {2, 2});
  MOETRAIN_CHECK(merge.size() == 2 && merge[0] == merge[1], ExitCode::kBadConfig,
                 fmt::format("{}: merge_kernel_size must be two equal sides (Kimi K3: [2, 2])", vision_source));
  v.merge_size = merge[0];
  MOETRAIN_CHECK(hf.get_or<int64_t>("mm_hidden_size", v.hidden_size) == v.hidden_size, ExitCode::kBadConfig,
                 fmt::format("{}: mm_hidden_size differs from vt_hidden_size; the projector reads the tower's output",
                             vision_source));
  MOETRAIN_CHECK(hf.get_or<int64_t>("text_hidden_size", text_hidden) == text_hidden, ExitCode::kBadConfig,
                 fmt::format("{}: text_hidden_size {} differs from text_config's hidden_size {}", vision_source,
                             hf.get_or<int64_t>("text_hidden_size", text_hidden), text_hidden));
  v.projector_eps = hf.get_or<double>("projector_ln_eps", 1e-5);
  // The top-level key is the one NeMo's merge reads; the vision_config's copy is its fallback.
  v.placeholder_token_id = HfJson(json, source, "kimi_k3")
                               .get_or<int64_t>("media_placeholder_token_id",
                                                hf.get_or<int64_t>("media_placeholder_token_id", 163605));
  return v;
}

// Kimi K3 (model_type kimi_k3; NeMo AutoModel's KimiK3Config, sglang's kimi_k3): a vision-language
// checkpoint whose text_config is a Kimi-Linear config with K3's additions. Absent keys take
// KimiK3TextConfig's defaults, which differ from Kimi-Linear's in places (SiTU, latent MoE,
// attention residuals in blocks of 12, gated MLA, 2 shared experts, routed scaling 1).
ModelConfig kimi_k3_from_hf(const Json& json, const HfJson& top) {
  const std::string& source = top.source();
  MOETRAIN_CHECK(json.contains("text_config") && json.at("text_config").is_object(), ExitCode::kBadConfig,
                 fmt::format("{}: a kimi_k3 config.json keeps the language model's settings in a \"text_config\" "
                             "object, which is missing",
                             source));
  const Json& text = json.at("text_config");
  const std::string text_source = source + " (text_config)";
  HfJson hf(text, text_source, "kimi_k3");
  ModelConfig m = kimi_linear_from_hf(text, hf);
  m.model_type = "kimi_k3";
  m.hidden_act = hf.get_or<std::string>("hidden_act", "situ");
  m.situ_beta = k3_optional(text, hf, "activation_situ_beta", 4.0, 4.0);
  m.situ_linear_beta = k3_optional(text, hf, "activation_situ_linear_beta", 25.0, 0.0);
  MOETRAIN_CHECK(hf.get_or<bool>("mla_use_nope", true), ExitCode::kBadConfig,
                 fmt::format("{}: mla_use_nope is false; Kimi K3's MLA layers use no rotary embedding "
                             "(NeMo AutoModel refuses the same config)",
                             text_source));
  if (hf.get_or<bool>("mla_use_output_gate", true)) m.attention_gate = "elementwise";
  MoeConfig& moe = m.moe;
  if (!text.contains("num_shared_experts")) moe.num_shared_experts = 2;
  moe.routed_scaling_factor = hf.get_or<double>("routed_scaling_factor", 1.0);
  moe.latent_size = static_cast<int64_t>(k3_optional(text, hf, "routed_expert_hidden_size", 3584, 0));
  moe.use_latent_norm = moe.latent_size > 0 && hf.get_or<bool>("latent_moe_use_norm", true);
  m.attn_res_block_size = static_cast<int64_t>(k3_optional(text, hf, "attn_res_block_size", 12, 0));
  MOETRAIN_CHECK(hf.get_or<int64_t>("num_nextn_predict_layers", 0) == 0, ExitCode::kBadConfig,
                 fmt::format("{}: num_nextn_predict_layers {} (multi-token prediction layers) is not supported",
                             text_source, hf.get_or<int64_t>("num_nextn_predict_layers", 0)));
  // The released experts: compressed-tensors' MXFP4 (KimiK3Config keeps the quantization_config
  // in text_config and copies it to the top).
  const Json quantization = text.contains("quantization_config") ? text.at("quantization_config")
                                                                  : json.value("quantization_config", Json());
  if (quantization.is_object()) {
    const std::string format = quantization.value("format", std::string());
    MOETRAIN_CHECK(quantization.value("quant_method", std::string()) == "compressed-tensors" &&
                       format == "mxfp4-pack-quantized",
                   ExitCode::kBadConfig,
                   fmt::format("{}: quantization_config {} is not supported (moetrain reads Kimi K3's "
                               "compressed-tensors mxfp4-pack-quantized experts)",
                               source, quantization.dump()));
    moe.expert_format = "mxfp4";
  }
  if (json.contains("vision_config") && json.at("vision_config").is_object()) {
    m.vision = kimi_k3_vision_from_hf(json, m.hidden_size, source);
    log::info(fmt::format("{}: kimi_k3 vision tower ({} layers, hidden {}, patch {}) in vision_config; it is built "
                          "with model.vision.enabled: true (else the language model trains on text)",
                          source, m.vision.num_layers, m.vision.hidden_size, m.vision.patch_size));
  }
  return m;
}

// DeepSeek-V3.2 (transformers DeepseekV32Config): DeepSeek-V3 with a lightning indexer in every
// layer. Its MLA always has the q latent (the indexer reads it); mlp_layer_types, when written,
// says which layers are dense.
ModelConfig deepseek_v32_from_hf(const Json& json, const HfJson& hf) {
  ModelConfig m = deepseek_v3_from_hf(json, hf, "deepseek_v32");
  m.layers.assign(static_cast<size_t>(m.num_layers), "dsa");
  m.first_k_dense = first_k_dense_from_hf(hf, m.num_layers, 3);  // 3: DeepseekV32Config's default
  MOETRAIN_CHECK(m.mla.q_lora_rank.has_value(), ExitCode::kBadConfig,
                 fmt::format("{}: q_lora_rank is null; a deepseek_v32 model's indexer reads the q latent, so "
                             "config.json must give q_lora_rank",
                             hf.source()));
  m.dsa.index_n_heads = hf.get<int64_t>("index_n_heads");
  m.dsa.index_head_dim = hf.get<int64_t>("index_head_dim");
  m.dsa.index_topk = hf.get<int64_t>("index_topk");
  m.dsa.indexer_rope_interleave = hf.get_or<bool>("indexer_rope_interleave", false);
  return m;
}

}  // namespace

std::map<std::string, std::string> hf_config_key_sources(const std::string& json_text, const std::string& source_name) {
  // Each model key and the config.json keys it is read from (hf_config above; the first present
  // is named; kimi_k3 reads them under text_config).
  static const std::vector<std::pair<const char*, std::vector<const char*>>> kKeys = {
      {"model.model_type", {"model_type"}},
      {"model.vocab_size", {"vocab_size"}},
      {"model.hidden_size", {"hidden_size"}},
      {"model.num_layers", {"num_hidden_layers"}},
      {"model.layers", {"linear_attn_config", "layer_types", "num_hidden_layers"}},
      {"model.intermediate_size", {"intermediate_size"}},
      {"model.first_k_dense", {"mlp_layer_types", "first_k_dense_replace"}},
      {"model.rms_norm_eps", {"rms_norm_eps"}},
      {"model.tie_word_embeddings", {"tie_word_embeddings"}},
      {"model.max_position_embeddings", {"model_max_length", "max_position_embeddings"}},
      {"model.attention_gate", {"mla_use_output_gate"}},
      {"model.hidden_act", {"hidden_act"}},
      {"model.situ_beta", {"activation_situ_beta"}},
      {"model.situ_linear_beta", {"activation_situ_linear_beta"}},
      {"model.attn_res_block_size", {"attn_res_block_size"}},
      {"model.mla.num_heads", {"num_attention_heads"}},
      {"model.mla.q_lora_rank", {"q_lora_rank"}},
      {"model.mla.kv_lora_rank", {"kv_lora_rank"}},
      {"model.mla.qk_nope_head_dim", {"qk_nope_head_dim"}},
      {"model.mla.qk_rope_head_dim", {"qk_rope_head_dim"}},
      {"model.mla.v_head_dim", {"v_head_dim"}},
      {"model.mla.rope_theta", {"rope_parameters", "rope_theta"}},
      {"model.mla.rope_scaling.type", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.factor", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.original_max_position_embeddings", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.beta_fast", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.beta_slow", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.mscale", {"rope_parameters", "rope_scaling"}},
      {"model.mla.rope_scaling.mscale_all_dim", {"rope_parameters", "rope_scaling"}},
      {"model.kda.num_heads", {"linear_num_heads", "linear_num_value_heads", "linear_attn_config"}},
      {"model.kda.head_dim", {"linear_head_dim", "linear_value_head_dim", "linear_attn_config"}},
      {"model.kda.conv_width", {"linear_conv_kernel_dim", "linear_attn_config"}},
      {"model.kda.lower_bound", {"forget_gate_lower_bound", "linear_attn_config"}},
      {"model.kda.full_rank_output_gate", {"use_full_rank_output_gate", "linear_attn_config"}},
      {"model.dsa.index_n_heads", {"index_n_heads"}},
      {"model.dsa.index_head_dim", {"index_head_dim"}},
      {"model.dsa.index_topk", {"index_topk"}},
      {"model.dsa.indexer_rope_interleave", {"indexer_rope_interleave"}},
      {"model.moe.num_experts", {"n_routed_experts", "num_experts", "num_local_experts"}},
      {"model.moe.top_k", {"num_experts_per_tok", "num_experts_per_token"}},
      {"model.moe.num_shared_experts", {"n_shared_experts", "num_shared_experts"}},
      {"model.moe.expert_intermediate_size", {"moe_intermediate_size"}},
      {"model.moe.scoring", {"scoring_func", "moe_router_activation_func"}},
      {"model.moe.num_groups", {"n_group", "num_expert_group"}},
      {"model.moe.topk_groups", {"topk_group"}},
      {"model.moe.normalize_topk", {"norm_topk_prob", "moe_renormalize"}},
      {"model.moe.routed_scaling_factor", {"routed_scaling_factor"}},
      {"model.moe.latent_size", {"routed_expert_hidden_size"}},
      {"model.moe.use_latent_norm", {"latent_moe_use_norm"}},
      {"model.moe.expert_format", {"quantization_config"}},
  };
  Json json = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) json = Json::object();
  const bool k3 = json.value("model_type", Json()) == "kimi_k3" && json.contains("text_config") &&
                  json.at("text_config").is_object();
  const Json& text = k3 ? json.at("text_config") : json;
  std::map<std::string, std::string> sources;
  for (const auto& [path, candidates] : kKeys) {
    std::string named;
    for (const char* key : candidates) {
      if (text.contains(key)) {
        named = fmt::format(" (\"{}{}\")", k3 && std::string(key) != "model_type" ? "text_config." : "", key);
        break;
      }
    }
    // A key config.json leaves out takes its model type's default (docs/HF_SEMANTICS.md).
    sources[path] = source_name + (named.empty() ? " (default of its model_type)" : named);
  }
  return sources;
}

ModelConfig model_config_from_hf_json(const std::string& json_text, const std::string& source_name) {
  Json json;
  try {
    json = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadConfig, fmt::format("{}: not valid JSON ({})", source_name, e.what()));
  }
  MOETRAIN_CHECK(json.is_object(), ExitCode::kBadConfig, source_name + ": config.json must be a JSON object");
  const std::string model_type = HfJson(json, source_name).get<std::string>("model_type");
  HfJson hf(json, source_name, model_type);
  if (model_type == "deepseek_v3") return deepseek_v3_from_hf(json, hf);
  if (model_type == "deepseek_v32") return deepseek_v32_from_hf(json, hf);
  // Kimi K2 (moonshotai/Kimi-K2-*): DeepseekV3ForCausalLM under Moonshot's model_type, with
  // DeepSeek-V3's config keys (384 experts, one expert group, YaRN rope_scaling).
  if (model_type == "kimi_k2") return deepseek_v3_from_hf(json, hf, "kimi_k2");
  if (model_type == "kimi_linear") return kimi_linear_from_hf(json, hf);
  if (model_type == "kimi_k3") return kimi_k3_from_hf(json, hf);
  throw Error(ExitCode::kBadConfig, fmt::format("{}: model_type \"{}\" is not supported yet (supported: deepseek_v3, "
                                                "deepseek_v32, kimi_k2, kimi_linear, kimi_k3)",
                                                source_name, model_type));
}

}  // namespace moetrain
