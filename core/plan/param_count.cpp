#include "core/plan/param_count.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/base/error.h"
#include "core/config/lora_patterns.h"

namespace moetrain {
namespace {

// The sigmoid output gate's g_proj on MLA and DSA layers: D -> its outputs.
int64_t attention_gate_outputs(const ModelConfig& m) {
  if (m.attention_gate == "headwise") return m.mla.num_heads;
  if (m.attention_gate == "elementwise") return m.mla.num_heads * m.mla.v_head_dim;
  return 0;
}

// MLA as core/model/mla_projections.cpp builds it: q (direct, or q_a -> norm -> q_b), kv_a_proj_with_mqa,
// kv_a norm, kv_b_proj, o_proj.
int64_t mla_weights(const ModelConfig& m) {
  const MlaConfig& a = m.mla;
  const int64_t d = m.hidden_size;
  const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  int64_t n = 0;
  if (a.q_lora_rank) {
    n += *a.q_lora_rank * d + a.num_heads * qk * *a.q_lora_rank + *a.q_lora_rank;
  } else {
    n += a.num_heads * qk * d;
  }
  n += (a.kv_lora_rank + a.qk_rope_head_dim) * d + a.kv_lora_rank;
  n += a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank;
  n += d * a.num_heads * a.v_head_dim;
  return n;
}


// KDA as core/model/kda.cpp builds it, with H heads of d (c = H d): q/k/v projections (or one
// qkv_proj) and their depthwise convs [c, W], the forget gate f_a [d, D] f_b [c, d], A_log [H],
// dt_bias [c], beta b_proj [H, D], the output gate g_a [d, D] g_b [c, d] (or g_proj [c, D]), the
// head-wise output norm [d], o_proj [D, c].
int64_t kda_weights(const ModelConfig& m) {
  const KdaConfig& k = m.kda;
  const int64_t d_model = m.hidden_size;
  const int64_t d = k.head_dim;
  const int64_t c = k.num_heads * d;
  const int64_t output_gate = k.full_rank_output_gate ? c * d_model : d * d_model + c * d;
  return 3 * c * d_model + 3 * c * k.conv_width + (d * d_model + c * d) + k.num_heads + c + k.num_heads * d_model +
         output_gate + d + d_model * c;
}

// DSA's lightning indexer on top of MLA, as core/model/dsa_indexer.cpp builds it: wq_b
// [Hi di, q_lora_rank], wk [di, D], its LayerNorm (weight + bias) and weights_proj [Hi, D].
int64_t dsa_indexer_weights(const ModelConfig& m) {
  const int64_t hi = m.dsa.index_n_heads;
  const int64_t di = m.dsa.index_head_dim;
  return hi * di * m.mla.q_lora_rank.value_or(0) + di * m.hidden_size + 2 * di + hi * m.hidden_size;
}

int64_t swiglu_weights(int64_t hidden, int64_t width) { return 3 * hidden * width; }

int64_t blocks_of(int64_t extent) { return (extent + 127) / 128; }

// FP8 matrices of a layer (core/model/fp8_storage.h): elements and 128 x 128 blocks.
struct Fp8Matrices {
  int64_t elements = 0, blocks = 0;
  void add(int64_t rows, int64_t cols, int64_t count = 1) {
    elements += count * rows * cols;
    blocks += count * blocks_of(rows) * blocks_of(cols);
  }
  // A SwiGLU network [2F, D] + [D, F]; FP8 only when gate over up stacks in whole blocks (as
  // core/model/fp8_storage.h fp8_stacks decides).
  void add_swiglu(int64_t hidden, int64_t width, int64_t count = 1) {
    if (width % 128 != 0) return;
    add(2 * width, hidden, count);
    add(hidden, width, count);
  }
};

// The MLA / DSA projections weight_format fp8 keeps in FP8 (DSA's kv_b_proj only when its heads'
// key and value rows start whole blocks, as DsaAttention decides).
Fp8Matrices fp8_attention(const ModelConfig& m, bool dsa) {
  const MlaConfig& a = m.mla;
  const int64_t d = m.hidden_size, qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  Fp8Matrices f;
  if (a.q_lora_rank) {
    f.add(*a.q_lora_rank, d);
    f.add(a.num_heads * qk, *a.q_lora_rank);
  } else {
    f.add(a.num_heads * qk, d);
  }
  f.add(a.kv_lora_rank + a.qk_rope_head_dim, d);
  if (!dsa || (a.qk_nope_head_dim % 128 == 0 && a.v_head_dim % 128 == 0)) {
    f.add(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank);
  }
  f.add(d, a.num_heads * a.v_head_dim);
  if (attention_gate_outputs(m) > 0) f.add(attention_gate_outputs(m), d);
  if (dsa) {
    f.add(m.dsa.index_n_heads * m.dsa.index_head_dim, a.q_lora_rank.value_or(0));
    f.add(m.dsa.index_head_dim, d);
  }
  return f;
}

int64_t lora_pair(int64_t rank, int64_t in, int64_t out) { return rank * (in + out); }

// One group's packed adapters of a SwiGLU network (SwigluExperts::pack_lora): gate_up's A
// [R, rows] and block-diagonal B [2F, R] with R = the gate and up ranks together; down's A
// [r, F] and B [rows, r].
int64_t packed_swiglu(int64_t gate_up_rank, int64_t down_rank, int64_t rows, int64_t width) {
  return gate_up_rank * (rows + 2 * width) + down_rank * (width + rows);
}

}  // namespace

int64_t ModelParameterCount::non_expert() const {
  int64_t n = embedding + lm_head + final_norm;
  for (const LayerParameterCount& l : layers) n += l.non_expert();
  return n;
}

int64_t ModelParameterCount::routed_experts() const {
  int64_t n = 0;
  for (const LayerParameterCount& l : layers) n += l.routed_experts;
  return n;
}

int64_t ModelParameterCount::routed_expert_per_layer() const {
  for (const LayerParameterCount& l : layers) {
    if (l.routed_experts > 0) return l.routed_experts;
  }
  return 0;
}

int64_t LoraParameterCount::non_expert() const {
  int64_t n = vision_projector;
  for (int64_t l : layer_non_expert) n += l;
  return n;
}

int64_t LoraParameterCount::routed_experts() const {
  int64_t n = 0;
  for (int64_t l : layer_routed_expert) n += l;
  return n;
}

ModelSpec plan_model_spec(const ModelConfig& model) {
  ModelSpec spec;
  spec.config = model;
  std::vector<std::string>& layers = spec.config.layers;
  if (layers.empty()) layers.assign(static_cast<size_t>(model.num_layers), "mla");
  MOETRAIN_CHECK(static_cast<int64_t>(layers.size()) == model.num_layers, ExitCode::kBadConfig,
                 fmt::format("model.layers has {} entries but model.num_layers is {}", layers.size(),
                             model.num_layers));
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string& kind = layers[i];
    MOETRAIN_CHECK(kind == "mla" || kind == "kda" || kind == "dsa", ExitCode::kBadConfig,
                   fmt::format("model.layers[{}] is \"{}\"; expected mla, kda or dsa", i, kind));
    spec.mixers.push_back(kind == "mla" ? MixerKind::kMla : kind == "kda" ? MixerKind::kKda : MixerKind::kDsa);
    spec.ffns.push_back(static_cast<int64_t>(i) < model.first_k_dense ? FfnKind::kDense : FfnKind::kMoe);
  }
  return spec;
}

