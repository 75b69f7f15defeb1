// The dense SwiGLU MLP (the first `first_k_dense` layers of DeepSeek/Kimi):
// down_proj(silu(gate_proj(x)) * up_proj(x)).
#pragma once

#include "core/model/layer.h"
#include "core/model/swiglu_experts.h"

namespace moetrain {

class DenseFfn final : public FeedForward {
 public:
  // `prefix` is the module path, e.g. model.layers.0.mlp (or ...mlp.shared_experts); the frozen
  // weights are FP8 when the config keeps that module so (core/model/fp8_storage.h).
  DenseFfn(std::string prefix, int64_t hidden, int64_t width, const LayerContext& ctx, const ModelConfig& config);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override { mlp.release_saved(); }
  void collect_parameters(std::vector<Parameter*>& out) override { mlp.collect_parameters(out); }
  void collect_weights(std::vector<WeightSlot>& out) override;

  SwigluExperts mlp;  // one group

 private:
  // [0, rows] for the single group, rebuilt when the row count changes.
  GroupOffsets offsets(const LayerContext& ctx, int64_t rows);
  Tensor offsets_;
  int32_t offsets_host_[2] = {0, -1};  // {0, rows}: offsets_'s values
};

}  // namespace moetrain
