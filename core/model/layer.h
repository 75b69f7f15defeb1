// The two halves of a decoder layer, as interfaces every kind plugs into:
//   x -> x + Mixer(norm(x)) -> h -> h + FeedForward(norm(h))
// Both are a LayerBlock. Mixers: MLA, KDA and (gated) DSA. Feed-forwards: dense SwiGLU, the routed
// MoE and K3's latent MoE.
//
// forward saves what backward needs inside the layer; release_saved() drops it (activation
// recompute: the model re-runs forward before backward). backward overwrites dx and adds
// into the layer's parameter gradients.
#pragma once

#include <string>
#include <vector>

#include "core/model/layer_context.h"
#include "core/model/parameter.h"

namespace moetrain {

// Weights a layer owns, by Hugging Face name, for loading and sharding.
//   kPlain:        `name` is the tensor's HF name (model.layers.3.self_attn.kv_b_proj.weight).
//   kSwigluGateUp: `name` is a SwiGLU module path; the tensor [G, 2F, D] stacks gate_proj over
//                  up_proj. G = 1: <name>.gate_proj.weight + <name>.up_proj.weight; G > 1
//                  (routed experts): per expert <name>.<e>.gate_proj.weight ..., or the fused
//                  <name>.gate_up_proj that transformers 5 saves.
//   kSwigluDown:   likewise for down_proj, [G, D, F].
enum class WeightLayout { kPlain, kSwigluGateUp, kSwigluDown };
struct WeightSlot {
  std::string name;
  Tensor* tensor;  // allocated with its final shape and dtype
  WeightLayout layout = WeightLayout::kPlain;
  int64_t first_group = 0;  // routed experts: the global id of the tensor's first expert
  // MXFP4 routed experts (model.moe.expert_format: mxfp4): `tensor` holds the packed codes
  // [G, out, in / 2] U8 and this the E8M0 scales [G, out, in / 32] U8. FP8 weights
  // (model.weight_format: fp8): `tensor` holds the E4M3 codes of the weight's own shape (U8) and
  // this the F32 block scales [..., ceil(out / 128), ceil(in / 128)]. Null for plain weights.
  Tensor* scale = nullptr;
  bool fp8() const { return scale != nullptr && scale->dtype() == DType::kF32; }
  bool mxfp4() const { return scale != nullptr && scale->dtype() == DType::kU8; }
};

class LoraLinear;

// One half of a decoder layer: a mixer or a feed-forward.
class LayerBlock {
 public:
  virtual ~LayerBlock() = default;
  virtual void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) = 0;
  virtual void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                        const TensorView& x) = 0;
  virtual void release_saved() = 0;
  // The block's trainable parameters, in a fixed order; by default the adapters of projections().
  virtual void collect_parameters(std::vector<Parameter*>& out);
  virtual void collect_weights(std::vector<WeightSlot>& out) = 0;
  // The block's LoRA-capable projections, for LoRA targeting by HF module name (SwiGLU networks
  // carry their adapters themselves: SwigluExperts).
  virtual std::vector<LoraLinear*> projections() { return {}; }
};

class Mixer : public LayerBlock {};
class FeedForward : public LayerBlock {};

}  // namespace moetrain