ModelParameterCount count_model_parameters(const ModelSpec& spec) {
  const ModelConfig& m = spec.config;
  const int64_t d = m.hidden_size;
  const MoeConfig& moe = m.moe;
  ModelParameterCount count;
  count.embedding = m.vocab_size * d;
  count.lm_head = m.tie_word_embeddings ? 0 : m.vocab_size * d;
  // Block Attention Residuals: each depth mix has a norm weight and a query [D] (two per layer,
  // one for the final norm's input).
  const int64_t mix = m.attn_res_block_size > 0 ? 2 * d : 0;
  count.final_norm = d + mix;
  for (size_t i = 0; i < spec.mixers.size(); ++i) {
    LayerParameterCount layer;
    layer.mixer_kind = spec.mixers[i];
    layer.ffn_kind = spec.ffns[i];
    layer.norms = 2 * d + 2 * mix;
    Fp8Matrices fp8;
    if (layer.mixer_kind == MixerKind::kKda) {
      layer.mixer = kda_weights(m);
    } else {
      layer.mixer = mla_weights(m) + attention_gate_outputs(m) * d;
      if (spec.mixers[i] == MixerKind::kDsa) layer.mixer += dsa_indexer_weights(m);
      fp8 = fp8_attention(m, spec.mixers[i] == MixerKind::kDsa);
    }
    if (layer.ffn_kind == FfnKind::kDense) {
      layer.dense_ffn = swiglu_weights(d, m.intermediate_size);
      fp8.add_swiglu(d, m.intermediate_size);
    } else {
      layer.router = moe.num_experts * d + (moe.score_correction_bias ? moe.num_experts : 0);
      layer.dense_ffn = swiglu_weights(d, moe.expert_intermediate_size * moe.num_shared_experts);
      // Latent MoE (K3): the routed experts run at the latent width L between a down- and an
      // up-projection (frozen, counted with the shared experts) and an optional norm [L].
      const int64_t latent = moe.latent_size;
      if (latent > 0) layer.dense_ffn += 2 * latent * d + (moe.use_latent_norm ? latent : 0);
      layer.routed_experts =
          moe.num_experts * swiglu_weights(latent > 0 ? latent : d, moe.expert_intermediate_size);
      if (moe.num_shared_experts > 0) fp8.add_swiglu(d, moe.expert_intermediate_size * moe.num_shared_experts);
      Fp8Matrices routed;
      routed.add_swiglu(latent > 0 ? latent : d, moe.expert_intermediate_size, moe.num_experts);
      layer.fp8_routed_expert_blocks = routed.blocks;
    }
    layer.fp8_non_expert = fp8.elements;
    layer.fp8_non_expert_blocks = fp8.blocks;
    count.layers.push_back(layer);
  }
  if (m.vision.enabled) {
    const VisionConfig& v = m.vision;
    const int64_t h = v.hidden_size, merged = v.merge_size * v.merge_size * h;
    const int64_t block = 2 * h + h * 3 * v.qkv_hidden_size + v.qkv_hidden_size * h + 2 * h * v.intermediate_size;
    count.vision_tower = h * 3 * v.patch_size * v.patch_size + v.pos_emb_height * v.pos_emb_width * h +
                         v.num_layers * block + h;
    count.projector = merged * merged + d * merged + d;
  }
  return count;
}

