#include "core/plan/param_count.h"

#include <fmt/format.h>

#include <set>
#include <string>

#include "core/base/error.h"

namespace moetrain {
namespace {

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

// The sigmoid output gate's g_proj on MLA and DSA layers: D -> its outputs.
int64_t attention_gate_outputs(const ModelConfig& m) {
  if (m.attention_gate == "headwise") return m.mla.num_heads;
  if (m.attention_gate == "elementwise") return m.mla.num_heads * m.mla.v_head_dim;
  return 0;
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

int64_t lora_pair(int64_t rank, int64_t in, int64_t out) { return rank * (in + out); }

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
  int64_t n = 0;
  for (int64_t l : layer_non_expert) n += l;
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
    if (layer.mixer_kind == MixerKind::kKda) {
      layer.mixer = kda_weights(m);
    } else {
      layer.mixer = mla_weights(m) + attention_gate_outputs(m) * d;
      if (spec.mixers[i] == MixerKind::kDsa) layer.mixer += dsa_indexer_weights(m);
    }
    if (layer.ffn_kind == FfnKind::kDense) {
      layer.dense_ffn = swiglu_weights(d, m.intermediate_size);
    } else {
      layer.router = moe.num_experts * d + (moe.score_correction_bias ? moe.num_experts : 0);
      layer.dense_ffn = swiglu_weights(d, moe.expert_intermediate_size * moe.num_shared_experts);
      // Latent MoE (K3): the routed experts run at the latent width L between a down- and an
      // up-projection (frozen, counted with the shared experts) and an optional norm [L].
      const int64_t latent = moe.latent_size;
      if (latent > 0) layer.dense_ffn += 2 * latent * d + (moe.use_latent_norm ? latent : 0);
      layer.routed_experts =
          moe.num_experts * swiglu_weights(latent > 0 ? latent : d, moe.expert_intermediate_size);
    }
    count.layers.push_back(layer);
  }
  return count;
}

LoraParameterCount count_lora_parameters(const ModelSpec& spec, const LoraConfig& lora) {
  const ModelConfig& m = spec.config;
  const MlaConfig& a = m.mla;
  const int64_t d = m.hidden_size;
  const int64_t r = lora.rank;
  const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  const std::set<std::string> targets(lora.targets.begin(), lora.targets.end());
  auto on = [&](const char* name) { return targets.count(name) > 0; };
  // A SwiGLU block's adapters (gate, up: rows -> F; down: F -> rows), one group; rows is D, or
  // the latent width for a latent MoE's routed experts.
  auto swiglu = [&](int64_t width, bool all, int64_t rows) {
    int64_t n = 0;
    if (all || on("gate_proj")) n += lora_pair(r, rows, width);
    if (all || on("up_proj")) n += lora_pair(r, rows, width);
    if (all || on("down_proj")) n += lora_pair(r, width, rows);
    return n;
  };
  LoraParameterCount count;
  for (size_t i = 0; i < spec.mixers.size(); ++i) {
    int64_t n = 0;
    if (spec.mixers[i] == MixerKind::kKda) {
      const KdaConfig& k = m.kda;
      const int64_t c = k.num_heads * k.head_dim;
      if (k.fused_qkv) {
        if (on("qkv_proj")) n += lora_pair(r, d, 3 * c);
      } else {
        for (const char* name : {"q_proj", "k_proj", "v_proj"}) n += on(name) ? lora_pair(r, d, c) : 0;
      }
      if (on("f_a_proj")) n += lora_pair(r, d, k.head_dim);
      if (on("f_b_proj")) n += lora_pair(r, k.head_dim, c);
      if (on("b_proj")) n += lora_pair(r, d, k.num_heads);
      if (k.full_rank_output_gate) {
        if (on("g_proj")) n += lora_pair(r, d, c);
      } else {
        if (on("g_a_proj")) n += lora_pair(r, d, k.head_dim);
        if (on("g_b_proj")) n += lora_pair(r, k.head_dim, c);
      }
      if (on("o_proj")) n += lora_pair(r, c, d);
    } else {
      if (a.q_lora_rank) {
        if (on("q_a_proj")) n += lora_pair(r, d, *a.q_lora_rank);
        if (on("q_b_proj")) n += lora_pair(r, *a.q_lora_rank, a.num_heads * qk);
      } else if (on("q_proj")) {
        n += lora_pair(r, d, a.num_heads * qk);
      }
      if (on("kv_a_proj_with_mqa")) n += lora_pair(r, d, a.kv_lora_rank + a.qk_rope_head_dim);
      if (on("kv_b_proj")) n += lora_pair(r, a.kv_lora_rank, a.num_heads * (a.qk_nope_head_dim + a.v_head_dim));
      if (attention_gate_outputs(m) > 0 && on("g_proj")) n += lora_pair(r, d, attention_gate_outputs(m));
      if (on("o_proj")) n += lora_pair(r, a.num_heads * a.v_head_dim, d);
    }
    if (spec.ffns[i] == FfnKind::kDense) {
      n += swiglu(m.intermediate_size, false, d);
    } else {
      ++count.num_moe_layers;
      if (m.moe.num_shared_experts > 0) {
        n += swiglu(m.moe.expert_intermediate_size * m.moe.num_shared_experts, on("shared_experts"), d);
      }
      const int64_t latent = m.moe.latent_size;
      if (latent > 0 && on("routed_expert_down_proj")) n += lora_pair(r, d, latent);
      if (latent > 0 && on("routed_expert_up_proj")) n += lora_pair(r, latent, d);
      if (on("experts")) {
        const int64_t f = m.moe.expert_intermediate_size;
        const int64_t rows = latent > 0 ? latent : d;
        // lora.expert_gate_up: fused: one adapter of rank 2r on gate_up (rows -> 2F) instead of two of rank r.
        const int64_t per_expert = lora.expert_gate_up == "fused"
                                       ? lora_pair(2 * r, rows, 2 * f) + lora_pair(r, f, rows)
                                       : swiglu(f, true, rows);
        count.routed_expert_per_layer = m.moe.num_experts * per_expert;
      }
    }
    count.layer_non_expert.push_back(n);
  }
  return count;
}

}  // namespace moetrain
