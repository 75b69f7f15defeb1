#include "core/config/config_rules.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <set>
#include <utility>

#include "core/config/lora_patterns.h"

namespace moetrain::config_detail {
namespace {

const std::vector<std::string> kMixers = {"mla", "kda", "dsa"};
const std::vector<std::string> kAttentionGates = {"none", "headwise", "elementwise"};
const std::vector<std::string> kHiddenActs = {"silu", "situ"};
const std::vector<std::string> kRopeScalingTypes = {"none", "yarn"};
const std::vector<std::string> kScorings = {"sigmoid", "softmax"};
const std::vector<std::string> kAuxLossTypes = {"sequence", "batch"};
const std::vector<std::string> kSchedules = {"cosine", "linear", "constant"};
const std::vector<std::string> kDevices = {"auto", "cpu", "cuda"};
const std::vector<std::string> kLogLevels = {"debug", "info", "warn", "error", "off"};
const std::vector<std::string> kExportLayouts = {"transformers5", "per_expert", "released"};
const std::vector<std::string> kExpertGateUp = {"separate", "fused"};
const std::vector<std::string> kExpertA = {"per_expert", "shared"};
const std::vector<std::string> kExpertFormats = {"bf16", "mxfp4"};
const std::vector<std::string> kWeightFormats = {"bf16", "fp8"};
// The model types moetrain builds (core/model/hf_config.cpp reads their config.json); without
// model.hf_dir the type still chooses the exported adapter's names (Kimi K3's language_model.).
const std::vector<std::string> kModelTypes = {"deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear", "kimi_k3"};
// Beyond these no model exists, and products of them overflow the plan's and the model's integer
// counts: a width, head count or expert count above kMaxModelDim, a vocabulary above
// kMaxVocabSize, more than kMaxModelLayers layers is a typo, refused before anything is sized.
constexpr int64_t kMaxModelDim = int64_t{1} << 20, kMaxVocabSize = int64_t{1} << 24, kMaxModelLayers = 4096;
// Module names LoRA can wrap (the checkpoints' names for DeepSeek/Kimi modules). `experts` means
// every routed expert's gate/up/down projections, `shared_experts` the shared experts'. KDA's
// projections: q/k/v_proj (qkv_proj when fused), f_a/f_b_proj (forget gate), b_proj (beta),
// g_a/g_b_proj or g_proj (output gate), o_proj. Kimi K3's latent MoE: routed_expert_down_proj /
// routed_expert_up_proj.
const std::vector<std::string> kLoraTargets = {
    "q_a_proj", "q_b_proj", "q_proj",   "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",  "k_proj",
    "v_proj",   "qkv_proj", "f_a_proj", "f_b_proj",           "b_proj",    "g_a_proj", "g_b_proj",
    "g_proj",   "gate_proj", "up_proj", "down_proj",          "shared_experts", "experts",
    "routed_expert_down_proj", "routed_expert_up_proj"};

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) text += (i ? separator : "") + items[i];
  return text;
}

std::string show(int64_t value) { return std::to_string(value); }
std::string show(double value) { return format_number(value); }

class Rules {
 public:
  Rules(const RuleContext& context, std::vector<Problem>* problems) : context_(context), problems_(problems) {}

  // False when a model key's final value is not known yet (see RuleContext).
  bool known(std::initializer_list<const char*> keys) const {
    if (!context_.model_from_hf_pending) return true;
    for (const char* key : keys) {
      std::string path = key;
      if (path.rfind("model.", 0) == 0 && !is_set(path)) return false;
    }
    return true;
  }

  bool is_set(const std::string& path) const {
    return context_.origins != nullptr && context_.origins->count(path) > 0;
  }

  // Records a failed rule, located at the first of `keys` that the config set.
  void fail(std::initializer_list<std::string> keys, const std::string& message) {
    KeyOrigin where;
    where.source = context_.source;
    for (const std::string& key : keys) {
      // "model.layers[3]" is located where model.layers is.
      std::string path = key.substr(0, key.find('['));
      if (is_set(path)) {
        where = context_.origins->at(path);
        break;
      }
    }
    problems_->push_back({where, message});
  }

  template <class T>
  void at_least(const std::string& key, T value, T minimum, const std::string& why = "") {
    if (value < minimum) {
      fail({key}, "`" + key + "` = " + show(value) + " must be >= " + show(minimum) + why);
    }
  }

  void positive(const std::string& key, int64_t value) {
    if (value <= 0) fail({key}, "`" + key + "` = " + show(value) + " must be > 0");
  }

  void at_most(const std::string& key, int64_t value, int64_t maximum, const std::string& why) {
    if (value > maximum) fail({key}, "`" + key + "` = " + show(value) + " must be <= " + show(maximum) + why);
  }

  void positive(const std::string& key, double value) {
    if (!(value > 0)) fail({key}, "`" + key + "` = " + show(value) + " must be > 0");
  }

  void non_negative(const std::string& key, double value) {
    if (value < 0) fail({key}, "`" + key + "` = " + show(value) + " must be >= 0");
  }