namespace {

// What count_lora walks besides the counts: the targets this model has, and the adapted modules
// (layer numbers as <L>) in the order Model::attach_lora lists them in its messages: the linear
// projections (attention, the latent MoE's) of every layer first, then the MLPs'.
struct LoraModules {
  std::set<std::string> available_targets;
  std::vector<std::string> linear, mlp;
  void adapt(const std::string& module) {
    const size_t layer = std::string("model.layers.").size();
    const std::string named = module.substr(0, layer) + "<L>" + module.substr(module.find('.', layer));
    const bool is_linear = named.find(".self_attn.") != std::string::npos ||
                           named.find(".mlp.routed_expert_") != std::string::npos;
    std::vector<std::string>& list = is_linear ? linear : mlp;
    if (std::find(list.begin(), list.end(), named) == list.end()) list.push_back(named);
  }
  std::vector<std::string> adapted() const {
    std::vector<std::string> all = linear;
    all.insert(all.end(), mlp.begin(), mlp.end());
    return all;
  }
};

// Walks the model's layers as Model::attach_lora does, counting each adapted module's parameters
// at its rank and recording the modules and targets met.
class LoraCounter {
 public:
  LoraCounter(const ModelSpec& spec, const LoraConfig& lora, LoraRanks& ranks, LoraModules& modules)
      : spec_(spec), m_(spec.config), lora_(lora), ranks_(ranks), modules_(modules),
        targets_(lora.targets.begin(), lora.targets.end()) {}

  LoraParameterCount count() {
    for (size_t i = 0; i < spec_.mixers.size(); ++i) {
      const std::string layer = "model.layers." + std::to_string(i);
      int64_t n = spec_.mixers[i] == MixerKind::kKda ? kda_adapters(layer) : mla_adapters(layer);
      int64_t routed = 0;
      if (spec_.ffns[i] == FfnKind::kDense) {
        n += swiglu(layer + ".mlp", m_.intermediate_size, nullptr, m_.hidden_size);
      } else {
        moe_adapters(layer, n, routed);
      }
      count_.layer_non_expert.push_back(n);
      count_.layer_routed_expert.push_back(routed);
    }
    return count_;
  }

 private:
  bool on(const char* name) const { return targets_.count(name) > 0; }

