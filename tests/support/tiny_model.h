// Tiny hybrid models (MLA, KDA and DSA layers, MoE) and packed batches for whole-model tests.
#pragma once

#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/model/model_spec.h"
#include "core/data/batch.h"

namespace moetrain::testing {

// 3 layers: a dense first layer, then MoE layers with grouped routing and a shared expert;
// the mixers are MLA, KDA, and DSA with q LoRA (its indexer reads the q latent) or MLA without
// (every mixer the model has joins the whole-model tests here). DSA keeps 3 keys per query,
// fewer than most queries of tiny_batch have, so the selection matters.
inline Config tiny_model_config(bool q_lora) {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 37;
  m.hidden_size = 16;
  m.num_layers = 3;
  m.layers = {"mla", "kda", q_lora ? "dsa" : "mla"};
  m.dsa.index_n_heads = 2;
  m.dsa.index_head_dim = 6;
  m.dsa.index_topk = 3;
  m.kda.num_heads = 2;
  m.kda.head_dim = 4;
  m.kda.conv_width = 4;
  m.intermediate_size = 24;
  m.first_k_dense = 1;
  m.max_position_embeddings = 32;
  c.data.seq_len = 8;
  m.mla.num_heads = 2;
  if (q_lora) m.mla.q_lora_rank = 12;
  else m.mla.q_lora_rank.reset();
  m.mla.kv_lora_rank = 8;
  m.mla.qk_nope_head_dim = 6;
  m.mla.qk_rope_head_dim = 4;
  m.mla.v_head_dim = 5;
  m.mla.rope_scaling.type = "yarn";
  m.mla.rope_scaling.factor = 4.0;
  m.mla.rope_scaling.original_max_position_embeddings = 8;
  m.mla.rope_scaling.mscale = 1.0;
  m.mla.rope_scaling.mscale_all_dim = 1.0;
  m.moe.num_experts = 6;
  m.moe.top_k = 2;
  m.moe.num_shared_experts = 1;
  m.moe.expert_intermediate_size = 8;
  m.moe.num_groups = 2;
  m.moe.topk_groups = 1;
  m.moe.routed_scaling_factor = 2.5;
  return c;
}

// Kimi K3's feed-forward form on a tiny_model_config model: SiTU everywhere, and MoE layers
// whose routed experts run in a latent width of 6 (hidden 16) between routed_expert_down_proj
// and routed_expert_up_proj, with or without the latent RMSNorm. The SiTU caps are far below
// K3's (4 and 25) so that the tiny model's small activations reach the tanh's curved part.
inline void set_k3_ffn(ModelConfig& m, bool latent_norm) {
  m.hidden_act = "situ";
  m.situ_beta = 0.5;
  m.situ_linear_beta = 0.3;
  m.moe.latent_size = 6;
  m.moe.use_latent_norm = latent_norm;
}

// tiny_model_config (no q LoRA) in Kimi K3's feed-forward form (set_k3_ffn).
inline Config tiny_k3_ffn_config(bool latent_norm) {
  Config c = tiny_model_config(/*q_lora=*/false);
  set_k3_ffn(c.model, latent_norm);
  return c;
}

// A tiny Kimi K3: tiny_k3_ffn_config with 5 layers (MLA, KDA, MLA, KDA, MLA; the MLA gated per
// channel) and Block Attention Residuals in blocks of `block` layers, so that several blocks
// close (block 2: summaries at layers 0, 2 and 4, and the final mix over 4 values).
inline Config tiny_k3_config(int64_t block) {
  Config c = tiny_k3_ffn_config(/*latent_norm=*/true);
  ModelConfig& m = c.model;
  m.num_layers = 5;
  m.layers = {"mla", "kda", "mla", "kda", "mla"};
  m.attention_gate = "elementwise";
  m.attn_res_block_size = block;
  return c;
}

// Every projection of tiny_model_config's model (q_proj: MLA's without q LoRA, and KDA's).
inline std::vector<std::string> all_lora_targets(bool q_lora) {
  std::vector<std::string> t = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj", "shared_experts", "experts", "q_proj", "k_proj", "v_proj",
                                "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"};
  if (q_lora) {
    t.push_back("q_a_proj");
    t.push_back("q_b_proj");
  }
  return t;
}

// Windows of seq_len tokens holding the documents `cu_seqlens` (global offsets, ending at the
// last window's end), random tokens from `seed`; labels are next tokens within a document, -1
// at each document's end.
inline Batch packed_batch(int64_t vocab, uint64_t seed, int64_t seq_len, std::vector<int32_t> cu_seqlens) {
  Batch b;
  b.seq_len = seq_len;
  b.batch_size = cu_seqlens.back() / seq_len;
  b.cu_seqlens = std::move(cu_seqlens);
  uint64_t state = seed;
  for (int32_t t = 0; t < b.cu_seqlens.back(); ++t) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    b.input_ids.push_back(static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab)));
  }
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
    for (int32_t t = b.cu_seqlens[s]; t < b.cu_seqlens[s + 1]; ++t) {
      b.positions.push_back(t - b.cu_seqlens[s]);
      b.labels.push_back(t + 1 < b.cu_seqlens[s + 1] ? b.input_ids[t + 1] : -1);
    }
  }
  return b;
}

// Two windows of 8 tokens; the first holds documents of 5 and 3 tokens, the second one
// document of 8; one prompt position is masked too.
inline Batch tiny_batch(int64_t vocab, uint64_t seed) {
  Batch b = packed_batch(vocab, seed, 8, {0, 5, 8, 16});
  b.labels[10] = -1;  // a masked prompt token
  return b;
}

}  // namespace moetrain::testing
