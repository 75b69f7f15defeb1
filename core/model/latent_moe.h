// Kimi K3's latent MoE feed-forward (`model.moe.latent_size` > 0; HF routed_expert_hidden_size):
//   route     on the full hidden state x [n, D], exactly as MoeFfn does
//   down      z = x Wdown^T                         (mlp.routed_expert_down_proj, [L, D])
//   experts   y = sum_j w_j expert_j(z)             (the routed experts at width L)
//   norm      y = RMSNorm(y)                        (mlp.routed_expert_norm, when use_latent_norm)
//   up        out = y Wup^T                         (mlp.routed_expert_up_proj, [D, L])
//   shared    out += shared_experts(x)              (at the full width D)
// The order is NeMo AutoModel's and sglang's kimi_k3: the router and the shared experts read
// the un-projected x. Routing, dispatch, the experts and the shared experts are MoeFfn's own
// (forward_routed / backward_routed at row width L); this class adds the bottleneck around them.
#pragma once

#include "core/model/lora_linear.h"
#include "core/model/moe.h"

namespace moetrain {

class LatentMoeFfn final : public FeedForward {
 public:
  LatentMoeFfn(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const ParallelGroups* parallel);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_parameters(std::vector<Parameter*>& out) override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // The LoRA-targetable projections (down, up), named as the checkpoint names them.
  std::vector<LoraLinear*> projections() override { return {&down_proj, &up_proj}; }

  MoeFfn moe;            // router, routed experts at the latent width, shared experts at D
  LoraLinear down_proj;  // mlp.routed_expert_down_proj, [L, D]
  LoraLinear up_proj;    // mlp.routed_expert_up_proj, [D, L]
  Tensor norm;           // mlp.routed_expert_norm.weight [L], frozen; empty without the norm

 private:
  // The up-projection's input: the normed sum, or the sum itself without the norm.
  TensorView up_input() const { return use_norm_ ? saved_.normed.view() : saved_.y.view(); }

  int64_t latent_;
  // Whether the norm exists: not norm.defined(), which is false while FSDP holds the weight as a
  // shard-only placeholder (it was, and a sharded model skipped the norm).
  bool use_norm_;
  double eps_;
  std::string prefix_;
  struct Saved {
    Tensor z;       // [n, L] the experts' input
    Tensor y;       // [n, L] the weighted expert sum (the norm's input)
    Tensor normed;  // [n, L] RMSNorm(y); empty without the norm
    Tensor rstd;    // [n]
  } saved_;
};

}  // namespace moetrain
