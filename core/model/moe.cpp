#include "core/model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/base/host_convert.h"
#include "core/model/fp8_storage.h"

namespace moetrain {

using kernels::AuxLossArgs;
using kernels::GemmArgs;
using kernels::MoeCombineArgs;
using kernels::MoeCombineBackwardArgs;
using kernels::MoePermutationArgs;
using kernels::RouterArgs;
using kernels::RouterBackwardArgs;
using kernels::RouterScoring;

namespace {

RouterScoring scoring_of(const MoeConfig& moe) {
  return moe.scoring == "softmax" ? RouterScoring::kSoftmax : RouterScoring::kSigmoid;
}

// Samples [first, first + n) of a stream of standard normal samples from a 64-bit generator, by
// Box-Muller on its top 53 bits (two generator draws per pair of samples), so the noise does not
// depend on the standard library's distributions and any stretch of it can be drawn alone.
void fill_gaussian(double* out, int64_t first, int64_t n, double stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t first_pair = first / 2;
  rng.discard(static_cast<unsigned long long>(2 * first_pair));
  auto unit = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (int64_t i = 2 * first_pair; i < first + n; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(unit()));
    const double angle = 2.0 * 3.14159265358979323846 * unit();
    if (i >= first) out[i - first] = stddev * radius * std::cos(angle);
    if (i + 1 >= first && i + 1 < first + n) out[i + 1 - first] = stddev * radius * std::sin(angle);
  }
}

}  // namespace

MoeFfn::MoeFfn(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const ParallelGroups* parallel,
               int64_t row_width)
    : experts("model.layers." + std::to_string(layer) + ".mlp.experts",
              parallel ? parallel->local_experts() : spec.config.moe.num_experts,
              row_width > 0 ? row_width : spec.config.hidden_size, spec.config.moe.expert_intermediate_size,
              /*routed=*/true, parallel ? parallel->first_expert() : 0),
      moe_(spec.config.moe),
      hidden_(spec.config.hidden_size),
      row_width_(row_width > 0 ? row_width : spec.config.hidden_size),
      prefix_("model.layers." + std::to_string(layer) + ".mlp") {
  const int64_t e = moe_.num_experts;
  const int64_t local = experts.groups();
  const int64_t f = moe_.expert_intermediate_size;
  router_weight = ctx.alloc({e, hidden_});
  score_bias = ctx.alloc_accum({e});
  ctx.backend.fill(score_bias, 0.0);
  if (moe_.expert_format == "mxfp4") {
    // Kept packed (frozen): codes two per byte along each weight's input, an E8M0 scale per 32.
    experts.gate_up = ctx.alloc({local, 2 * f, row_width_ / 2}, DType::kU8);
    experts.gate_up_scale = ctx.alloc({local, 2 * f, row_width_ / 32}, DType::kU8);
    experts.down = ctx.alloc({local, row_width_, f / 2}, DType::kU8);
    experts.down_scale = ctx.alloc({local, row_width_, f / 32}, DType::kU8);
  } else {
    const bool fp8 = keeps_fp8(spec.config, experts.prefix() + ".gate_proj") && fp8_stacks(f);
    alloc_frozen_weight(ctx, {local, 2 * f, row_width_}, fp8, experts.gate_up, experts.gate_up_scale);
    alloc_frozen_weight(ctx, {local, row_width_, f}, fp8, experts.down, experts.down_scale);
  }
  experts.activation = gated_activation_of(spec.config);
  if (parallel && parallel->expert_parallel()) {
    dispatch_ = std::make_unique<ExpertDispatch>(*parallel->ep, e, local);
  }
  if (moe_.num_shared_experts > 0) {
    shared = std::make_unique<DenseFfn>(prefix_ + ".shared_experts", hidden_, f * moe_.num_shared_experts, ctx,
                                        spec.config);
    shared->mlp.activation = gated_activation_of(spec.config);
  }
}

void MoeFfn::collect_parameters(std::vector<Parameter*>& out) {
  experts.collect_parameters(out);
  if (shared) shared->collect_parameters(out);
}

void MoeFfn::collect_weights(std::vector<WeightSlot>& out) {
  out.push_back({prefix_ + ".gate.weight", &router_weight});
  if (moe_.score_correction_bias) out.push_back({score_bias_name(), &score_bias});
  const bool packed = experts.gate_up_scale.defined();  // MXFP4 or FP8: the scales travel with the codes
  out.push_back({experts.prefix(), &experts.gate_up, WeightLayout::kSwigluGateUp, experts.first_group(),
                 packed ? &experts.gate_up_scale : nullptr});
  out.push_back({experts.prefix(), &experts.down, WeightLayout::kSwigluDown, experts.first_group(),
                 packed ? &experts.down_scale : nullptr});
  if (shared) shared->collect_weights(out);
}

