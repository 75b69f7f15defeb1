#include "core/model/kda.h"

#include <algorithm>
#include <cmath>

#include "core/base/error.h"

namespace moetrain {

using kernels::CopyColumnsArgs;
using kernels::GatedRmsNormArgs;
using kernels::GatedRmsNormBackwardArgs;
using kernels::KdaArgs;
using kernels::KdaBackwardArgs;
using kernels::KdaGateArgs;
using kernels::KdaGateBackwardArgs;
using kernels::L2NormArgs;
using kernels::L2NormBackwardArgs;
using kernels::ShortConvArgs;
using kernels::ShortConvBackwardArgs;

namespace {

// fla's and transformers' l2norm: x / sqrt(sum x^2 + 1e-6), fixed in both.
constexpr double kL2NormEps = 1e-6;

// [tokens, H, d] or [tokens, H d] as one row per (token, head): what the per-head ops take.
TensorView per_head(const TensorView& t, int64_t dim) { return t.reshaped({t.numel() / dim, dim}); }

}  // namespace

KdaAttention::KdaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, int64_t segment_tokens)
    : segment_tokens_(segment_tokens) {
  const ModelConfig& m = spec.config;
  const KdaConfig& kda = m.kda;
  heads_ = kda.num_heads;
  dim_ = kda.head_dim;
  width_ = kda.conv_width;
  lower_bound_ = kda.lower_bound;
  // Both implementations build o_norm with the model's rms_norm_eps.
  norm_eps_ = m.rms_norm_eps;
  fused_qkv_ = kda.fused_qkv;
  full_rank_gate_ = kda.full_rank_output_gate;
  prefix_ = "model.layers." + std::to_string(layer) + ".self_attn.";

  const int64_t hidden = m.hidden_size;
  const int64_t c = channels();
  auto make = [&](LoraLinear& linear, const char* name, int64_t in, int64_t out) {
    linear = LoraLinear(prefix_ + name, in, out);
    linear.weight = ctx.alloc({out, in});
  };
  if (fused_qkv_) {
    make(qkv_proj, "qkv_proj", hidden, 3 * c);
    qkv_conv = ctx.alloc({3 * c, width_});
  } else {
    make(q_proj, "q_proj", hidden, c);
    make(k_proj, "k_proj", hidden, c);
    make(v_proj, "v_proj", hidden, c);
    q_conv = ctx.alloc({c, width_});
    k_conv = ctx.alloc({c, width_});
    v_conv = ctx.alloc({c, width_});
  }
  make(f_a_proj, "f_a_proj", hidden, dim_);
  make(f_b_proj, "f_b_proj", dim_, c);
  make(b_proj, "b_proj", hidden, heads_);
  if (full_rank_gate_) {
    make(g_proj, "g_proj", hidden, c);
  } else {
    make(g_a_proj, "g_a_proj", hidden, dim_);
    make(g_b_proj, "g_b_proj", dim_, c);
  }
  make(o_proj, "o_proj", c, hidden);
  a_log = ctx.alloc_accum({heads_});
  dt_bias = ctx.alloc_accum({c});
  o_norm = ctx.alloc({dim_});
}

std::vector<LoraLinear*> KdaAttention::projections() {
  std::vector<LoraLinear*> out;
  if (fused_qkv_) out.push_back(&qkv_proj);
  else out.insert(out.end(), {&q_proj, &k_proj, &v_proj});
  out.insert(out.end(), {&f_a_proj, &f_b_proj, &b_proj});
  if (full_rank_gate_) out.push_back(&g_proj);
  else out.insert(out.end(), {&g_a_proj, &g_b_proj});
  out.push_back(&o_proj);
  return out;
}