  // lo <= value < hi (hi_inclusive: <= hi).
  void in_range(const std::string& key, double value, double lo, double hi, bool hi_inclusive) {
    bool ok = value >= lo && (hi_inclusive ? value <= hi : value < hi);
    if (!ok) {
      fail({key}, "`" + key + "` = " + show(value) + " must be in [" + show(lo) + ", " + show(hi) +
                      (hi_inclusive ? "]" : ")"));
    }
  }

  void one_of(const std::string& key, const std::string& value, const std::vector<std::string>& allowed) {
    if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
      fail({key}, "`" + key + "` = `" + value + "` is not allowed: use one of " + join(allowed, " | "));
    }
  }

  void not_empty(const std::string& key, const std::string& value) {
    if (value.empty()) fail({key}, "`" + key + "` must not be empty");
  }

 private:
  const RuleContext& context_;
  std::vector<Problem>* problems_;
};

void check_required(const Config& c, const RuleContext& context, Rules& r) {
  if (!context.check_required_keys || c.model.hf_dir) return;
  // Without a Hugging Face directory the file must state the model's shape: silently training
  // the built-in toy default because a key was forgotten would waste a job.
  for (const char* key : {"model.vocab_size", "model.hidden_size", "model.num_layers"}) {
    if (!r.is_set(key)) {
      r.fail({key}, std::string("missing required key `") + key +
                        "`: set it, or set `model.hf_dir` to take the model's shape from config.json");
    }
  }
}

void check_mla(const MlaConfig& m, Rules& r) {
  r.positive("model.mla.num_heads", m.num_heads);
  if (m.q_lora_rank) r.positive("model.mla.q_lora_rank", *m.q_lora_rank);
  r.positive("model.mla.kv_lora_rank", m.kv_lora_rank);
  r.at_least<int64_t>("model.mla.qk_nope_head_dim", m.qk_nope_head_dim, 0);
  r.at_least<int64_t>("model.mla.qk_rope_head_dim", m.qk_rope_head_dim, 0);
  r.positive("model.mla.v_head_dim", m.v_head_dim);
  r.positive("model.mla.rope_theta", m.rope_theta);
  if (r.known({"model.mla.qk_nope_head_dim", "model.mla.qk_rope_head_dim"}) &&
      m.qk_nope_head_dim + m.qk_rope_head_dim <= 0) {
    r.fail({"model.mla.qk_nope_head_dim", "model.mla.qk_rope_head_dim"},
           "`model.mla.qk_nope_head_dim` + `model.mla.qk_rope_head_dim` must be > 0: a query head needs dimensions");
  }
  // use_rope false with qk_rope_head_dim > 0 is legal: Kimi-Linear and K3 keep the 64 "rope"
  // dimensions in their weights but never rotate them (mla_use_nope).
  if (r.known({"model.mla.use_rope", "model.mla.qk_rope_head_dim"}) && m.use_rope) {
    if (m.qk_rope_head_dim == 0) {
      r.fail({"model.mla.qk_rope_head_dim", "model.mla.use_rope"},
             "`model.mla.use_rope` is true but `model.mla.qk_rope_head_dim` is 0: give the rotary part "
             "dimensions (e.g. 64) or set use_rope: false");
    } else if (m.qk_rope_head_dim % 2 != 0) {
      r.fail({"model.mla.qk_rope_head_dim"}, "`model.mla.qk_rope_head_dim` = " + show(m.qk_rope_head_dim) +
                                                 " must be even: rotary embedding turns pairs of dimensions");
    }
  }
  const RopeScalingConfig& s = m.rope_scaling;
  r.one_of("model.mla.rope_scaling.type", s.type, kRopeScalingTypes);
  r.positive("model.mla.rope_scaling.factor", s.factor);
  r.positive("model.mla.rope_scaling.original_max_position_embeddings", s.original_max_position_embeddings);
  r.non_negative("model.mla.rope_scaling.mscale", s.mscale);
  r.non_negative("model.mla.rope_scaling.mscale_all_dim", s.mscale_all_dim);
  if (s.type == "yarn") {
    r.at_least("model.mla.rope_scaling.factor", s.factor, 1.0, ": YaRN stretches the original context");
    if (!(s.beta_slow > 0 && s.beta_fast > s.beta_slow)) {
      r.fail({"model.mla.rope_scaling.beta_fast", "model.mla.rope_scaling.beta_slow"},
             "YaRN needs 0 < `model.mla.rope_scaling.beta_slow` < `model.mla.rope_scaling.beta_fast`, got " +
                 show(s.beta_slow) + " and " + show(s.beta_fast));
    }
    if (r.known({"model.mla.use_rope"}) && !m.use_rope) {
      r.fail({"model.mla.rope_scaling.type", "model.mla.use_rope"},
             "`model.mla.rope_scaling.type` is yarn but `model.mla.use_rope` is false: there is no rotation "
             "to scale; set rope_scaling.type: none");
    }
  }
}

