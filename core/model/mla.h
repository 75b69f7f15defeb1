// Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-Linear's NoPE variant, Kimi K3's gated MLA),
// from the stages of MlaProjections (mla_projections.h):
//   q                 = queries(x)                                [tokens, heads, nope + rope]
//   kv_normed, k_pe   = latent(x)
//   kv                = kv_b_proj(kv_normed)                      per head: [k_nope | v]
//   k                 = [k_nope | k_pe broadcast over heads]
//   out               = output(causal_attention(q, k, v) within each segment)   (gate, o_proj)
#pragma once

#include <vector>

#include "core/model/layer.h"
#include "core/model/mla_blocked.h"
#include "core/model/mla_context_parallel.h"
#include "core/model/mla_projections.h"
#include "core/model/model_spec.h"

namespace moetrain {

class MlaAttention final : public Mixer {
 public:
  // `rope` may be null when the model rotates nothing (NoPE: model.mla.use_rope false).
  MlaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // Every projection, for LoRA targeting by module name.
  std::vector<LoraLinear*> projections() override { return proj.projections(); }

  MlaProjections proj;

 private:
  // One rank in query blocks x key chunks (mla_blocked.h): parallel.attention_query_block or
  // parallel.cp_key_chunk set.
  static bool blocked(const LayerContext& ctx);
  MlaBlocks blocks(const LayerContext& ctx, int64_t tokens) const;

  struct Saved {
    MlaProjections::Saved stages;
    Tensor kv_normed;  // kv_b_proj's input
    Tensor k, v, lse;  // the attention's operands (q is stages.q, its output stages.attn)
    Tensor k_pe;       // in query blocks: the rotated k_pe, expanded with kv_normed per key chunk
    // Under context parallelism, in place of k and v: the latent rows the queries see.
    MlaAcrossRanks::Latent visible;
  } saved_;
};

}  // namespace moetrain