void KdaAttention::collect_weights(std::vector<WeightSlot>& out) {
  for (LoraLinear* p : projections()) out.push_back({p->name() + ".weight", &p->weight});
  if (fused_qkv_) {
    out.push_back({prefix_ + "qkv_conv1d.weight", &qkv_conv});
  } else {
    out.push_back({prefix_ + "q_conv1d.weight", &q_conv});
    out.push_back({prefix_ + "k_conv1d.weight", &k_conv});
    out.push_back({prefix_ + "v_conv1d.weight", &v_conv});
  }
  out.push_back({prefix_ + "A_log", &a_log});
  out.push_back({prefix_ + "dt_bias", &dt_bias});
  out.push_back({prefix_ + "o_norm.weight", &o_norm});
}

KdaAttention::Span KdaAttention::whole_span(const LayerContext& ctx, int64_t tokens) const {
  Span span;
  span.end = tokens;
  span.conv_cu = ctx.batch.cu_seqlens;
  span.kda_cu = ctx.batch.cu_seqlens;
  return span;
}

namespace {

// The batch's segment offsets cut to rows [first, last), from 0, appended to `out`.
void cut_segments(const std::vector<int32_t>& cu, int64_t first, int64_t last, std::vector<int32_t>& out) {
  out.push_back(0);
  for (int32_t c : cu) {
    if (c > first && c < last && c - first > out.back()) out.push_back(static_cast<int32_t>(c - first));
  }
  out.push_back(static_cast<int32_t>(last - first));
}

}  // namespace

// Every segment's offsets go to the backend in one copy: a copy from the host waits for the
// device's queue to drain, once per layer pass rather than once per segment.
KdaAttention::TimeSegments KdaAttention::time_segments(const LayerContext& ctx, int64_t tokens) const {
  const std::vector<int32_t>& cu = ctx.batch.host_cu_seqlens;
  MOETRAIN_CHECK(!cu.empty() && cu.back() == tokens, ExitCode::kInternal,
                 "KDA time segments need the batch's cu_seqlens on the host (BatchTensors::host_cu_seqlens)");
  TimeSegments segments;
  std::vector<int32_t> offsets;
  struct Cut {
    size_t conv, kda, end;  // where the span's conv offsets, KDA offsets and the next span's start
  };
  std::vector<Cut> cuts;
  for (int64_t begin = 0; begin < tokens; begin += segment_tokens_) {
    Span span;
    span.begin = begin;
    span.end = std::min(tokens, begin + segment_tokens_);
    span.halo = std::min(width_ - 1, begin);
    span.continues = begin > 0 && std::find(cu.begin(), cu.end(), static_cast<int32_t>(begin)) == cu.end();
    Cut cut;
    cut.conv = offsets.size();
    cut_segments(cu, begin - span.halo, span.end, offsets);
    cut.kda = offsets.size();
    cut_segments(cu, begin, span.end, offsets);
    cut.end = offsets.size();
    segments.spans.push_back(span);
    cuts.push_back(cut);
  }
  Tensor host({static_cast<int64_t>(offsets.size())}, DType::kI32);
  std::copy(offsets.begin(), offsets.end(), host.ptr<int32_t>());
  segments.offsets = ctx.alloc(host.shape(), DType::kI32);
  ctx.backend.copy(segments.offsets, host);
  for (size_t i = 0; i < cuts.size(); ++i) {
    const auto at = [&](size_t first, size_t last) {
      return segments.offsets.view().slice_rows(static_cast<int64_t>(first), static_cast<int64_t>(last));
    };
    segments.spans[i].conv_cu = at(cuts[i].conv, cuts[i].kda);
    segments.spans[i].kda_cu = at(cuts[i].kda, cuts[i].end);
  }
  return segments;
}

bool KdaAttention::segmented(const LayerContext& ctx, int64_t tokens) const {
  if (segment_tokens_ <= 0 || tokens <= segment_tokens_) return false;
  MOETRAIN_CHECK(!ctx.context_parallel(), ExitCode::kBadConfig,
                 prefix_ + ": KDA time segments (parallel.mixer_segment_tokens) cannot run on a context-parallel "
                           "shard; set parallel.mixer_segment_tokens to 0 or parallel.cp to 1");
  return true;
}

