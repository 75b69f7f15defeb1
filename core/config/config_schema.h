// The one list of config keys. Reading YAML, applying --set overrides, writing the resolved
// config and comparing two configs all walk the structs through these functions, so a field
// added here is known to all of them at once (and a field missing here is unknown to all of
// them, which the round-trip test notices).
//
// A visitor provides
//   template <class T> void field(const char* key, T& value);   // a leaf
//   template <class S> void section(const char* key, S& value); // a nested struct
// where `section` calls visit_fields(*this, value) when it wants to descend.
// Internal to core/config: not part of the public config.h.
#pragma once

#include "core/config/config.h"

namespace moetrain::config_schema {

template <class V>
void visit_fields(V& v, RopeScalingConfig& c) {
  v.field("type", c.type);
  v.field("factor", c.factor);
  v.field("original_max_position_embeddings", c.original_max_position_embeddings);
  v.field("beta_fast", c.beta_fast);
  v.field("beta_slow", c.beta_slow);
  v.field("mscale", c.mscale);
  v.field("mscale_all_dim", c.mscale_all_dim);
}

template <class V>
void visit_fields(V& v, MlaConfig& c) {
  v.field("num_heads", c.num_heads);
  v.field("q_lora_rank", c.q_lora_rank);
  v.field("kv_lora_rank", c.kv_lora_rank);
  v.field("qk_nope_head_dim", c.qk_nope_head_dim);
  v.field("qk_rope_head_dim", c.qk_rope_head_dim);
  v.field("v_head_dim", c.v_head_dim);
  v.field("use_rope", c.use_rope);
  v.field("rope_theta", c.rope_theta);
  v.section("rope_scaling", c.rope_scaling);
}

template <class V>
void visit_fields(V& v, KdaConfig& c) {
  v.field("num_heads", c.num_heads);
  v.field("head_dim", c.head_dim);
  v.field("conv_width", c.conv_width);
  v.field("lower_bound", c.lower_bound);
  v.field("fused_qkv", c.fused_qkv);
  v.field("full_rank_output_gate", c.full_rank_output_gate);
}

template <class V>
void visit_fields(V& v, DsaConfig& c) {
  v.field("index_n_heads", c.index_n_heads);
  v.field("index_head_dim", c.index_head_dim);
  v.field("index_topk", c.index_topk);
  v.field("indexer_rope_interleave", c.indexer_rope_interleave);
}

template <class V>
void visit_fields(V& v, MoeConfig& c) {
  v.field("num_experts", c.num_experts);
  v.field("top_k", c.top_k);
  v.field("num_shared_experts", c.num_shared_experts);
  v.field("expert_intermediate_size", c.expert_intermediate_size);
  v.field("scoring", c.scoring);
  v.field("num_groups", c.num_groups);
  v.field("topk_groups", c.topk_groups);
  v.field("normalize_topk", c.normalize_topk);
  v.field("routed_scaling_factor", c.routed_scaling_factor);
  v.field("score_correction_bias", c.score_correction_bias);
  v.field("aux_loss_coef", c.aux_loss_coef);
  v.field("aux_loss_type", c.aux_loss_type);
  v.field("router_noise", c.router_noise);
  v.field("bias_update_rate", c.bias_update_rate);
  v.field("latent_size", c.latent_size);
  v.field("use_latent_norm", c.use_latent_norm);
  v.field("expert_format", c.expert_format);
}

template <class V>
void visit_fields(V& v, VisionConfig& c) {
  v.field("enabled", c.enabled);
  v.field("patch_size", c.patch_size);
  v.field("pos_emb_height", c.pos_emb_height);
  v.field("pos_emb_width", c.pos_emb_width);
  v.field("pos_emb_time", c.pos_emb_time);
  v.field("num_layers", c.num_layers);
  v.field("hidden_size", c.hidden_size);
  v.field("num_heads", c.num_heads);
  v.field("qkv_hidden_size", c.qkv_hidden_size);
  v.field("intermediate_size", c.intermediate_size);
  v.field("merge_size", c.merge_size);
  v.field("norm_eps", c.norm_eps);
  v.field("projector_eps", c.projector_eps);
  v.field("placeholder_token_id", c.placeholder_token_id);
  v.field("projector_train", c.projector_train);
}

template <class V>
void visit_fields(V& v, ModelConfig& c) {
  v.field("hf_dir", c.hf_dir);
  v.field("model_type", c.model_type);
  v.field("vocab_size", c.vocab_size);
  v.field("hidden_size", c.hidden_size);
  v.field("num_layers", c.num_layers);
  v.field("layers", c.layers);
  v.field("intermediate_size", c.intermediate_size);
  v.field("first_k_dense", c.first_k_dense);
  v.field("rms_norm_eps", c.rms_norm_eps);
  v.field("tie_word_embeddings", c.tie_word_embeddings);
  v.field("max_position_embeddings", c.max_position_embeddings);
  v.field("attention_gate", c.attention_gate);
  v.field("hidden_act", c.hidden_act);
  v.field("situ_beta", c.situ_beta);
  v.field("situ_linear_beta", c.situ_linear_beta);
  v.field("attn_res_block_size", c.attn_res_block_size);
  v.field("weight_format", c.weight_format);
  v.section("mla", c.mla);
  v.section("kda", c.kda);
  v.section("dsa", c.dsa);
  v.section("moe", c.moe);
  v.section("vision", c.vision);
}

template <class V>
void visit_fields(V& v, LoraConfig& c) {
  v.field("rank", c.rank);
  v.field("alpha", c.alpha);
  v.field("rslora", c.rslora);
  v.field("targets", c.targets);
  v.field("expert_gate_up", c.expert_gate_up);
  v.field("rank_pattern", c.rank_pattern);
  v.field("alpha_pattern", c.alpha_pattern);
  v.field("expert_a", c.expert_a);
}

template <class V>
void visit_fields(V& v, ParallelConfig& c) {
  v.field("fsdp", c.fsdp);
  v.field("ep", c.ep);
  v.field("cp", c.cp);
  v.field("cp_layout", c.cp_layout);
  v.field("prefetch", c.prefetch);
  v.field("recompute", c.recompute);
  v.field("recompute_layers", c.recompute_layers);
  v.field("ffn_chunk_tokens", c.ffn_chunk_tokens);
  v.field("cp_key_chunk", c.cp_key_chunk);
  v.field("attention_query_block", c.attention_query_block);
  v.field("mixer_segment_tokens", c.mixer_segment_tokens);
  v.field("offload", c.offload);
  v.field("reshard_after_forward", c.reshard_after_forward);
  v.field("timeout_s", c.timeout_s);
}

// `data.source` is one key over two fields: a string (synthetic or a path prefix) or a list of
// {path, weight} (source = kDataSourceMixture, the list in mixture). Visitors that read or write
// values overload on this type; the others treat it as any leaf.
struct DataSourceField {
  std::string& selector;
  std::vector<DataSourceSpec>& mixture;

