// Kimi Delta Attention (the `kda` mixer), as transformers' KimiLinearDeltaAttention and
// Moonshot's KimiDeltaAttention compute it, with H heads of d channels (d_k = d_v = d):
//
//   q, k, v   = q_proj(x), k_proj(x), v_proj(x)            [tokens, H d]   (qkv_proj when fused)
//   q, k, v   = silu(causal depthwise conv(.))              width W, restarting at each document
//   q, k      = l2norm(q), l2norm(k) per head               (eps 1e-6 inside the sqrt)
//   g         = gate(f_b_proj(f_a_proj(x)), A_log, dt_bias) [tokens, H, d] log decay (kda_gate)
//   beta      = sigmoid(b_proj(x))                          [tokens, H]
//   o         = KDA(q, k, v, g, beta, scale d^-1/2)         gated delta rule, state reset per document
//   o         = rmsnorm(o) * o_norm * sigmoid(g_b_proj(g_a_proj(x)))  per head (g_proj when full rank)
//   out       = o_proj(o)
//
// Time segments (parallel.mixer_segment_tokens = S > 0, one rank): the layer runs over the
// sequence in segments of S tokens, in time order, so that its internals exist for one segment at
// a time. Each segment's recurrence starts from the state the one before left (KdaArgs's
// initial_state / final_state; a document start inside or at a segment's first row cuts it as
// cu_seqlens always do), and its short convolutions read the width - 1 rows before it (the halo,
// projected again from the layer input). The forward keeps only the state entering each segment
// ([H, d, d] accum); the backward runs the segments in reverse, recomputing each one's internals
// from the layer input, the recurrence's backward taking the gradient of the state it leaves
// (dfinal_state) and giving that of the state it entered (dinitial_state) to the segment before,
// and the convolutions' gradient for the halo rows waiting for the segment that owns them.
//
// Module names are the released checkpoints' (docs/HF_SEMANTICS.md lists transformers' other
// spellings, which the importers also read). LoRA can sit on every projection; the convs,
// A_log, dt_bias and o_norm are frozen. Gradients flow through all of it into x.
#pragma once

#include <string>
#include <vector>

#include "core/model/kda_context_parallel.h"
#include "core/model/layer.h"
#include "core/model/lora_linear.h"
#include "core/model/model_spec.h"

