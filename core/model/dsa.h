// DeepSeek Sparse Attention (the `dsa` mixer), as transformers' DeepseekV32Attention computes it,
// with the output gate of model.attention_gate ("gated DSA"): MLA whose every query attends only
// to the top-k keys the frozen lightning indexer (dsa_indexer.h) picks for it.
//
// The attention runs in MQA ("absorbed") form, as DeepSeek-V3.2 runs it: kv_b_proj's per-head
// blocks W_K_h [nope, r] and W_V_h [v, r] (with its LoRA, W + s B A) are folded into the queries
// and the outputs instead of expanding a key and a value per head and token:
//   q, latent stages as MLA (mla_projections.h)            q [tokens, H, nope + rope], kv_normed, k_pe
//   q_abs[t, h] = [q_nope[t, h] W_K_h | q_pe[t, h]]        [tokens, H, r + rope]
//   kv[t]       = [kv_normed[t] | k_pe[t]]                 [tokens, r + rope], one row shared by all heads
//   o[t, h]     = sparse_attention(q_abs, kv, selected)    [tokens, H, r], over kv's first r columns
//   attn[t, h]  = W_V_h o[t, h]                            [tokens, H, v]
//   out         = output stage (gate, o_proj)
// q_abs . kv = q_nope . k_nope + q_pe . k_pe and W_V_h (sum_s p_s kv_normed[s]) = sum_s p_s v[s, h],
// so this is transformers' attention with its top-k mask, computed in another order.
// Gradients flow through the selected keys into every projection; the selection has none.
#pragma once

#include <vector>

#include "core/model/dsa_indexer.h"
#include "core/model/layer.h"
#include "core/model/mla_projections.h"
#include "core/model/model_spec.h"

namespace moetrain {

class DsaAttention final : public Mixer {
 public:
  // `rope` may be null when the model rotates nothing (NoPE MLA).
  DsaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // Every projection, for LoRA targeting by module name (the indexer's are frozen).
  std::vector<LoraLinear*> projections() override { return proj.projections(); }

  MlaProjections proj;
  DsaIndexer indexer;

 private:
  // kv_b_proj folded into the queries: q_abs[:, h, :r] = q_nope[:, h] W_K_h, head by head.
  void absorb_queries(const LayerContext& ctx, const TensorView& q_abs, const TensorView& q) const;
  // attn[:, h] = o[:, h] W_V_h^T.
  void expand_values(const LayerContext& ctx, const TensorView& attn, const TensorView& o) const;
  // The backward of each: dq's nope columns and do (=); with LoRA on kv_b_proj, the gradient of
  // its effective weight (rows of dweight [H (nope + v), r]) for the adapter.
  void absorb_queries_backward(const LayerContext& ctx, const TensorView& dq, const TensorView& dq_abs,
                               const TensorView& q, const TensorView& dweight) const;
  void expand_values_backward(const LayerContext& ctx, const TensorView& d_o, const TensorView& dattn,
                              const TensorView& o, const TensorView& dweight) const;

  struct Saved {
    MlaProjections::Saved stages;  // stages.q kept only when kv_b_proj has LoRA (its weight gradient)
    Tensor selected;               // int32 [tokens, top_k]
    Tensor q_abs, kv, o, lse;      // the sparse attention's operands and results
  } saved_;
};

}  // namespace moetrain