void check_kda(const KdaConfig& k, Rules& r) {
  r.positive("model.kda.num_heads", k.num_heads);
  r.positive("model.kda.head_dim", k.head_dim);
  r.positive("model.kda.conv_width", k.conv_width);
  if (!(k.lower_bound <= 0.0)) {
    r.fail({"model.kda.lower_bound"}, "`model.kda.lower_bound` = " + show(k.lower_bound) +
                                          " must be <= 0: the forget gate is a log decay (0: Kimi-Linear's "
                                          "softplus gate, < 0: Kimi K3's bounded gate, e.g. -5)");
  }
}

// The dsa section's own ranges, and what a dsa layer needs of MLA: a q latent for the indexer's
// queries, and room in the indexer heads for the rotated columns.
void check_dsa(const ModelConfig& m, Rules& r) {
  const DsaConfig& d = m.dsa;
  r.positive("model.dsa.index_n_heads", d.index_n_heads);
  r.positive("model.dsa.index_head_dim", d.index_head_dim);
  r.positive("model.dsa.index_topk", d.index_topk);
  if (std::find(m.layers.begin(), m.layers.end(), "dsa") == m.layers.end()) return;
  if (r.known({"model.mla.q_lora_rank"}) && !m.mla.q_lora_rank) {
    r.fail({"model.layers", "model.mla.q_lora_rank"},
           "`model.layers` has dsa layers but `model.mla.q_lora_rank` is null: the DSA indexer takes its queries "
           "from the q latent (q_a_proj); set model.mla.q_lora_rank (DeepSeek-V3.2: 1536)");
  }
  if (r.known({"model.mla.use_rope", "model.mla.qk_rope_head_dim", "model.dsa.index_head_dim"}) && m.mla.use_rope &&
      d.index_head_dim < m.mla.qk_rope_head_dim) {
    r.fail({"model.dsa.index_head_dim", "model.mla.qk_rope_head_dim"},
           "`model.dsa.index_head_dim` = " + show(d.index_head_dim) + " is smaller than `model.mla.qk_rope_head_dim` = " +
               show(m.mla.qk_rope_head_dim) + ": the indexer rotates its first qk_rope_head_dim columns");
  }
}

void check_moe(const MoeConfig& e, Rules& r) {
  r.positive("model.moe.num_experts", e.num_experts);
  r.positive("model.moe.top_k", e.top_k);
  r.at_least<int64_t>("model.moe.num_shared_experts", e.num_shared_experts, 0);
  r.positive("model.moe.expert_intermediate_size", e.expert_intermediate_size);
  r.one_of("model.moe.scoring", e.scoring, kScorings);
  r.positive("model.moe.num_groups", e.num_groups);
  r.positive("model.moe.topk_groups", e.topk_groups);
  r.positive("model.moe.routed_scaling_factor", e.routed_scaling_factor);
  r.non_negative("model.moe.aux_loss_coef", e.aux_loss_coef);
  r.one_of("model.moe.aux_loss_type", e.aux_loss_type, kAuxLossTypes);
  r.non_negative("model.moe.router_noise", e.router_noise);
  r.non_negative("model.moe.bias_update_rate", e.bias_update_rate);
  if (r.known({"model.moe.bias_update_rate", "model.moe.score_correction_bias"}) && e.bias_update_rate > 0 &&
      !e.score_correction_bias) {
    r.fail({"model.moe.bias_update_rate", "model.moe.score_correction_bias"},
           "`model.moe.bias_update_rate` moves the experts' selection bias, but `model.moe.score_correction_bias` is "
           "false (the model has none): set bias_update_rate to 0, or use a model with e_score_correction_bias");
  }
  r.at_least<int64_t>("model.moe.latent_size", e.latent_size, 0);
  if (r.known({"model.moe.use_latent_norm", "model.moe.latent_size"}) && e.use_latent_norm && e.latent_size == 0) {
    r.fail({"model.moe.use_latent_norm", "model.moe.latent_size"},
           "`model.moe.use_latent_norm` normalizes the latent experts' sum, but `model.moe.latent_size` is 0 (no latent "
           "MoE): set latent_size (routed_expert_hidden_size) or drop use_latent_norm");
  }
  if (e.num_experts <= 0 || e.top_k <= 0 || e.num_groups <= 0 || e.topk_groups <= 0) return;

  if (r.known({"model.moe.top_k", "model.moe.num_experts"}) && e.top_k > e.num_experts) {
    r.fail({"model.moe.top_k", "model.moe.num_experts"},
           "`model.moe.top_k` = " + show(e.top_k) + " must be <= `model.moe.num_experts` = " + show(e.num_experts) +
               ": a token cannot pick more experts than exist");
    return;  // the group rules below would only restate it
  }
  if (r.known({"model.moe.num_experts", "model.moe.num_groups"}) && e.num_experts % e.num_groups != 0) {
    r.fail({"model.moe.num_groups", "model.moe.num_experts"},
           "`model.moe.num_experts` = " + show(e.num_experts) + " is not divisible by `model.moe.num_groups` = " +
               show(e.num_groups) + ": expert groups must be equal in size");
    return;
  }
  if (r.known({"model.moe.topk_groups", "model.moe.num_groups"}) && e.topk_groups > e.num_groups) {
    r.fail({"model.moe.topk_groups", "model.moe.num_groups"},
           "`model.moe.topk_groups` = " + show(e.topk_groups) + " must be <= `model.moe.num_groups` = " +
               show(e.num_groups));
    return;
  }
  int64_t reachable = e.topk_groups * (e.num_experts / e.num_groups);
  if (r.known({"model.moe.top_k", "model.moe.topk_groups", "model.moe.num_experts", "model.moe.num_groups"}) &&
      e.top_k > reachable) {
    r.fail({"model.moe.top_k", "model.moe.topk_groups"},
           "`model.moe.top_k` = " + show(e.top_k) + " is more than the " + show(reachable) +
               " experts in the `model.moe.topk_groups` = " + show(e.topk_groups) +
               " selected groups (num_experts / num_groups each): raise topk_groups or lower top_k");
  }
}