// q, k, v after projection, conv and SiLU, into saved_.{q,k,v}_conv [rows, H d]; the conv
// inputs keep the halo rows in front.
void KdaAttention::project_qkv(const LayerContext& ctx, const Span& span, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = span.rows(), halo = span.halo;
  const TensorView x_ext = x.slice_rows(span.begin - halo, span.end);
  const int64_t c = channels();
  Saved& s = saved_;
  s.q_conv = ctx.alloc({n, c});
  s.k_conv = ctx.alloc({n, c});
  s.v_conv = ctx.alloc({n, c});
  if (fused_qkv_) {
    s.qkv_lin = ctx.alloc({halo + n, 3 * c});
    qkv_proj.forward(ctx, s.qkv_lin, x_ext);
    Tensor conv = ctx.alloc({halo + n, 3 * c});
    conv_forward(ctx, ShortConvArgs{conv, s.qkv_lin, qkv_conv, span.conv_cu, true});
    const TensorView rows = conv.view().slice_rows(halo, halo + n);
    Tensor* parts[3] = {&s.q_conv, &s.k_conv, &s.v_conv};
    for (int64_t j = 0; j < 3; ++j) be.copy_columns(CopyColumnsArgs{*parts[j], rows, 0, j * c, c, 1, false});
    return;
  }
  struct Stream {
    const LoraLinear& proj;
    Tensor& lin;
    const Tensor& weight;
    Tensor& conv;
  };
  for (Stream st : {Stream{q_proj, s.q_lin, q_conv, s.q_conv}, Stream{k_proj, s.k_lin, k_conv, s.k_conv},
                    Stream{v_proj, s.v_lin, v_conv, s.v_conv}}) {
    st.lin = ctx.alloc({halo + n, c});
    st.proj.forward(ctx, st.lin, x_ext);
    if (halo == 0) {
      conv_forward(ctx, ShortConvArgs{st.conv, st.lin, st.weight, span.conv_cu, true});
      continue;
    }
    Tensor conv = ctx.alloc({halo + n, c});
    conv_forward(ctx, ShortConvArgs{conv, st.lin, st.weight, span.conv_cu, true});
    be.copy(st.conv, conv.view().slice_rows(halo, halo + n));
  }
}

void KdaAttention::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  if (segmented(ctx, x.size(0))) return segmented_forward(ctx, out, x);
  span_forward(ctx, whole_span(ctx, x.size(0)), &out, x, States{});
}

void KdaAttention::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  if (segmented(ctx, x.size(0))) return segmented_backward(ctx, dx, dout, x);
  span_backward(ctx, whole_span(ctx, x.size(0)), dx, dout, x, States{});
}

void KdaAttention::segmented_forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  const int64_t n = x.size(0);
  entering_.clear();
  Tensor leaving;  // the state after the last segment run
  const TimeSegments segments = time_segments(ctx, n);
  for (const Span& span : segments.spans) {
    Tensor entering = span.continues ? std::move(leaving) : Tensor();
    leaving = ctx.alloc_accum({heads_, dim_, dim_});
    const TensorView rows = out.slice_rows(span.begin, span.end);
    span_forward(ctx, span, &rows, x, States{entering, leaving, {}, {}});
    entering_.push_back(std::move(entering));
    saved_ = Saved{};
  }
}

void KdaAttention::segmented_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                                      const TensorView& x) {
  const TimeSegments segments = time_segments(ctx, x.size(0));
  MOETRAIN_CHECK(entering_.size() == segments.spans.size(), ExitCode::kInternal,
                 prefix_ + ": a segmented KDA backward without its forward's entering states");
  halo_pending_.clear();
  halo_pending_.resize(fused_qkv_ ? 1 : 3);
  Tensor dleaving;  // the gradient of the state leaving the segment run next (undefined: none)
  for (size_t i = segments.spans.size(); i-- > 0;) {
    const Span& span = segments.spans[i];
    span_forward(ctx, span, nullptr, x, States{entering_[i], {}, {}, {}});
    Tensor dentering = span.continues ? ctx.alloc_accum({heads_, dim_, dim_}) : Tensor();
    span_backward(ctx, span, dx, dout, x, States{entering_[i], {}, dleaving, dentering});
    saved_ = Saved{};
    dleaving = std::move(dentering);
  }
  halo_pending_.clear();
}