  // The `source` key of `data` and of `data.eval`.
  template <class V, class C>
  static void visit(V& v, C& c) {
    DataSourceField source{c.source, c.mixture};
    v.field("source", source);
  }
};

template <class V>
void visit_fields(V& v, EvalDataConfig& c) {
  DataSourceField::visit(v, c);
  v.field("holdout", c.holdout);
  v.field("windows", c.windows);
}

template <class V>
void visit_fields(V& v, DataConfig& c) {
  DataSourceField::visit(v, c);
  v.field("seq_len", c.seq_len);
  v.field("micro_batch", c.micro_batch);
  v.field("grad_accum", c.grad_accum);
  v.field("seed", c.seed);
  v.section("eval", c.eval);
}

template <class V>
void visit_fields(V& v, TrainConfig& c) {
  v.field("steps", c.steps);
  v.field("lr", c.lr);
  v.field("warmup_steps", c.warmup_steps);
  v.field("schedule", c.schedule);
  v.field("min_lr_ratio", c.min_lr_ratio);
  v.field("weight_decay", c.weight_decay);
  v.field("beta1", c.beta1);
  v.field("beta2", c.beta2);
  v.field("eps", c.eps);
  v.field("grad_clip", c.grad_clip);
  v.field("seed", c.seed);
  v.field("device", c.device);
  v.field("eval_every", c.eval_every);
  v.field("expert_window", c.expert_window);
}

template <class V>
void visit_fields(V& v, CheckpointConfig& c) {
  v.field("dir", c.dir);
  v.field("every", c.every);
  v.field("keep_last", c.keep_last);
  v.field("resume", c.resume);
  v.field("save_on_signal", c.save_on_signal);
  v.field("overwrite", c.overwrite);
  v.field("export_adapter", c.export_adapter);
  v.field("export_layout", c.export_layout);
  v.field("init_adapter", c.init_adapter);
}

template <class V>
void visit_fields(V& v, LoggingConfig& c) {
  v.field("run_dir", c.run_dir);
  v.field("every", c.every);
  v.field("level", c.level);
}

// The top level. source_path and explicit_model_keys are bookkeeping, not keys.
template <class V>
void visit_fields(V& v, Config& c) {
  v.section("model", c.model);
  v.section("lora", c.lora);
  v.section("parallel", c.parallel);
  v.section("data", c.data);
  v.section("train", c.train);
  v.section("checkpoint", c.checkpoint);
  v.section("logging", c.logging);
}

}  // namespace moetrain::config_schema
