// DeepSeek-V3.2's lightning indexer (transformers DeepseekV32Indexer), frozen: it picks the keys
// each query of a dsa layer attends to. From the layer input x and MLA's normed q latent:
//   q_I = wq_b(q_latent)                [tokens, Hi, di]
//   k_I = k_norm(wk(x))                 [tokens, di]    LayerNorm with weight and bias, eps 1e-6
//   q_I, k_I rotated on their first qk_rope_head_dim columns (the rest pass), with MLA's rope
//         tables; half-split pairs unless model.dsa.indexer_rope_interleave
//   w   = weights_proj(x)               [tokens, Hi]
//   top-k of I[t, s] = di^-0.5 Hi^-0.5 sum_j w[t, j] relu(q_I[t, j] . k_I[s]), causal per document
// (transformers applies di^-0.5 to the scores and Hi^-0.5 to w: positive factors, folded here).
// No gradient flows through the selection, so the indexer runs forward only and keeps nothing.
// Weights: model.layers.<L>.self_attn.indexer.{wq_b,wk,weights_proj}.weight, k_norm.{weight,bias}.
#pragma once

#include <string>
#include <vector>

#include "core/model/layer.h"
#include "core/model/mla_projections.h"
#include "core/model/model_spec.h"

namespace moetrain {

class DsaIndexer {
 public:
  DsaIndexer() = default;
  // `rope` may be null (NoPE MLA: the indexer rotates nothing either).
  DsaIndexer(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope);

  void collect_weights(std::vector<WeightSlot>& out);

  // int32 [tokens, top_k]: each query's selected keys (kernels/ops.h, DsaIndexerArgs).
  Tensor select(const LayerContext& ctx, const TensorView& x, const TensorView& q_latent) const;

  int64_t top_k() const { return top_k_; }

  Tensor wq_b;          // [Hi di, q_lora_rank]; FP8 codes (U8) with wq_b_scale under weight_format fp8
  Tensor wk;            // [di, D]; likewise
  Tensor wq_b_scale;    // FP8 only: F32 block scales (core/model/fp8_storage.h)
  Tensor wk_scale;
  Tensor k_norm_weight; // [di]
  Tensor k_norm_bias;   // [di]
  Tensor weights_proj;  // [Hi, D]

 private:
  int64_t heads_ = 0, head_dim_ = 0, rope_dim_ = 0, top_k_ = 0;
  kernels::RopeLayout rope_layout_ = kernels::RopeLayout::kHalfSplit;
  const RopeDeviceTables* rope_ = nullptr;
  std::string prefix_;
};

}  // namespace moetrain