void KdaAttention::span_forward(const LayerContext& ctx, const Span& span, const TensorView* out, const TensorView& x_all,
                                const States& states) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = span.rows();
  const int64_t c = channels();
  const TensorView x = x_all.slice_rows(span.begin, span.end);
  Saved& s = saved_;

  project_qkv(ctx, span, x_all);
  s.q = ctx.alloc({n, heads_, dim_});
  s.k = ctx.alloc({n, heads_, dim_});
  s.q_inv_norm = ctx.alloc_accum({n * heads_});
  s.k_inv_norm = ctx.alloc_accum({n * heads_});
  be.l2norm_forward(L2NormArgs{per_head(s.q, dim_), s.q_inv_norm, per_head(s.q_conv, dim_),
                               kL2NormEps});
  be.l2norm_forward(L2NormArgs{per_head(s.k, dim_), s.k_inv_norm, per_head(s.k_conv, dim_),
                               kL2NormEps});

  // The per-channel log decay and the per-head write strength.
  s.f_low = ctx.alloc({n, dim_});
  f_a_proj.forward(ctx, s.f_low, x);
  s.f = ctx.alloc({n, c});
  f_b_proj.forward(ctx, s.f, s.f_low);
  s.g = ctx.alloc_accum({n, heads_, dim_});
  be.kda_gate_forward(KdaGateArgs{s.g, s.f, a_log, dt_bias, lower_bound_});
  Tensor beta_logits = ctx.alloc({n, heads_});
  b_proj.forward(ctx, beta_logits, x);
  s.beta = ctx.alloc_accum({n, heads_});
  be.sigmoid_forward(s.beta, beta_logits);

  s.attn = ctx.alloc({n, heads_, dim_});
  recurrence_forward(ctx, KdaArgs{s.attn, s.q, s.k, s.v_conv.view().reshaped({n, heads_, dim_}), s.g, s.beta,
                                  span.kda_cu, 1.0 / std::sqrt(static_cast<double>(dim_)), states.initial,
                                  states.final});

  // Head-wise RMSNorm gated by sigmoid(output gate), then o_proj.
  s.gate = ctx.alloc({n, c});
  if (full_rank_gate_) {
    g_proj.forward(ctx, s.gate, x);
  } else {
    s.gate_low = ctx.alloc({n, dim_});
    g_a_proj.forward(ctx, s.gate_low, x);
    g_b_proj.forward(ctx, s.gate, s.gate_low);
  }
  s.norm_rstd = ctx.alloc_accum({n * heads_});
  s.normed = ctx.alloc({n, c});
  be.gated_rmsnorm_forward(GatedRmsNormArgs{per_head(s.normed, dim_), s.norm_rstd,
                                            per_head(s.attn, dim_), per_head(s.gate, dim_),
                                            o_norm, norm_eps_});
  if (out != nullptr) o_proj.forward(ctx, *out, s.normed);
}