// MXFP4 packs 32 values per scale along each expert weight's input: the experts' input width
// (latent_size, else hidden_size) and expert_intermediate_size must be whole groups.
void check_expert_format(const ModelConfig& m, Rules& r) {
  r.one_of("model.moe.expert_format", m.moe.expert_format, kExpertFormats);
  if (m.moe.expert_format != "mxfp4") return;
  auto whole_groups = [&](const char* key, int64_t value) {
    if (r.known({key, "model.moe.expert_format"}) && value % 32 != 0) {
      r.fail({key, "model.moe.expert_format"},
             "`model.moe.expert_format` = `mxfp4` packs 32 values per scale along each expert weight's input, but `" +
                 std::string(key) + "` = " + show(value) + " is not a multiple of 32: use expert_format `bf16`");
    }
  };
  const bool latent = m.moe.latent_size > 0;
  whole_groups(latent ? "model.moe.latent_size" : "model.hidden_size", latent ? m.moe.latent_size : m.hidden_size);
  whole_groups("model.moe.expert_intermediate_size", m.moe.expert_intermediate_size);
}

// FP8 storage is the routed experts' format too: one of weight_format fp8 and expert_format mxfp4.
void check_weight_format(const ModelConfig& m, Rules& r) {
  r.one_of("model.weight_format", m.weight_format, kWeightFormats);
  if (m.weight_format != "fp8") return;
  if (r.known({"model.weight_format", "model.moe.expert_format"}) && m.moe.expert_format == "mxfp4") {
    r.fail({"model.weight_format", "model.moe.expert_format"},
           "`model.weight_format` = `fp8` and `model.moe.expert_format` = `mxfp4` both set the routed experts' format: "
           "FP8 checkpoints (DeepSeek-V3, Kimi K2) take weight_format fp8 alone, Kimi K3 expert_format mxfp4 alone");
  }
}

// Upper bounds of every size (see kMaxModelDim).
void check_model_limits(const ModelConfig& m, Rules& r) {
  const std::string beyond = ": beyond what any GPU or host holds; check the config";
  r.at_most("model.vocab_size", m.vocab_size, kMaxVocabSize, beyond);
  r.at_most("model.num_layers", m.num_layers, kMaxModelLayers, beyond);
  for (const auto& [key, value] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"model.hidden_size", m.hidden_size},
           {"model.intermediate_size", m.intermediate_size},
           {"model.mla.num_heads", m.mla.num_heads},
           {"model.mla.q_lora_rank", m.mla.q_lora_rank.value_or(0)},
           {"model.mla.kv_lora_rank", m.mla.kv_lora_rank},
           {"model.mla.qk_nope_head_dim", m.mla.qk_nope_head_dim},
           {"model.mla.qk_rope_head_dim", m.mla.qk_rope_head_dim},
           {"model.mla.v_head_dim", m.mla.v_head_dim},
           {"model.kda.num_heads", m.kda.num_heads},
           {"model.kda.head_dim", m.kda.head_dim},
           {"model.kda.conv_width", m.kda.conv_width},
           {"model.dsa.index_n_heads", m.dsa.index_n_heads},
           {"model.dsa.index_head_dim", m.dsa.index_head_dim},
           {"model.moe.num_experts", m.moe.num_experts},
           {"model.moe.num_shared_experts", m.moe.num_shared_experts},
           {"model.moe.expert_intermediate_size", m.moe.expert_intermediate_size},
           {"model.moe.latent_size", m.moe.latent_size}}) {
    r.at_most(key, value, kMaxModelDim, beyond);
  }
}

