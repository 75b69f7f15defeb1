// The routed Mixture-of-Experts feed-forward (DeepSeek-V3 / Kimi), in named stages:
//   route     logits = x Wr^T; scores, top-k experts and weights (kernels: router_forward)
//   dispatch  sort the (token, slot) pairs by expert and gather the rows (moe_permutation/permute)
//   experts   one grouped SwiGLU over the expert-sorted rows
//   combine   out[t] = sum_j w[t, j] * expert_out[t, j]  (+ the shared experts on every token)
// Backward runs the stages in reverse; gradients flow through the routing weights into the router
// logits and on into x (the router itself is frozen). Under expert parallelism dispatch ends, and
// combine starts, with the all-to-all exchanges of expert_dispatch.h around the same expert stage.
#pragma once

#include <memory>
#include <random>
#include <vector>

#include "core/model/dense_ffn.h"
#include "core/model/expert_dispatch.h"
#include "core/model/layer.h"
#include "core/model/parallel_groups.h"
#include "core/model/model_spec.h"
#include "core/model/swiglu_experts.h"

namespace moetrain {

// Per-step statistics of an MoE layer: its expert loads and aux loss (MoeFfn::expert_loads).
struct FeedForwardStats {
  double max_expert_load = 0.0;  // max over experts of tokens routed / the mean per expert
  double min_expert_load = 0.0;  // min over experts of the same (0: an expert got no token)
  double aux_loss = 0.0;         // the load-balancing loss added to the objective
};

// The router noise of one micro-batch of a pass: the stream it draws from, over its rows (an
// expert window's micro-batches keep the streams they would draw from alone).
struct NoiseStream {
  uint64_t seed = 0;
  int64_t rows = 0;
};

class MoeFfn final : public FeedForward {
 public:
  // `parallel` (may be null: one rank) decides which experts this rank holds. The routed
  // experts run on rows of `row_width` (0: hidden_size; the latent MoE passes its latent width).
  MoeFfn(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const ParallelGroups* parallel,
         int64_t row_width = 0);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_parameters(std::vector<Parameter*>& out) override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // The last micro-batch's statistics, left on the device (empty before the first forward): the
  // expert offsets (int32 [E + 1]) of each of its token chunks (one without chunking: see
  // start_rows) and the weighted aux loss ([1] accum, summed over the pass's micro-batches;
  // undefined without one). The model reads
  // every layer's back in one copy per micro-batch, after its backward is queued.
  const std::vector<Tensor>& stats_offsets() const { return stats_offsets_; }
  const Tensor& stats_aux_loss() const { return stats_aux_loss_; }
  // The expert loads from per-expert token counts (FeedForwardStats::aux_loss left 0).
  static FeedForwardStats expert_loads(const std::vector<int64_t>& counts);

  // The shared experts' part (no-op without them): out += shared(x); dx = their backward (0
  // without them).
  void forward_shared(const LayerContext& ctx, const TensorView& out, const TensorView& x);
  void backward_shared(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x);
  // The routed half alone (no shared experts), for feed-forwards that wrap it (LatentMoeFfn):
  // route on x [n, D], send rows [n, W] through the chosen experts, out [n, W] = their weighted sum.
  void forward_routed(const LayerContext& ctx, const TensorView& out, const TensorView& x, const TensorView& rows);
  // drows (=, or += with accumulate_rows) from dout [n, W]; dx += the router's share (through the
  // routing weights). drows may be dx itself (the plain MoE, where rows are x).
  void backward_routed(const LayerContext& ctx, const TensorView& dx, const TensorView& drows, const TensorView& dout,
                       bool accumulate_rows);