// From the gradients after the conv + SiLU back through the convs and q/k/v projections; adds
// into dx's rows of the span.
void KdaAttention::qkv_backward(const LayerContext& ctx, const Span& span, const TensorView& dx_all,
                                const TensorView& dq_conv, const TensorView& dk_conv, const TensorView& dv_conv,
                                const TensorView& x_all) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = span.rows(), halo = span.halo;
  const int64_t c = channels();
  const TensorView x = x_all.slice_rows(span.begin, span.end);
  const TensorView dx = dx_all.slice_rows(span.begin, span.end);
  Saved& s = saved_;
  // No gradient arrives at the halo rows' outputs (the segments before own them).
  auto backward_conv = [&](const TensorView& dconv, const Tensor& lin, const Tensor& weight, const LoraLinear& proj,
                           size_t stream) {
    Tensor dlin = ctx.alloc({halo + n, dconv.size(1)});
    if (halo == 0) {
      conv_backward(ctx, ShortConvBackwardArgs{dlin, {}, dconv, lin, weight, span.conv_cu, true});
    } else {
      Tensor dy = ctx.alloc({halo + n, dconv.size(1)});
      be.fill(dy.view().slice_rows(0, halo), 0.0);
      be.copy(dy.view().slice_rows(halo, halo + n), dconv);
      conv_backward(ctx, ShortConvBackwardArgs{dlin, {}, dy, lin, weight, span.conv_cu, true});
    }
    if (!halo_pending_.empty()) carry_halo(ctx, halo_pending_[stream], dlin, span);
    proj.backward(ctx, dx, dlin.view().slice_rows(halo, halo + n), x, true);
  };
  if (fused_qkv_) {
    Tensor dconv = ctx.alloc({n, 3 * c});
    const TensorView parts[3] = {dq_conv, dk_conv, dv_conv};
    for (int64_t j = 0; j < 3; ++j) be.copy_columns(CopyColumnsArgs{dconv, parts[j], j * c, 0, c, 1, false});
    backward_conv(dconv, s.qkv_lin, qkv_conv, qkv_proj, 0);
    return;
  }
  backward_conv(dq_conv, s.q_lin, q_conv, q_proj, 0);
  backward_conv(dk_conv, s.k_lin, k_conv, k_proj, 1);
  backward_conv(dv_conv, s.v_lin, v_conv, v_proj, 2);
}

// `pending` holds, for the rows [end - reach, end) before the segments already run (reach =
// width - 1), the gradient their convolutions sent back: the span adds the part on its own rows
// to dlin, and leaves for the rows [begin - reach, begin) its halo's gradient plus what is still
// pending there (a span shorter than reach passes part of the old buffer on).
void KdaAttention::carry_halo(const LayerContext& ctx, Tensor& pending, const TensorView& dlin, const Span& span) const {
  kernels::Backend& be = ctx.backend;
  const int64_t reach = width_ - 1;
  if (reach == 0) return;
  const int64_t begin = span.begin, end = span.end, first = begin - span.halo;  // dlin's first row
  if (pending.defined()) {
    const int64_t from = std::max(begin, end - reach);
    be.axpby(dlin.slice_rows(from - first, end - first), pending.view().slice_rows(from - (end - reach), reach), 1.0,
             1.0);
  }
  Tensor next = ctx.alloc({reach, dlin.size(1)});
  be.fill(next, 0.0);
  if (span.halo > 0) be.copy(next.view().slice_rows(reach - span.halo, reach), dlin.slice_rows(0, span.halo));
  const int64_t from = std::max<int64_t>(0, end - reach);  // the old buffer's rows before `begin`
  if (pending.defined() && from < begin) {
    be.axpby(next.view().slice_rows(from - (begin - reach), reach),
             pending.view().slice_rows(from - (end - reach), begin - (end - reach)), 1.0, 1.0);
  }
  pending = std::move(next);
}