// The vision tower's shape: what its ops need (a head_dim for the 2-D RoPE's four-way split,
// grids the merger can pair up) and a placeholder token inside the vocabulary.
void check_vision(const ModelConfig& m, Rules& r) {
  const VisionConfig& v = m.vision;
  if (!v.enabled) return;
  for (const auto& [key, value] : std::vector<std::pair<const char*, int64_t>>{
           {"model.vision.patch_size", v.patch_size},
           {"model.vision.pos_emb_height", v.pos_emb_height},
           {"model.vision.pos_emb_width", v.pos_emb_width},
           {"model.vision.pos_emb_time", v.pos_emb_time},
           {"model.vision.num_layers", v.num_layers},
           {"model.vision.hidden_size", v.hidden_size},
           {"model.vision.num_heads", v.num_heads},
           {"model.vision.qkv_hidden_size", v.qkv_hidden_size},
           {"model.vision.intermediate_size", v.intermediate_size},
           {"model.vision.merge_size", v.merge_size}}) {
    r.positive(key, value);
  }
  r.positive("model.vision.norm_eps", v.norm_eps);
  r.positive("model.vision.projector_eps", v.projector_eps);
  r.one_of("model.vision.projector_train", v.projector_train, {"full", "lora", "frozen"});
  if (r.known({"model.vision.qkv_hidden_size", "model.vision.num_heads"}) && v.num_heads > 0 &&
      (v.qkv_hidden_size % v.num_heads != 0 || (v.qkv_hidden_size / v.num_heads) % 4 != 0)) {
    r.fail({"model.vision.qkv_hidden_size", "model.vision.num_heads"},
           "`model.vision.qkv_hidden_size` = " + show(v.qkv_hidden_size) + " over `model.vision.num_heads` = " +
               show(v.num_heads) + " must give a whole head_dim that is a multiple of 4 (the 2-D RoPE rotates "
               "column and row pairs in turn; Kimi K3: 1536 / 12 = 128)");
  }
  if (r.known({"model.vision.placeholder_token_id", "model.vocab_size"}) &&
      (v.placeholder_token_id < 0 || v.placeholder_token_id >= m.vocab_size)) {
    r.fail({"model.vision.placeholder_token_id", "model.vocab_size"},
           "`model.vision.placeholder_token_id` = " + show(v.placeholder_token_id) +
               " must be a token id below `model.vocab_size` = " + show(m.vocab_size) +
               " (Kimi K3: media_placeholder_token_id 163605)");
  }
}

void check_model(const ModelConfig& m, Rules& r) {
  if (m.hf_dir) r.not_empty("model.hf_dir", *m.hf_dir);
  r.one_of("model.model_type", m.model_type, kModelTypes);
  // One token: every target is that token, so there is nothing to learn (and no synthetic data).
  r.at_least<int64_t>("model.vocab_size", m.vocab_size, 2, ": a language model needs at least two tokens");
  r.positive("model.hidden_size", m.hidden_size);
  r.positive("model.num_layers", m.num_layers);
  r.positive("model.intermediate_size", m.intermediate_size);
  r.at_least<int64_t>("model.first_k_dense", m.first_k_dense, 0);
  r.positive("model.rms_norm_eps", m.rms_norm_eps);
  r.positive("model.max_position_embeddings", m.max_position_embeddings);
  r.one_of("model.attention_gate", m.attention_gate, kAttentionGates);
  r.one_of("model.hidden_act", m.hidden_act, kHiddenActs);
  r.positive("model.situ_beta", m.situ_beta);
  r.non_negative("model.situ_linear_beta", m.situ_linear_beta);
  r.at_least<int64_t>("model.attn_res_block_size", m.attn_res_block_size, 0);
  // A mix takes the summaries and the running sum: at most kernels/ops.h's kMaxAttnResValues (32).
  if (r.known({"model.attn_res_block_size", "model.num_layers"}) && m.attn_res_block_size > 0 &&
      (m.num_layers + m.attn_res_block_size - 1) / m.attn_res_block_size + 1 > 32) {
    r.fail({"model.attn_res_block_size", "model.num_layers"},
           "`model.attn_res_block_size` = " + std::to_string(m.attn_res_block_size) + " makes more than 31 residual "
           "blocks of the " + std::to_string(m.num_layers) + " layers (the depth mix takes at most 32 values): raise "
           "it (Kimi K3 uses 12)");
  }
  for (size_t i = 0; i < m.layers.size(); ++i) {
    r.one_of("model.layers[" + std::to_string(i) + "]", m.layers[i], kMixers);
  }
  if (!m.layers.empty() && r.known({"model.layers", "model.num_layers"}) &&
      static_cast<int64_t>(m.layers.size()) != m.num_layers) {
    r.fail({"model.layers", "model.num_layers"},
           "`model.layers` lists " + std::to_string(m.layers.size()) + " mixers but `model.num_layers` = " +
               show(m.num_layers) + ": give one entry per layer, or leave layers out (all mla)");
  }
  if (r.known({"model.first_k_dense", "model.num_layers"}) && m.first_k_dense > m.num_layers) {
    r.fail({"model.first_k_dense", "model.num_layers"},
           "`model.first_k_dense` = " + show(m.first_k_dense) + " must be <= `model.num_layers` = " +
               show(m.num_layers));
  }
  check_model_limits(m, r);
  check_mla(m.mla, r);
  check_kda(m.kda, r);
  check_dsa(m, r);
  check_moe(m.moe, r);
  check_expert_format(m, r);
  check_vision(m, r);
  check_weight_format(m, r);
}

