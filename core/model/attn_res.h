// Block Attention Residuals (model.attn_res_block_size = B > 0, Kimi K3; NeMo AutoModel's
// kimi_k3 decoder layer). The stream carries the running sum h and the block summaries: the
// inputs of layers 0, B, 2B, ... Layer i, with S the summaries filed before it:
//   x   = mix_attention(S, h)             (h itself when S is empty: layer 0)
//   i % B == 0: h is filed as a summary and the running sum restarts: p = mixer(norm(x))
//   else:                                                              p = h + mixer(norm(x))
//   y   = mix_mlp(S and h if filed, p)
//   out = p + ffn(norm(y))
// and the final norm reads mix_output(every summary, the last layer's output). Without it,
// x = h, y = p = h + mixer(norm(h)), the plain pre-norm residual. A depth mix is kernels/ops.h
// AttnResArgs: a softmax over the values' RMSNormed projections onto a pseudo-query.
#pragma once

#include <string>
#include <vector>

#include "core/model/layer.h"
#include "core/model/model_spec.h"

namespace moetrain {

// One depth mix: its RMSNorm weight and pseudo-query, both [D] (the checkpoint stores the query
// as a [1, D] projection), frozen.
struct AttnResMix {
  Tensor norm;   // <name>_norm.weight
  Tensor query;  // <name>_proj.weight
};

// What a depth mix keeps for its backward: its output [n, D] and probabilities [n, values]
// (undefined where no mix ran).
struct AttnResSaved {
  Tensor out, probs;
};

// `list` with `last` appended.
template <typename T>
std::vector<T> with(std::vector<T> list, const T& last) {
  list.push_back(last);
  return list;
}

// The mixing of one model: which layers file summaries, the depth mixes' forward and backward,
// and the output mix before the final norm. Every call is a no-op (or the identity) when B = 0.
class AttnResiduals {
 public:
  AttnResiduals(const ModelConfig& config, const LayerContext& ctx);

  bool enabled() const { return block_size_ > 0; }
  // Layer `index` files the stream as a block summary.
  bool starts_block(size_t index) const {
    return enabled() && index % static_cast<size_t>(block_size_) == 0;
  }
  // The summaries among the layer inputs `inputs` that layer `index` sees: the inputs of layers
  // 0, B, 2B, ... <= index (the last is the layer's own input at a block start); empty when off.
  std::vector<TensorView> summaries_for(const std::vector<Tensor>& inputs, size_t index) const;
  // The summaries filed before layer `index` (its attention mix's values besides x).
  std::vector<TensorView> filed_before(const std::vector<TensorView>& summaries, size_t index) const;

  // A layer's two mixes, allocated (a depth mix's weights) when enabled.
  AttnResMix make_mix(const LayerContext& ctx) const;
  // The mixes' weights by HF name: <prefix>self_attention_res_* and <prefix>mlp_res_*.
  void collect_layer_weights(const std::string& prefix, AttnResMix& attention, AttnResMix& mlp,
                             std::vector<WeightSlot>& out) const;
  // The output mix's (model.output_attn_res_*), and it as FSDP bucket members.
  void collect_output_weights(std::vector<WeightSlot>& out);
  std::vector<Tensor*> output_tensors();

  // saved.out = mix(values), returned.
  TensorView mix_forward(const LayerContext& ctx, const AttnResMix& mix, const std::vector<TensorView>& values,
                         AttnResSaved& saved) const;
  // dvalues += the mix's backward of dout.
  void mix_backward(const LayerContext& ctx, const AttnResMix& mix, const std::vector<TensorView>& dvalues,
                    const TensorView& dout, const std::vector<TensorView>& values, const AttnResSaved& saved) const;

  // The final norm's input: the last layer's output (inputs.back()), or its output mix with every
  // summary (kept for final_backward until release_final).
  TensorView final_input(const LayerContext& ctx, const std::vector<Tensor>& inputs);
  // The output mix's backward from dmix (the final norm's input gradient): dx = the last layer
  // output's share; returns every summary's gradient, accumulation dtype, in filing order. Then
  // the mix's saved state is dropped.
  std::vector<Tensor> final_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dmix,
                                     const std::vector<Tensor>& inputs);
  void release_final() { final_ = AttnResSaved{}; }

 private:
  int64_t block_size_;
  int64_t hidden_;
  double eps_;
  AttnResMix output_mix_;  // model.output_attn_res_*
  AttnResSaved final_;
};

}  // namespace moetrain