  // The next forward runs rows [first_row, first_row + its rows) of the pass: the whole of it
  // (first_row 0) or one token chunk (Model::ffn_forward). Router noise is drawn for the pass's
  // rows from `noise`, one stream per micro-batch in row order, so chunks and windows route as
  // the micro-batches alone would, and re-seeding with the same streams makes a recomputed
  // forward route exactly as the first one did. first_row 0 starts the pass's statistics afresh;
  // later chunks add theirs.
  void start_rows(std::vector<NoiseStream> noise, int64_t first_row) {
    noise_ = std::move(noise);
    first_row_ = first_row;
  }
  // Aux-loss-free balancing (DeepSeek-V3): score_bias[e] += rate * sign(mean - rows[e]), with
  // rows[e] the rows expert e got over a whole optimizer step on every rank (the same on all of
  // them, so every rank's bias stays the same). Computed in F64 on the host, then stored.
  void update_score_bias(kernels::Backend& backend, const std::vector<double>& rows, double rate);
  // score_bias's HF name (mlp.gate.e_score_correction_bias of this layer).
  std::string score_bias_name() const { return prefix_ + ".gate.e_score_correction_bias"; }
  // Router noise on (training) or off (an evaluation measures the model as it will serve).
  void set_noise_enabled(bool enabled) { noise_enabled_ = enabled; }
  // Weight of this micro-batch's aux loss in the step's objective (1 / micro-batches).
  void set_aux_loss_weight(double weight) { aux_loss_weight_ = weight; }

  Tensor router_weight;  // [E, D], frozen (mlp.gate.weight)
  Tensor score_bias;     // [E] (mlp.gate.e_score_correction_bias), selection only
  SwigluExperts experts;             // this rank's experts (all of them without expert parallelism)
  std::unique_ptr<DenseFfn> shared;  // null without shared experts

 private:
  // The stages of forward_routed, in order. route: scores, top-k experts and weights from x.
  // dispatch: the (token, slot) rows sorted by expert and, under expert parallelism, sent to the
  // ranks holding their experts. run_experts: the local experts' outputs (expert_rows' layout).
  // combine: the outputs back to their ranks and out[t] = sum_j w[t, j] * row(t, j).
  // record_statistics: the expert offsets and the aux loss (and its score gradient).
  void route(const LayerContext& ctx, const TensorView& x);
  Tensor router_noise(const LayerContext& ctx, int64_t tokens) const;  // undefined: no noise
  void dispatch(const LayerContext& ctx, const TensorView& rows);
  Tensor run_experts(const LayerContext& ctx);
  void combine(const LayerContext& ctx, const TensorView& out, Tensor& expert_out);
  void record_statistics(const LayerContext& ctx, int64_t tokens);
  // backward_routed's, in reverse: each returns (or writes) the gradient of its stage's input;
  // route_backward adds the router's share into dx.
  Tensor combine_backward(const LayerContext& ctx, const TensorView& dtopk_weight, const TensorView& dout);
  Tensor experts_backward(const LayerContext& ctx, const TensorView& dexpert_out);
  void dispatch_backward(const LayerContext& ctx, const TensorView& drows, Tensor& dexpert_x, bool accumulate_rows);
  void route_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dtopk_weight);
  // The rows this rank's experts run on and their group offsets: the exchanged rows under expert
  // parallelism, else the dispatched ones.
  struct ExpertRows {
    TensorView x;
    GroupOffsets offsets;
  };
  ExpertRows expert_rows() const;

  MoeConfig moe_;
  int64_t hidden_;
  int64_t row_width_;  // the routed experts' input and output width
  std::string prefix_;
  std::vector<NoiseStream> noise_;  // start_rows()
  int64_t first_row_ = 0;  // start_rows()
  bool noise_enabled_ = true;
  double aux_loss_weight_ = 1.0;
  std::vector<Tensor> stats_offsets_;  // stats_offsets()
  Tensor stats_aux_loss_;              // stats_aux_loss()
  std::unique_ptr<ExpertDispatch> dispatch_;  // null without expert parallelism

  struct Saved {
    Tensor scores, topk_index, topk_weight;
    Tensor expert_offsets, sorted_pair, pair_row;
    Tensor routed_x, routed_out;  // [tokens * top_k, W], expert order
    Tensor local_x, local_offsets;  // under expert parallelism: the rows this rank's experts ran
    // Under expert parallelism only: the host copy of the local offsets, which the exchange's
    // sizes need anyway. Without it the experts read their offsets on the device.
    std::vector<int32_t> expert_rows;
    Tensor aux_dscores;           // dL_aux/dscores, already weighted; empty without aux loss
  } saved_;
};

}  // namespace moetrain