void KdaAttention::span_backward(const LayerContext& ctx, const Span& span, const TensorView& dx_all,
                                 const TensorView& dout_all, const TensorView& x_all, const States& states) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = span.rows();
  const int64_t c = channels();
  const TensorView x = x_all.slice_rows(span.begin, span.end);
  const TensorView dx = dx_all.slice_rows(span.begin, span.end);
  const TensorView dout = dout_all.slice_rows(span.begin, span.end);
  Saved& s = saved_;

  // o_proj and the gated norm; the output gate's branch writes dx first.
  Tensor dnormed = ctx.alloc({n, c});
  o_proj.backward(ctx, dnormed, dout, s.normed, false);
  Tensor dattn = ctx.alloc({n, heads_, dim_});
  Tensor dgate = ctx.alloc({n, c});
  be.gated_rmsnorm_backward(GatedRmsNormBackwardArgs{
      per_head(dattn, dim_), per_head(dgate, dim_), {}, per_head(dnormed, dim_),
      per_head(s.attn, dim_), per_head(s.gate, dim_), o_norm, s.norm_rstd});
  if (full_rank_gate_) {
    g_proj.backward(ctx, dx, dgate, x, false);
  } else {
    Tensor dgate_low = ctx.alloc({n, dim_});
    g_b_proj.backward(ctx, dgate_low, dgate, s.gate_low, false);
    g_a_proj.backward(ctx, dx, dgate_low, x, false);
  }

  // The recurrence.
  Tensor dq = ctx.alloc({n, heads_, dim_});
  Tensor dk = ctx.alloc({n, heads_, dim_});
  Tensor dv = ctx.alloc({n, c});
  Tensor dg = ctx.alloc_accum({n, heads_, dim_});
  Tensor dbeta = ctx.alloc_accum({n, heads_});
  recurrence_backward(ctx, KdaBackwardArgs{dq, dk, dv.view().reshaped({n, heads_, dim_}), dg, dbeta, dattn, s.q,
                                           s.k, s.v_conv.view().reshaped({n, heads_, dim_}), s.g, s.beta,
                                           span.kda_cu, 1.0 / std::sqrt(static_cast<double>(dim_)), states.initial,
                                           states.dfinal, states.dinitial});

  // Beta and the forget gate, into dx.
  Tensor dbeta_logits = ctx.alloc({n, heads_});
  be.sigmoid_backward(dbeta_logits, dbeta, s.beta);
  b_proj.backward(ctx, dx, dbeta_logits, x, true);
  Tensor df = ctx.alloc({n, c});
  be.kda_gate_backward(KdaGateBackwardArgs{df, dg, s.f, a_log, dt_bias, lower_bound_});
  Tensor df_low = ctx.alloc({n, dim_});
  f_b_proj.backward(ctx, df_low, df, s.f_low, false);
  f_a_proj.backward(ctx, dx, df_low, x, true);

  // The L2 norms, then the convs and projections.
  Tensor dq_conv = ctx.alloc({n, c});
  Tensor dk_conv = ctx.alloc({n, c});
  be.l2norm_backward(L2NormBackwardArgs{per_head(dq_conv, dim_), per_head(dq, dim_),
                                        per_head(s.q_conv, dim_), s.q_inv_norm});
  be.l2norm_backward(L2NormBackwardArgs{per_head(dk_conv, dim_), per_head(dk, dim_),
                                        per_head(s.k_conv, dim_), s.k_inv_norm});
  qkv_backward(ctx, span, dx_all, dq_conv, dk_conv, dv, x_all);
}

void KdaAttention::conv_forward(const LayerContext& ctx, const ShortConvArgs& args) const {
  if (!ctx.context_parallel()) return ctx.backend.short_conv_forward(args);
  ShortConvAcrossRanks(ctx.backend, *ctx.context_group, *ctx.batch.context, width_).forward(args);
}

void KdaAttention::conv_backward(const LayerContext& ctx, const ShortConvBackwardArgs& args) const {
  if (!ctx.context_parallel()) return ctx.backend.short_conv_backward(args);
  ShortConvAcrossRanks(ctx.backend, *ctx.context_group, *ctx.batch.context, width_).backward(args);
}

void KdaAttention::recurrence_forward(const LayerContext& ctx, const KdaArgs& args) {
  if (!ctx.context_parallel()) return ctx.backend.kda_forward(args);
  KdaAcrossRanks(ctx.backend, *ctx.context_group, *ctx.batch.context).forward(args, &saved_.shard_state);
}

void KdaAttention::recurrence_backward(const LayerContext& ctx, const KdaBackwardArgs& args) {
  if (!ctx.context_parallel()) return ctx.backend.kda_backward(args);
  KdaAcrossRanks(ctx.backend, *ctx.context_group, *ctx.batch.context).backward(args, saved_.shard_state);
}

void KdaAttention::release_saved() {
  saved_ = Saved{};
  entering_.clear();
}

}  // namespace moetrain