namespace moetrain {

class KdaAttention final : public Mixer {
 public:
  // segment_tokens: the time segment (parallel.mixer_segment_tokens; 0: the whole sequence).
  KdaAttention(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, int64_t segment_tokens = 0);

  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) override;
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) override;
  void release_saved() override;
  void collect_weights(std::vector<WeightSlot>& out) override;

  // Every projection this layer has, for LoRA targeting by module name.
  std::vector<LoraLinear*> projections() override;

  LoraLinear q_proj, k_proj, v_proj;  // separate projections (fused_qkv false)
  LoraLinear qkv_proj;                // [3 H d, D] (fused_qkv)
  LoraLinear f_a_proj, f_b_proj;      // forget gate: D -> d -> H d
  LoraLinear b_proj;                  // beta: D -> H
  LoraLinear g_a_proj, g_b_proj;      // output gate: D -> d -> H d
  LoraLinear g_proj;                  // full-rank output gate: D -> H d
  LoraLinear o_proj;                  // H d -> D
  // Frozen: the conv weights [channels, W] (q, k, v separately, or one [3 H d, W] when fused),
  // A_log [H] and dt_bias [H d] in the accumulation dtype, o_norm [d].
  Tensor q_conv, k_conv, v_conv, qkv_conv;
  Tensor a_log, dt_bias;
  Tensor o_norm;

 private:
  int64_t heads_, dim_, width_;
  double lower_bound_, norm_eps_;
  bool fused_qkv_, full_rank_gate_;
  std::string prefix_;
  int64_t segment_tokens_;

  // Rows [begin, end) of the layer's tokens and the `halo` rows before them that the short
  // convolutions read; the whole sequence is one span without a halo.
  struct Span {
    int64_t begin = 0, end = 0, halo = 0;
    TensorView conv_cu, kda_cu;  // the segments of rows [begin - halo, end) and of [begin, end)
    bool continues = false;  // `begin` is inside a document: the recurrence starts from a carried state
    int64_t rows() const { return end - begin; }
  };
  Span whole_span(const LayerContext& ctx, int64_t tokens) const;
  // The micro-batch's time segments in order, their offsets in `offsets` on the backend.
  struct TimeSegments {
    std::vector<Span> spans;
    Tensor offsets;
  };
  TimeSegments time_segments(const LayerContext& ctx, int64_t tokens) const;
  bool segmented(const LayerContext& ctx, int64_t tokens) const;
  // The recurrence's states at a span's edges, as KdaArgs / KdaBackwardArgs take them (empty: none).
  struct States {
    TensorView initial, final, dfinal, dinitial;
  };

  int64_t channels() const { return heads_ * dim_; }
  // The span's rows of x [tokens, D] through the layer into saved_; `out` (the span's rows) when
  // given gets o_proj's output (a backward's re-run leaves it out).
  void span_forward(const LayerContext& ctx, const Span& span, const TensorView* out, const TensorView& x,
                    const States& states);
  // dx, dout, x: the whole sequence's (the span's rows of dx are written).
  void span_backward(const LayerContext& ctx, const Span& span, const TensorView& dx, const TensorView& dout,
                     const TensorView& x, const States& states);
  void segmented_forward(const LayerContext& ctx, const TensorView& out, const TensorView& x);
  void segmented_backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x);
  void project_qkv(const LayerContext& ctx, const Span& span, const TensorView& x);
  void qkv_backward(const LayerContext& ctx, const Span& span, const TensorView& dx, const TensorView& dq_conv,
                    const TensorView& dk_conv, const TensorView& dv_conv, const TensorView& x);
  // Time segments: dlin, the convolution input's gradient over the span's rows and halo, takes
  // what later segments left for its rows and leaves its halo's share in `pending`, a
  // [width - 1, channels] buffer of the rows before the span (see the .cpp).
  void carry_halo(const LayerContext& ctx, Tensor& pending, const TensorView& dlin, const Span& span) const;
  // The short convolutions and the recurrence, across the context-parallel group when the
  // micro-batch is split (kda_context_parallel.h), else the backend's own.
  void conv_forward(const LayerContext& ctx, const kernels::ShortConvArgs& args) const;
  void conv_backward(const LayerContext& ctx, const kernels::ShortConvBackwardArgs& args) const;
  void recurrence_forward(const LayerContext& ctx, const kernels::KdaArgs& args);
  void recurrence_backward(const LayerContext& ctx, const kernels::KdaBackwardArgs& args);

  // Time segments: the state entering each segment (undefined where it starts a document), from
  // forward to backward, and the halo gradients of the backward (one per convolution).
  std::vector<Tensor> entering_;
  std::vector<Tensor> halo_pending_;

  // Forward's intermediates, [tokens, ...]; "conv" = after the conv and SiLU.
  struct Saved {
    Tensor q_lin, k_lin, v_lin;  // conv inputs, halo rows first (fused: qkv_lin [halo + tokens, 3 H d])
    Tensor qkv_lin;
    Tensor q_conv, k_conv, v_conv;  // v_conv is KDA's v
    Tensor q_inv_norm, k_inv_norm;  // [tokens * H], accumulation dtype
    Tensor q, k;                    // L2-normalised
    Tensor f_low, f;                // f_a_proj output [tokens, d], f_b_proj output [tokens, H d]
    Tensor g, beta;                 // accumulation dtype
    Tensor attn;                    // KDA output [tokens, H, d]
    Tensor gate_low, gate;          // g_a_proj output [tokens, d] (low rank), gate pre-activation [tokens, H d]
    Tensor norm_rstd;               // [tokens * H]
    Tensor normed;                  // [tokens, H d], o_proj's input
    KdaShardState shard_state;      // context parallelism: the state this shard started from
  } saved_;
};

}  // namespace moetrain