void check_lora(const LoraConfig& l, Rules& r) {
  r.positive("lora.rank", l.rank);
  r.positive("lora.alpha", l.alpha);
  if (l.targets.empty()) {
    r.fail({"lora.targets"}, "`lora.targets` is empty: name at least one module, from " + join(kLoraTargets, " | "));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < l.targets.size(); ++i) {
    std::string key = "lora.targets[" + std::to_string(i) + "]";
    r.one_of(key, l.targets[i], kLoraTargets);
    if (!seen.insert(l.targets[i]).second) r.fail({key}, "`" + key + "` = `" + l.targets[i] + "` is listed twice");
  }
  r.one_of("lora.expert_gate_up", l.expert_gate_up, kExpertGateUp);
  r.one_of("lora.expert_a", l.expert_a, kExpertA);
  auto check_key = [&](const char* map, const std::string& key) {
    const std::string problem = lora_pattern_problem(key);
    if (!problem.empty()) r.fail({map}, "`" + std::string(map) + "[\"" + key + "\"]`: " + problem);
  };
  for (const auto& [key, rank] : l.rank_pattern) {
    check_key("lora.rank_pattern", key);
    if (rank <= 0) r.fail({"lora.rank_pattern"}, "`lora.rank_pattern[\"" + key + "\"]` = " + show(rank) + " must be > 0");
  }
  for (const auto& [key, alpha] : l.alpha_pattern) {
    check_key("lora.alpha_pattern", key);
    if (!(alpha > 0)) {
      r.fail({"lora.alpha_pattern"}, "`lora.alpha_pattern[\"" + key + "\"]` = " + show(alpha) + " must be > 0");
    }
  }
}

// checkpoint.export_adapter is true, false or a directory, and a word that reads as a boolean
// is never taken for a directory's name: the booleans' rule (config_reader.h boolean_word) says
// which words are true and false and which are refused; none and null, and a bare number, are
// refused too (a directory of such a name is written ./off, ./none, ./3).
void check_export_adapter(const std::string& value, Rules& r) {
  const BooleanWord word = boolean_word(value);
  if (word == BooleanWord::kTrue || word == BooleanWord::kFalse || value.empty()) return;
  static const std::set<std::string> nulls = {"none", "None", "NONE", "null", "Null", "NULL", "~"};
  char* end = nullptr;
  std::strtod(value.c_str(), &end);
  const bool number = std::strchr("0123456789+-.", value[0]) != nullptr && end == value.c_str() + value.size();
  if (word == BooleanWord::kAmbiguous || nulls.count(value) || number) {
    r.fail({"checkpoint.export_adapter"},
           "`checkpoint.export_adapter` = `" + value + "` is ambiguous: write false (no export), true (the adapter "
           "in <run_dir>/adapter) or a directory (./" + value + " for a directory of that name)");
    return;
  }
  if (value.find_first_of(std::string("\n\r\t\0", 4)) != std::string::npos) {
    r.fail({"checkpoint.export_adapter"},
           "`checkpoint.export_adapter` holds a control character: write a directory path, true or false");
  }
}

void check_parallel(const Config& c, Rules& r) {
  const ParallelConfig& p = c.parallel;
  r.positive("parallel.fsdp", p.fsdp);
  r.positive("parallel.ep", p.ep);
  r.positive("parallel.cp", p.cp);
  const int64_t tokens = c.data.seq_len * c.data.micro_batch;
  if (p.cp > 1 && c.data.seq_len > 0 && c.data.micro_batch > 0 && tokens % p.cp != 0) {
    r.fail({"parallel.cp", "data.seq_len", "data.micro_batch"},
           "`parallel.cp` = " + show(p.cp) + " must divide a micro-batch's tokens, `data.seq_len` x " +
               "`data.micro_batch` = " + show(tokens) + " (each rank of a context-parallel group holds an equal " +
               "contiguous shard): make data.seq_len a multiple of " + show(p.cp));
  }
  r.one_of("parallel.cp_layout", p.cp_layout, {"balanced", "contiguous"});
  if (p.cp > 1 && p.cp_layout == "balanced" && c.data.seq_len > 0 && c.data.seq_len % (2 * p.cp) != 0) {
    r.fail({"parallel.cp_layout", "data.seq_len", "parallel.cp"},
           "`parallel.cp_layout` = `balanced` cuts each window of `data.seq_len` = " + show(c.data.seq_len) +
               " tokens into 2 x `parallel.cp` = " + show(2 * p.cp) + " equal chunks: make data.seq_len a multiple of " +
               show(2 * p.cp) + ", or set parallel.cp_layout: contiguous");
  }
  r.at_least<int64_t>("parallel.prefetch", p.prefetch, 0);
  r.at_least<int64_t>("parallel.ffn_chunk_tokens", p.ffn_chunk_tokens, 0);
  r.at_least<int64_t>("parallel.cp_key_chunk", p.cp_key_chunk, 0);
  r.at_least<int64_t>("parallel.attention_query_block", p.attention_query_block, 0);
  if (p.ffn_chunk_tokens > 0 && c.model.moe.aux_loss_coef > 0.0) {
    r.fail({"parallel.ffn_chunk_tokens", "model.moe.aux_loss_coef"},
           "`parallel.ffn_chunk_tokens` = " + show(p.ffn_chunk_tokens) + " cannot run with `model.moe.aux_loss_coef` = " +
               show(c.model.moe.aux_loss_coef) + ": the aux loss needs every token's routing of the micro-batch at " +
               "once; set one of them to 0");
  }
  r.at_least<int64_t>("parallel.mixer_segment_tokens", p.mixer_segment_tokens, 0);
  if (p.mixer_segment_tokens > 0 && p.mixer_segment_tokens % 64 != 0) {
    r.fail({"parallel.mixer_segment_tokens"},
           "`parallel.mixer_segment_tokens` = " + show(p.mixer_segment_tokens) + " must be a multiple of 64 (KDA's " +
               "chunk, so that segments cut where the chunks do): try " + show((p.mixer_segment_tokens / 64 + 1) * 64));
  }
  if (p.mixer_segment_tokens > 0 && p.cp > 1) {
    r.fail({"parallel.mixer_segment_tokens", "parallel.cp"},
           "`parallel.mixer_segment_tokens` = " + show(p.mixer_segment_tokens) + " cannot run with `parallel.cp` = " +
               show(p.cp) + ": a context-parallel shard's KDA takes its state from the other ranks; set one of " +
               "them to 0 / 1");
  }
  r.at_least<double>("parallel.timeout_s", p.timeout_s, 0.0);
  if (p.recompute_layers != -1) {
    if (!p.recompute) {
      r.fail({"parallel.recompute_layers", "parallel.recompute"},
             "`parallel.recompute_layers` = " + show(p.recompute_layers) +
                 " needs `parallel.recompute: true` (it chooses how many of the layers re-run their forward)");
    } else if (p.recompute_layers < 0 ||
               (r.known({"model.num_layers"}) && p.recompute_layers > c.model.num_layers)) {
      r.fail({"parallel.recompute_layers", "model.num_layers"},
             "`parallel.recompute_layers` = " + show(p.recompute_layers) + " must be -1 (every layer) or 0 .. " +
                 "`model.num_layers` = " + show(c.model.num_layers));
    }
  }
  if (p.ep > 0 && r.known({"model.moe.num_experts"}) && c.model.moe.num_experts > 0 && p.ep > c.model.moe.num_experts) {
    r.fail({"parallel.ep", "model.moe.num_experts"},
           "`parallel.ep` = " + show(p.ep) + " must be <= `model.moe.num_experts` = " +
               show(c.model.moe.num_experts) + ": every expert-parallel rank needs at least one expert");
  }
}