  // Each adapted module's rank, by its name in the model (core/model).
  int64_t rank_of(const std::string& module) {
    modules_.adapt(module);
    return ranks_.module(module).rank;
  }

  // One adapter on `module` (in -> out).
  int64_t pair(const std::string& module, int64_t in, int64_t out) { return lora_pair(rank_of(module), in, out); }

  // The adapter on an attention projection `name` of `layer` when it is a LoRA target.
  int64_t attention(const std::string& layer, const char* name, int64_t in, int64_t out) {
    modules_.available_targets.insert(name);
    return on(name) ? pair(layer + ".self_attn." + name, in, out) : 0;
  }

  // A SwiGLU block's adapters (gate, up: rows -> F; down: F -> rows) on `prefix`; `group` is
  // the target naming all three (shared_experts), if any.
  int64_t swiglu(const std::string& prefix, int64_t width, const char* group, int64_t rows) {
    for (const char* name : {"gate_proj", "up_proj", "down_proj"}) modules_.available_targets.insert(name);
    if (group) modules_.available_targets.insert(group);
    const bool all = group && on(group);
    const int64_t gate = all || on("gate_proj") ? rank_of(prefix + ".gate_proj") : 0;
    const int64_t up = all || on("up_proj") ? rank_of(prefix + ".up_proj") : 0;
    const int64_t down = all || on("down_proj") ? rank_of(prefix + ".down_proj") : 0;
    count_.packed_replicated += packed_swiglu(gate + up, down, rows, width);
    return lora_pair(gate, rows, width) + lora_pair(up, rows, width) + lora_pair(down, width, rows);
  }

  int64_t kda_adapters(const std::string& layer) {
    const int64_t d = m_.hidden_size;
    const KdaConfig& k = m_.kda;
    const int64_t c = k.num_heads * k.head_dim;
    int64_t n = 0;
    if (k.fused_qkv) {
      n += attention(layer, "qkv_proj", d, 3 * c);
    } else {
      for (const char* name : {"q_proj", "k_proj", "v_proj"}) n += attention(layer, name, d, c);
    }
    n += attention(layer, "f_a_proj", d, k.head_dim);
    n += attention(layer, "f_b_proj", k.head_dim, c);
    n += attention(layer, "b_proj", d, k.num_heads);
    if (k.full_rank_output_gate) {
      n += attention(layer, "g_proj", d, c);
    } else {
      n += attention(layer, "g_a_proj", d, k.head_dim);
      n += attention(layer, "g_b_proj", k.head_dim, c);
    }
    n += attention(layer, "o_proj", c, d);
    return n;
  }

  // MLA and DSA layers: the same projections.
  int64_t mla_adapters(const std::string& layer) {
    const int64_t d = m_.hidden_size;
    const MlaConfig& a = m_.mla;
    const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
    int64_t n = 0;
    if (a.q_lora_rank) {
      n += attention(layer, "q_a_proj", d, *a.q_lora_rank);
      n += attention(layer, "q_b_proj", *a.q_lora_rank, a.num_heads * qk);
    } else {
      n += attention(layer, "q_proj", d, a.num_heads * qk);
    }
    n += attention(layer, "kv_a_proj_with_mqa", d, a.kv_lora_rank + a.qk_rope_head_dim);
    n += attention(layer, "kv_b_proj", a.kv_lora_rank, a.num_heads * (a.qk_nope_head_dim + a.v_head_dim));
    if (attention_gate_outputs(m_) > 0) n += attention(layer, "g_proj", d, attention_gate_outputs(m_));
    n += attention(layer, "o_proj", a.num_heads * a.v_head_dim, d);
    return n;
  }

  // An MoE layer: the latent projections, the routed experts' adapters (`routed`; a shared A
  // counts with the replicated `n`), then the shared experts'.
  void moe_adapters(const std::string& layer, int64_t& n, int64_t& routed) {
    const int64_t d = m_.hidden_size;
    ++count_.num_moe_layers;
    const int64_t latent = m_.moe.latent_size;
    if (latent > 0) {
      modules_.available_targets.insert("routed_expert_down_proj");
      modules_.available_targets.insert("routed_expert_up_proj");
    }
    if (latent > 0 && on("routed_expert_down_proj")) n += pair(layer + ".mlp.routed_expert_down_proj", d, latent);
    if (latent > 0 && on("routed_expert_up_proj")) n += pair(layer + ".mlp.routed_expert_up_proj", latent, d);
    modules_.available_targets.insert("experts");
    if (on("experts")) routed_expert_adapters(layer + ".mlp.experts", latent > 0 ? latent : d, n, routed);
    // After the routed experts, as attach_lora visits them (the order of its module list).
    if (m_.moe.num_shared_experts > 0) {
      n += swiglu(layer + ".mlp.shared_experts", m_.moe.expert_intermediate_size * m_.moe.num_shared_experts,
                  "shared_experts", d);
    }
  }

