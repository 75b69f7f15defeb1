// Model FLOPs of a training step, the numerator of MFU (docs/PERF.md, "What is counted"):
//   - every frozen matmul, forward + input-gradient backward: 2 + 2 FLOPs per weight per token
//     (routed experts for the top_k a token visits, shared experts, the router, the LM head);
//   - LoRA adapters: 6 FLOPs per adapter weight per token (forward, input grad, weight grad), a
//     routed expert's adapters weighing top_k / num_experts;
//   - causal attention: 2 (d_qk + d_v) FLOPs per head per (query, key <= query) pair within each
//     packed segment forward, 2.5x that backward;
//   - KDA's recurrence in its recurrent form: per token and head S^T k, the rank-1 update and
//     S^T q, 6 d^2 FLOPs forward, twice that backward (the chunked kernels' extra intra-chunk
//     work is hardware FLOPs, not model FLOPs); its projections count as frozen matmuls.
//   - DSA: its MLA projections as MLA's (the absorbed form multiplies by every kv_b_proj weight
//     once per token too); sparse attention in MQA form, 2 (2 r + d_r) FLOPs per head per
//     (query, selected key) pair forward (r = kv_lora_rank), 2.5x that backward, over
//     min(index_topk, keys available) keys per query; the frozen indexer runs forward only: its
//     projections 2 FLOPs per weight per token, its scores 2 Hi di per (query, key <= query) pair.
// Recomputation is not counted (model FLOPs, not hardware FLOPs).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/data/context_shards.h"
#include "core/model/model_spec.h"

namespace moetrain {

struct StepFlops {
  double frozen = 0.0;     // frozen matmuls, forward + input grad
  double lora = 0.0;       // adapters, forward + input grad + weight grad
  double attention = 0.0;  // attention scores and values (and KDA's recurrence), forward + backward
  double total() const { return frozen + lora + attention; }
};

class ModelFlops {
 public:
  ModelFlops(const ModelSpec& spec, const LoraConfig& lora);

  // A batch of `tokens` packed tokens whose segments are cu_seqlens' ([segments + 1] prefix sums).
  StepFlops step(int64_t tokens, const std::vector<int32_t>& cu_seqlens) const;
  // Rank `rank`'s share of a micro-batch cut across a context-parallel group: its spans' queries,
  // each with its keys from its document's start wherever they live (window tokens [b, e) cost
  // the micro-batch's first e tokens less its first b).
  StepFlops shard(const ContextShards& shards, int rank) const;

  double frozen_weights_per_token() const { return frozen_per_token_; }
  double lora_weights_per_token() const { return lora_per_token_; }

 private:
  double frozen_per_token_ = 0.0;
  double lora_per_token_ = 0.0;
  double attention_per_pair_ = 0.0;  // forward FLOPs of one (query, key) pair, summed over layers
  double recurrence_per_token_ = 0.0;  // forward FLOPs of KDA's recurrence per token, summed over layers
  double indexer_weights_per_token_ = 0.0;  // DSA indexers' projection weights (forward only)
  double indexer_per_pair_ = 0.0;           // DSA indexers' score FLOPs per causal pair (forward only)
  double sparse_per_pair_ = 0.0;            // DSA forward FLOPs per (query, selected key) pair
  int64_t index_topk_ = 0;
};

}  // namespace moetrain