// data.source and data.eval.source take the same forms.
void check_data_source(const std::string& key, const std::string& source, const std::vector<DataSourceSpec>& mixture,
                     Rules& r) {
  if (source == kDataSourceMixture && mixture.empty()) {
    r.fail({key}, "`" + key + "` = `mixture` needs the list form: source: [{path: dir/a, weight: 2}, "
                  "{path: dir/b, weight: 1}] (a dataset named `mixture` is written ./mixture)");
  }
  if (!mixture.empty() && source != kDataSourceMixture) {
    r.fail({key}, "`" + key + "` = `" + source + "` while a mixture list is set: use one or the other");
  }
  for (size_t i = 0; i < mixture.size(); ++i) {
    const std::string entry = key + "[" + std::to_string(i) + "]";
    if (mixture[i].path.empty()) r.fail({key}, "`" + entry + ".path` must not be empty");
    if (mixture[i].path == "synthetic") {
      r.fail({key}, "`" + entry + ".path` = `synthetic`: the built-in data cannot be mixed with datasets "
                    "(a dataset named `synthetic` is written ./synthetic)");
    }
    if (!(mixture[i].weight > 0)) {
      r.fail({key}, "`" + entry + ".weight` = " + show(mixture[i].weight) + " must be > 0");
    }
  }
}

void check_data(const Config& c, Rules& r) {
  const DataConfig& d = c.data;
  r.not_empty("data.source", d.source);
  check_data_source("data.source", d.source, d.mixture, r);
  const EvalDataConfig& e = d.eval;
  check_data_source("data.eval.source", e.source, e.mixture, r);
  r.in_range("data.eval.holdout", e.holdout, 0.0, 1.0, false);
  r.at_least<int64_t>("data.eval.windows", e.windows, 0);
  if (!e.source.empty() && e.holdout > 0) {
    r.fail({"data.eval.source", "data.eval.holdout"},
           "`data.eval.source` and `data.eval.holdout` are both set: evaluate on a separate dataset or on a held-out "
           "fraction of the training data, not both");
  }
  if (e.holdout > 0 && d.source == "synthetic") {
    r.fail({"data.eval.holdout", "data.source"},
           "`data.eval.holdout` holds out documents of a dataset, but `data.source` is the endless synthetic stream: "
           "use `data.eval: {source: synthetic, windows: N}` (windows training never reaches)");
  }
  if (e.source == "synthetic" && d.source != "synthetic") {
    r.fail({"data.eval.source", "data.source"},
           "`data.eval.source` = `synthetic` evaluates the built-in Markov chain, but the model trains on `" +
               d.source + "`: give an eval dataset prefix, or `data.eval.holdout`");
  }
  if (e.source == "synthetic" && e.windows == 0) {
    r.fail({"data.eval.windows", "data.eval.source"},
           "`data.eval.source` = `synthetic` is endless: set `data.eval.windows` (e.g. 16) to say how many windows "
           "each evaluation reads");
  }
  r.at_least<int64_t>("data.seq_len", d.seq_len, 2, ": next-token prediction needs two tokens");
  r.positive("data.micro_batch", d.micro_batch);
  r.positive("data.grad_accum", d.grad_accum);
  r.at_least<int64_t>("data.seed", d.seed, 0);
  if (r.known({"model.max_position_embeddings"}) && d.seq_len > c.model.max_position_embeddings) {
    r.fail({"data.seq_len", "model.max_position_embeddings"},
           "`data.seq_len` = " + show(d.seq_len) + " is longer than `model.max_position_embeddings` = " +
               show(c.model.max_position_embeddings) + ": shorten the windows or raise the model's limit");
  }
}