  void routed_expert_adapters(const std::string& experts, int64_t rows, int64_t& n, int64_t& routed) {
    const int64_t f = m_.moe.expert_intermediate_size, e = m_.moe.num_experts;
    const bool shared_a = lora_.expert_a == "shared";
    // Each projection: B per expert; A per expert, or one for all (counted with the replicated).
    auto routed_pair = [&](int64_t rank, int64_t in, int64_t out) {
      routed += e * rank * out;
      if (shared_a) n += rank * in, count_.shared_expert_a += rank * in;
      else routed += e * rank * in;
    };
    // lora.expert_gate_up: fused: one adapter on gate_up (rows -> 2F) instead of gate and up.
    int64_t gate_up_rank = 0;
    if (lora_.expert_gate_up == "fused") {
      modules_.adapt(experts + ".gate_up_proj");
      gate_up_rank = ranks_.fused_gate_up(experts).rank;
      routed_pair(gate_up_rank, rows, 2 * f);
    } else {
      const int64_t gate = rank_of(experts + ".gate_proj"), up = rank_of(experts + ".up_proj");
      routed_pair(gate, rows, f);
      routed_pair(up, rows, f);
      gate_up_rank = gate + up;
    }
    const int64_t down_rank = rank_of(experts + ".down_proj");
    routed_pair(down_rank, f, rows);
    // Packed: the B's per expert; the A's per expert, or once (shared).
    const int64_t packed_a = gate_up_rank * rows + down_rank * f;
    count_.packed_routed_experts += e * (packed_swiglu(gate_up_rank, down_rank, rows, f) - (shared_a ? packed_a : 0));
    if (shared_a) count_.packed_replicated += packed_a;
  }

  const ModelSpec& spec_;
  const ModelConfig& m_;
  const LoraConfig& lora_;
  LoraRanks& ranks_;
  LoraModules& modules_;
  const std::set<std::string> targets_;
  LoraParameterCount count_;
};

LoraParameterCount count_lora(const ModelSpec& spec, const LoraConfig& lora, LoraRanks& ranks, LoraModules& modules) {
  return LoraCounter(spec, lora, ranks, modules).count();
}

}  // namespace

LoraParameterCount count_lora_parameters(const ModelSpec& spec, const LoraConfig& lora) {
  LoraRanks ranks(lora);
  LoraModules modules;
  LoraParameterCount count = count_lora(spec, lora, ranks, modules);
  const VisionConfig& v = spec.config.vision;
  if (v.enabled) {
    const int64_t merged = v.merge_size * v.merge_size * v.hidden_size, d = spec.config.hidden_size;
    if (v.projector_train == "full") count.vision_projector = merged * merged + d * merged + d;
    if (v.projector_train == "lora") count.vision_projector = lora.rank * (merged + merged) + lora.rank * (merged + d);
  }
  return count;
}

void check_lora_modules(const ModelSpec& spec, const LoraConfig& lora) {
  LoraRanks ranks(lora);
  LoraModules modules;
  count_lora(spec, lora, ranks, modules);
  // The messages are Model::attach_lora's, which makes the same checks on the built model.
  for (const std::string& target : lora.targets) {
    MOETRAIN_CHECK(modules.available_targets.count(target), ExitCode::kBadConfig,
                   fmt::format("lora.targets: \"{}\" matches no module of this model; its targets are: {}",
                               target, fmt::join(modules.available_targets, ", ")));
  }
  const std::vector<std::string> unused = ranks.unused_keys();
  MOETRAIN_CHECK(unused.empty(), ExitCode::kBadConfig,
                 fmt::format("{} selects no LoRA adapter of this model (PEFT's rule: a key matches a whole "
                             "dot-separated tail of a module name, as `q_proj` or `experts\\..*` do); its adapted "
                             "modules are {}",
                             fmt::join(unused, ", "), fmt::join(modules.adapted(), ", ")));
}

}  // namespace moetrain