void MoeFfn::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  forward_routed(ctx, out, x, x);
  forward_shared(ctx, out, x);
}

void MoeFfn::forward_shared(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  if (!shared) return;
  Tensor shared_out = ctx.alloc({x.size(0), hidden_});
  shared->forward(ctx, shared_out, x);
  ctx.backend.axpby(out, shared_out, 1.0, 1.0);
}

void MoeFfn::backward_shared(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                             const TensorView& x) {
  if (shared) shared->backward(ctx, dx, dout, x);
  else ctx.backend.fill(dx, 0.0);
}

void MoeFfn::forward_routed(const LayerContext& ctx, const TensorView& out, const TensorView& x,
                            const TensorView& rows) {
  route(ctx, x);
  dispatch(ctx, rows);
  Tensor expert_out = run_experts(ctx);
  combine(ctx, out, expert_out);
  record_statistics(ctx, x.size(0));
}

Tensor MoeFfn::router_noise(const LayerContext& ctx, int64_t n) const {
  if (moe_.router_noise <= 0.0 || !noise_enabled_) return Tensor();
  const int64_t e = moe_.num_experts;
  Tensor host({n, e}, DType::kF64);
  // Rows [first_row_, first_row_ + n) of the pass, each from its micro-batch's stream.
  int64_t stream_begin = 0;
  for (const NoiseStream& stream : noise_) {
    const int64_t begin = std::max(first_row_, stream_begin);
    const int64_t end = std::min(first_row_ + n, stream_begin + stream.rows);
    if (begin < end) {
      fill_gaussian(host.ptr<double>() + (begin - first_row_) * e, (begin - stream_begin) * e, (end - begin) * e,
                    moe_.router_noise, stream.seed);
    }
    stream_begin += stream.rows;
  }
  MOETRAIN_ASSERT(stream_begin >= first_row_ + n, "router noise streams cover fewer rows than the pass");
  Tensor staged({n, e}, ctx.accum());
  convert_host(staged, host);
  Tensor noise = ctx.alloc_accum({n, e});
  ctx.backend.copy(noise, staged);
  return noise;
}

void MoeFfn::route(const LayerContext& ctx, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0), e = moe_.num_experts, k = moe_.top_k;
  Saved& s = saved_;
  Tensor logits = ctx.alloc_accum({n, e});  // routing in F32, as transformers does
  be.gemm(GemmArgs{logits, x, router_weight, false, true, 1.0, 0.0});
  Tensor noise = router_noise(ctx, n);
  s.scores = ctx.alloc_accum({n, e});
  s.topk_index = ctx.alloc({n, k}, DType::kI32);
  s.topk_weight = ctx.alloc_accum({n, k});
  RouterArgs route;
  route.scores = s.scores;
  route.topk_index = s.topk_index;
  route.topk_weight = s.topk_weight;
  route.logits = logits;
  if (moe_.score_correction_bias) route.bias = score_bias;
  if (noise.defined()) route.noise = noise;
  route.scoring = scoring_of(moe_);
  route.top_k = k;
  route.num_groups = moe_.num_groups;
  route.topk_groups = moe_.topk_groups;
  route.normalize = moe_.normalize_topk;
  route.scaling = moe_.routed_scaling_factor;
  be.router_forward(route);
}

void MoeFfn::dispatch(const LayerContext& ctx, const TensorView& rows) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = rows.size(0), e = moe_.num_experts, k = moe_.top_k;
  Saved& s = saved_;
  s.expert_offsets = ctx.alloc({e + 1}, DType::kI32);
  s.sorted_pair = ctx.alloc({n * k}, DType::kI32);
  s.pair_row = ctx.alloc({n * k}, DType::kI32);
  be.moe_permutation(MoePermutationArgs{s.expert_offsets, s.sorted_pair, s.pair_row, s.topk_index, e});
  s.routed_x = ctx.alloc({n * k, row_width_});
  be.moe_permute(s.routed_x, rows, s.sorted_pair, k);
  if (!dispatch_) return;
  // The exchange's sizes are host values: the one host synchronization of an expert-parallel
  // layer (a single rank's layer has none).
  Tensor offsets_host({e + 1}, DType::kI32);
  be.copy(offsets_host, s.expert_offsets);
  s.local_offsets = dispatch_->plan(ctx, offsets_host.ptr<int32_t>());
  s.expert_rows = dispatch_->local_offsets();
  s.local_x = ctx.alloc({dispatch_->local_rows(), row_width_});
  dispatch_->to_experts(ctx, s.local_x, s.routed_x);
}

