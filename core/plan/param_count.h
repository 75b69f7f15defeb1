// Parameter counts of a model from its ModelSpec alone (no tensors allocated): every frozen
// weight and every LoRA adapter, split the way the parallel plan shards them (non-expert
// weights over FSDP, routed experts over EP). They equal Model::weight_slots() /
// Model::parameters() exactly for every layer kind Model builds (MLA, DSA, KDA, the attention
// output gate, MoE, dense FFN; tested).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/model/model_spec.h"

namespace moetrain {

struct LayerParameterCount {
  MixerKind mixer_kind = MixerKind::kMla;
  FfnKind ffn_kind = FfnKind::kDense;
  int64_t norms = 0;            // input + post-attention RMSNorm
  int64_t mixer = 0;            // attention projections and their norms (+ gate, indexer)
  int64_t router = 0;           // router weight + score-correction bias
  int64_t dense_ffn = 0;        // dense MLP (dense layers) or the shared experts (MoE layers)
  int64_t routed_experts = 0;   // all routed experts of the layer (E x 3 x D x F)
  // What model.weight_format: fp8 keeps in FP8 (core/model/fp8_storage.h; every quantizable
  // module, whatever a checkpoint's modules_to_not_convert says): of the non-expert weights (part
  // of mixer and dense_ffn) the elements and their 128 x 128 blocks, and the routed experts' blocks.
  int64_t fp8_non_expert = 0;
  int64_t fp8_non_expert_blocks = 0;
  int64_t fp8_routed_expert_blocks = 0;
  int64_t non_expert() const { return norms + mixer + router + dense_ffn; }
};

struct ModelParameterCount {
  int64_t embedding = 0;
  int64_t lm_head = 0;  // 0 when tied to the embedding
  int64_t final_norm = 0;
  std::vector<LayerParameterCount> layers;
  // model.vision: the tower and the projector, whole on every rank (VisionTower::weight_slots;
  // with projector_train: full the projector's weights are its trainable parameters).
  int64_t vision_tower = 0;
  int64_t projector = 0;

  int64_t non_expert() const;      // FSDP-sharded frozen weights
  int64_t routed_experts() const;  // EP-sharded frozen weights
  int64_t vision() const { return vision_tower + projector; }
  int64_t total() const { return non_expert() + routed_experts() + vision(); }
  int64_t routed_expert_per_layer() const;  // of one MoE layer (0 without MoE layers)
};

// Adapters at each module's rank (lora.rank_pattern applied as the model applies it).
struct LoraParameterCount {
  // Per layer: attention, dense MLP, shared experts, and the routed experts' shared A's
  // (lora.expert_a: shared; replicated like the rest).
  std::vector<int64_t> layer_non_expert;
  std::vector<int64_t> layer_routed_expert;  // per layer: the per-expert factors of all its experts
  int64_t shared_expert_a = 0;  // the part of non_expert() that is shared expert A's (every routed row)
  int64_t num_moe_layers = 0;
  // The projector's trainable parameters (model.vision.projector_train: its weights, or LoRA on its
  // two Linears at lora.rank), replicated like the non-expert adapters and counted in non_expert().
  int64_t vision_projector = 0;
  // Elements of the adapters as the SwiGLU networks pack them for their GEMMs (SwigluExperts::
  // PackedLora: gate and up's A's stacked along the rank, their B's block-diagonal over the 2F
  // outputs, so each B is stored twice its size): the dense and shared MLPs' with the routed
  // experts' shared A's (on every rank), and the routed experts' own factors (all experts of all
  // layers). Training holds them, in the compute dtype, over each optimizer step.
  int64_t packed_replicated = 0;
  int64_t packed_routed_experts = 0;
  int64_t non_expert() const;
  int64_t routed_experts() const;
  int64_t total() const { return non_expert() + routed_experts(); }
};

// Per-layer mixer and FFN kinds from a model section (as resolve_model_spec derives them, without
// reading config.json or checking the config's rules): `layers` empty means all mla.
ModelSpec plan_model_spec(const ModelConfig& model);

ModelParameterCount count_model_parameters(const ModelSpec& spec);
LoraParameterCount count_lora_parameters(const ModelSpec& spec, const LoraConfig& lora);

// The checks Model::attach_lora makes when it builds the adapters, from the spec alone (no
// weights), so that validate and plan refuse what train refuses: every lora.targets entry names
// a module kind this model has, and every lora.rank_pattern / alpha_pattern key selects an
// adapted module. Error(kBadConfig) with attach_lora's message.
void check_lora_modules(const ModelSpec& spec, const LoraConfig& lora);

}  // namespace moetrain
