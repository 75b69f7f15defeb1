#include "core/model/attn_res.h"

namespace moetrain {

AttnResiduals::AttnResiduals(const ModelConfig& config, const LayerContext& ctx)
    : block_size_(config.attn_res_block_size), hidden_(config.hidden_size), eps_(config.rms_norm_eps) {
  output_mix_ = make_mix(ctx);
}

AttnResMix AttnResiduals::make_mix(const LayerContext& ctx) const {
  if (!enabled()) return AttnResMix{};
  return AttnResMix{ctx.alloc({hidden_}), ctx.alloc({1, hidden_})};
}

void AttnResiduals::collect_layer_weights(const std::string& prefix, AttnResMix& attention, AttnResMix& mlp,
                                          std::vector<WeightSlot>& out) const {
  if (!enabled()) return;
  out.push_back({prefix + "self_attention_res_norm.weight", &attention.norm});
  out.push_back({prefix + "self_attention_res_proj.weight", &attention.query});
  out.push_back({prefix + "mlp_res_norm.weight", &mlp.norm});
  out.push_back({prefix + "mlp_res_proj.weight", &mlp.query});
}

void AttnResiduals::collect_output_weights(std::vector<WeightSlot>& out) {
  if (!enabled()) return;
  out.push_back({"model.output_attn_res_norm.weight", &output_mix_.norm});
  out.push_back({"model.output_attn_res_proj.weight", &output_mix_.query});
}

std::vector<Tensor*> AttnResiduals::output_tensors() {
  if (!enabled()) return {};
  return {&output_mix_.norm, &output_mix_.query};
}

std::vector<TensorView> AttnResiduals::summaries_for(const std::vector<Tensor>& inputs, size_t index) const {
  std::vector<TensorView> out;
  if (!enabled()) return out;
  for (size_t j = 0; j <= index; j += static_cast<size_t>(block_size_)) out.push_back(inputs[j]);
  return out;
}

std::vector<TensorView> AttnResiduals::filed_before(const std::vector<TensorView>& summaries, size_t index) const {
  return std::vector<TensorView>(summaries.begin(), summaries.end() - (starts_block(index) ? 1 : 0));
}

TensorView AttnResiduals::mix_forward(const LayerContext& ctx, const AttnResMix& mix,
                                      const std::vector<TensorView>& values, AttnResSaved& saved) const {
  const int64_t n = values.front().size(0), d = values.front().size(1);
  saved.out = ctx.alloc({n, d});
  saved.probs = ctx.alloc_accum({n, static_cast<int64_t>(values.size())});
  ctx.backend.attn_res_forward(
      kernels::AttnResArgs{saved.out, saved.probs, values, mix.norm, mix.query.view().reshaped({d}), eps_});
  return saved.out;
}

void AttnResiduals::mix_backward(const LayerContext& ctx, const AttnResMix& mix, const std::vector<TensorView>& dvalues,
                                 const TensorView& dout, const std::vector<TensorView>& values,
                                 const AttnResSaved& saved) const {
  const int64_t d = dout.size(1);
  ctx.backend.attn_res_backward(
      kernels::AttnResBackwardArgs{dvalues, dout, values, mix.norm, mix.query.view().reshaped({d}), saved.probs, eps_});
}

TensorView AttnResiduals::final_input(const LayerContext& ctx, const std::vector<Tensor>& inputs) {
  const size_t num_layers = inputs.size() - 1;
  if (!enabled()) return inputs[num_layers];
  // Every summary (the last layer sees them all) and the last layer's output.
  return mix_forward(ctx, output_mix_, with(summaries_for(inputs, num_layers - 1), inputs[num_layers].view()), final_);
}

std::vector<Tensor> AttnResiduals::final_backward(const LayerContext& ctx, const TensorView& dx,
                                                  const TensorView& dmix, const std::vector<Tensor>& inputs) {
  const size_t num_layers = inputs.size() - 1;
  const int64_t n = dx.size(0), d = dx.size(1);
  const std::vector<TensorView> summaries = summaries_for(inputs, num_layers - 1);
  std::vector<Tensor> dsummaries;
  std::vector<TensorView> dviews;
  for (size_t j = 0; j < summaries.size(); ++j) {
    dsummaries.push_back(ctx.alloc_accum({n, d}));
    ctx.backend.fill(dsummaries.back(), 0.0);
    dviews.push_back(dsummaries.back());
  }
  ctx.backend.fill(dx, 0.0);
  mix_backward(ctx, output_mix_, with(dviews, dx), dmix, with(summaries, inputs[num_layers].view()), final_);
  release_final();
  return dsummaries;
}

}  // namespace moetrain