MoeFfn::ExpertRows MoeFfn::expert_rows() const {
  const Saved& s = saved_;
  if (dispatch_) return ExpertRows{s.local_x, GroupOffsets{s.local_offsets, s.expert_rows.data()}};
  return ExpertRows{s.routed_x, GroupOffsets{s.expert_offsets, nullptr}};
}

Tensor MoeFfn::run_experts(const LayerContext& ctx) {
  const ExpertRows rows = expert_rows();
  Tensor out = ctx.alloc({rows.x.size(0), row_width_});
  experts.forward(ctx, out, rows.x, rows.offsets);
  return out;
}

void MoeFfn::combine(const LayerContext& ctx, const TensorView& out, Tensor& expert_out) {
  Saved& s = saved_;
  if (dispatch_) {
    s.routed_out = ctx.alloc({s.routed_x.size(0), row_width_});
    dispatch_->from_experts(ctx, s.routed_out, expert_out);
  } else {
    s.routed_out = std::move(expert_out);
  }
  ctx.backend.moe_combine(MoeCombineArgs{out, s.routed_out, s.topk_weight, s.pair_row});
}

void MoeFfn::record_statistics(const LayerContext& ctx, int64_t n) {
  kernels::Backend& be = ctx.backend;
  const int64_t e = moe_.num_experts;
  Saved& s = saved_;
  if (first_row_ == 0) stats_offsets_.clear();
  stats_offsets_.push_back(ctx.alloc({e + 1}, DType::kI32));
  be.copy(stats_offsets_.back(), s.expert_offsets);
  stats_aux_loss_.reset();
  s.aux_dscores.reset();
  if (moe_.aux_loss_coef > 0.0) {
    // Its statistics are the whole micro-batch's: token chunks cannot compute it (the config
    // rules refuse the pair; this is the model's own guard).
    MOETRAIN_CHECK(first_row_ == 0 && n == ctx.batch.num_tokens, ExitCode::kBadConfig,
                   "the MoE aux loss (model.moe.aux_loss_coef > 0) needs the whole micro-batch at once: "
                   "set parallel.ffn_chunk_tokens to 0 or the aux loss coefficient to 0");
    stats_aux_loss_ = ctx.alloc_accum({1});
    be.fill(stats_aux_loss_, 0.0);
    s.aux_dscores = ctx.alloc_accum({n, e});
    // Micro-batch by micro-batch: an expert window's loss is the sum of its micro-batches' own.
    const std::vector<int64_t>& bounds = ctx.batch.micro_batch_rows;
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      const int64_t begin = bounds[j], end = bounds[j + 1];
      Tensor loss = ctx.alloc_accum({1});
      const TensorView dscores = s.aux_dscores.view().slice_rows(begin, end);
      AuxLossArgs aux;
      aux.loss = loss;
      aux.dscores = dscores;
      aux.scores = s.scores.view().slice_rows(begin, end);
      aux.topk_index = s.topk_index.view().slice_rows(begin, end);
      aux.tokens_per_segment = moe_.aux_loss_type == "batch" ? end - begin : ctx.batch.seq_len;
      aux.coef = moe_.aux_loss_coef;
      be.aux_loss(aux);
      be.axpby(dscores, dscores, 0.0, aux_loss_weight_);
      be.axpby(stats_aux_loss_, loss, aux_loss_weight_, 1.0);
    }
  }
}

void MoeFfn::update_score_bias(kernels::Backend& backend, const std::vector<double>& rows, double rate) {
  const int64_t e = moe_.num_experts;
  MOETRAIN_ASSERT(static_cast<int64_t>(rows.size()) == e, prefix_ + ": expert rows for another number of experts");
  double mean = 0.0;
  for (double r : rows) mean += r;
  mean /= static_cast<double>(e);
  Tensor host({e}, DType::kF64);
  Tensor stored({e}, score_bias.dtype());
  backend.copy(stored, score_bias);
  convert_host(host.view(), stored.view());
  double* bias = host.ptr<double>();
  for (int64_t i = 0; i < e; ++i) {
    const double gap = mean - rows[static_cast<size_t>(i)];
    bias[i] += rate * static_cast<double>((gap > 0) - (gap < 0));
  }
  convert_host(stored.view(), host.view());
  backend.copy(score_bias, stored);
}