void check_train(const Config& c, Rules& r) {
  const TrainConfig& t = c.train;
  r.positive("train.steps", t.steps);
  r.positive("train.lr", t.lr);
  r.at_least<int64_t>("train.warmup_steps", t.warmup_steps, 0);
  if (t.warmup_steps > t.steps) {
    r.fail({"train.warmup_steps", "train.steps"}, "`train.warmup_steps` = " + show(t.warmup_steps) +
                                                      " must be <= `train.steps` = " + show(t.steps));
  }
  r.one_of("train.schedule", t.schedule, kSchedules);
  r.in_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0, true);
  r.non_negative("train.weight_decay", t.weight_decay);
  r.in_range("train.beta1", t.beta1, 0.0, 1.0, false);
  r.in_range("train.beta2", t.beta2, 0.0, 1.0, false);
  r.positive("train.eps", t.eps);
  r.non_negative("train.grad_clip", t.grad_clip);
  r.at_least<int64_t>("train.seed", t.seed, 0);
  r.at_least<int64_t>("train.eval_every", t.eval_every, 0);
  if (t.eval_every > 0 && !c.data.eval.enabled()) {
    r.fail({"train.eval_every", "data.eval"},
           "`train.eval_every` = " + show(t.eval_every) + " but no eval data is set: add `data.eval.source` (a "
           "dataset prefix) or `data.eval.holdout` (a fraction of the training documents), or drop train.eval_every");
  }
  r.one_of("train.device", t.device, kDevices);
  r.at_least<int64_t>("train.expert_window", t.expert_window, 0);
  if (t.expert_window > c.data.grad_accum) {
    r.fail({"train.expert_window", "data.grad_accum"},
           "`train.expert_window` = " + show(t.expert_window) + " is more than the step's `data.grad_accum` = " +
               show(c.data.grad_accum) + " micro-batches: lower the window or raise grad_accum");
  }
  if (t.expert_window > 1 && c.parallel.cp > 1) {
    r.fail({"train.expert_window", "parallel.cp"},
           "`train.expert_window` = " + show(t.expert_window) + " cannot run with `parallel.cp` = " +
               show(c.parallel.cp) + ": a context-parallel shard's cut is its own micro-batch's; set one of them to 1");
  }
}

void check_checkpoint(const Config& c, Rules& r) {
  const CheckpointConfig& k = c.checkpoint;
  if (k.dir) r.not_empty("checkpoint.dir", *k.dir);
  r.at_least<int64_t>("checkpoint.every", k.every, 0);
  r.positive("checkpoint.keep_last", k.keep_last);
  if (k.every > 0 && k.keep_last < 2) {
    r.fail({"checkpoint.keep_last", "checkpoint.every"},
           "`checkpoint.keep_last` = " + show(k.keep_last) +
               " must be >= 2 when `checkpoint.every` > 0: the previous checkpoint must survive until the "
               "next one is complete");
  }
  r.not_empty("checkpoint.resume", k.resume);
  r.not_empty("checkpoint.export_adapter", k.export_adapter);
  check_export_adapter(k.export_adapter, r);
  r.one_of("checkpoint.export_layout", k.export_layout, kExportLayouts);
  if ((k.export_layout == "per_expert" || k.export_layout == "released") && c.lora.expert_gate_up == "fused") {
    r.fail({"checkpoint.export_layout", "lora.expert_gate_up"},
           "`checkpoint.export_layout` = `" + k.export_layout + "` cannot hold `lora.expert_gate_up` = `fused`: its "
           "per-expert gate and up keys have no place for one adapter shared by gate and up; use export_layout "
           "transformers5 (PEFT's fused gate_up_proj adapter)");
  }
  if (k.init_adapter) r.not_empty("checkpoint.init_adapter", *k.init_adapter);
}

// The run's own sections: parallel, data, train, checkpoint and logging.
void check_training(const Config& c, Rules& r) {
  check_parallel(c, r);
  check_data(c, r);
  check_train(c, r);
  check_checkpoint(c, r);
  const LoggingConfig& g = c.logging;
  r.not_empty("logging.run_dir", g.run_dir);
  r.positive("logging.every", g.every);
  r.one_of("logging.level", g.level, kLogLevels);
}

}  // namespace

void check_rules(const Config& config, const RuleContext& context, std::vector<Problem>* problems) {
  Rules rules(context, problems);
  check_required(config, context, rules);
  check_model(config.model, rules);
  check_lora(config.lora, rules);
  check_training(config, rules);
}

}  // namespace moetrain::config_detail