FeedForwardStats MoeFfn::expert_loads(const std::vector<int64_t>& counts) {
  FeedForwardStats stats;
  // Max and min over experts of (tokens routed / mean tokens per expert).
  const int64_t e = static_cast<int64_t>(counts.size());
  int64_t pairs = 0, max_count = 0, min_count = INT64_MAX;
  for (int64_t count : counts) {
    pairs += count;
    max_count = std::max(max_count, count);
    min_count = std::min(min_count, count);
  }
  stats.max_expert_load = pairs > 0 ? static_cast<double>(max_count) * e / static_cast<double>(pairs) : 0.0;
  stats.min_expert_load = pairs > 0 ? static_cast<double>(min_count) * e / static_cast<double>(pairs) : 0.0;
  return stats;
}

void MoeFfn::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) {
  backward_shared(ctx, dx, dout, x);
  backward_routed(ctx, dx, dx, dout, /*accumulate_rows=*/true);
}

void MoeFfn::backward_routed(const LayerContext& ctx, const TensorView& dx, const TensorView& drows,
                             const TensorView& dout, bool accumulate_rows) {
  Tensor dtopk_weight = ctx.alloc_accum({dout.size(0), moe_.top_k});
  Tensor dexpert_out = combine_backward(ctx, dtopk_weight, dout);
  Tensor dexpert_x = experts_backward(ctx, dexpert_out);
  dispatch_backward(ctx, drows, dexpert_x, accumulate_rows);
  route_backward(ctx, dx, dtopk_weight);
}

Tensor MoeFfn::combine_backward(const LayerContext& ctx, const TensorView& dtopk_weight, const TensorView& dout) {
  Saved& s = saved_;
  Tensor drouted_out = ctx.alloc({s.routed_out.size(0), row_width_});
  ctx.backend.moe_combine_backward(
      MoeCombineBackwardArgs{drouted_out, dtopk_weight, dout, s.routed_out, s.topk_weight, s.pair_row});
  if (!dispatch_) return drouted_out;
  // The gradients retrace the rows' journey: to the experts' ranks, through the experts, back.
  Tensor dlocal_out = ctx.alloc({dispatch_->local_rows(), row_width_});
  dispatch_->to_experts(ctx, dlocal_out, drouted_out);
  return dlocal_out;
}

Tensor MoeFfn::experts_backward(const LayerContext& ctx, const TensorView& dexpert_out) {
  const ExpertRows rows = expert_rows();
  Tensor dx = ctx.alloc({rows.x.size(0), row_width_});
  experts.backward(ctx, dx, dexpert_out, rows.x, rows.offsets, false);
  return dx;
}

void MoeFfn::dispatch_backward(const LayerContext& ctx, const TensorView& drows, Tensor& dexpert_x,
                               bool accumulate_rows) {
  Saved& s = saved_;
  Tensor drouted_x;
  if (dispatch_) {
    drouted_x = ctx.alloc({s.routed_x.size(0), row_width_});
    dispatch_->from_experts(ctx, drouted_x, dexpert_x);
  } else {
    drouted_x = std::move(dexpert_x);
  }
  ctx.backend.moe_unpermute_sum(drows, drouted_x, s.pair_row, moe_.top_k, accumulate_rows);
}

void MoeFfn::route_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dtopk_weight) {
  Saved& s = saved_;
  Tensor dlogits = ctx.alloc_accum({s.scores.size(0), moe_.num_experts});
  RouterBackwardArgs back;
  back.dlogits = dlogits;
  back.dtopk_weight = dtopk_weight;
  if (s.aux_dscores.defined()) back.dscores_extra = s.aux_dscores;
  back.scores = s.scores;
  back.topk_index = s.topk_index;
  back.scoring = scoring_of(moe_);
  back.normalize = moe_.normalize_topk;
  back.scaling = moe_.routed_scaling_factor;
  ctx.backend.router_backward(back);
  ctx.backend.gemm(GemmArgs{dx, dlogits, router_weight, false, false, 1.0, 1.0});
}

void MoeFfn::release_saved() {
  saved_ = Saved{};  // the statistics stay until read
  experts.release_saved();
  if (shared) shared->release_saved();
}

}  // namespace moetrain
