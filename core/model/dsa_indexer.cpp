#include "core/model/dsa_indexer.h"

#include "core/model/attention_context_parallel.h"
#include "core/model/fp8_storage.h"

#include <algorithm>
#include <cmath>

namespace moetrain {

using kernels::DsaIndexerArgs;
using kernels::GemmArgs;
using kernels::LayerNormArgs;
using kernels::RopeArgs;

namespace {

// transformers' k_norm = nn.LayerNorm(index_head_dim, eps=1e-6), whatever rms_norm_eps is.
constexpr double kKeyNormEps = 1e-6;

}  // namespace

DsaIndexer::DsaIndexer(const ModelSpec& spec, int64_t layer, const LayerContext& ctx, const RopeDeviceTables* rope)
    : rope_(rope) {
  const ModelConfig& m = spec.config;
  const DsaConfig& dsa = m.dsa;
  heads_ = dsa.index_n_heads;
  head_dim_ = dsa.index_head_dim;
  top_k_ = dsa.index_topk;
  rope_dim_ = rope ? m.mla.qk_rope_head_dim : 0;
  rope_layout_ = dsa.indexer_rope_interleave ? kernels::RopeLayout::kInterleaved : kernels::RopeLayout::kHalfSplit;
  prefix_ = "model.layers." + std::to_string(layer) + ".self_attn.indexer.";
  MOETRAIN_ASSERT(m.mla.q_lora_rank.has_value(), "a dsa layer needs MLA's q latent (config rules check this)");
  alloc_frozen_weight(ctx, {heads_ * head_dim_, *m.mla.q_lora_rank}, keeps_fp8(m, prefix_ + "wq_b"), wq_b, wq_b_scale);
  alloc_frozen_weight(ctx, {head_dim_, m.hidden_size}, keeps_fp8(m, prefix_ + "wk"), wk, wk_scale);
  k_norm_weight = ctx.alloc({head_dim_});
  k_norm_bias = ctx.alloc({head_dim_});
  weights_proj = ctx.alloc({heads_, m.hidden_size});
}

void DsaIndexer::collect_weights(std::vector<WeightSlot>& out) {
  auto scale_of = [](Tensor& weight, Tensor& scale) { return weight.dtype() == DType::kU8 ? &scale : nullptr; };
  out.push_back({prefix_ + "wq_b.weight", &wq_b, WeightLayout::kPlain, 0, scale_of(wq_b, wq_b_scale)});
  out.push_back({prefix_ + "wk.weight", &wk, WeightLayout::kPlain, 0, scale_of(wk, wk_scale)});
  out.push_back({prefix_ + "k_norm.weight", &k_norm_weight});
  out.push_back({prefix_ + "k_norm.bias", &k_norm_bias});
  out.push_back({prefix_ + "weights_proj.weight", &weights_proj});
}

Tensor DsaIndexer::select(const LayerContext& ctx, const TensorView& x, const TensorView& q_latent) const {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  Tensor q = ctx.alloc({n, heads_, head_dim_});
  frozen_gemm(be, GemmArgs{q.view().reshaped({n, heads_ * head_dim_}), q_latent, wq_b, false, true, 1.0, 0.0},
              wq_b_scale);
  Tensor k = ctx.alloc({n, head_dim_});
  frozen_gemm(be, GemmArgs{k, x, wk, false, true, 1.0, 0.0}, wk_scale);
  be.layernorm_forward(LayerNormArgs{k, k, k_norm_weight, k_norm_bias, kKeyNormEps});
  if (rope_dim_ > 0) {
    TensorView q_rows = q.view().reshaped({n * heads_, head_dim_});
    RopeArgs q_rope{q_rows, q_rows, ctx.batch.positions, rope_->cos, rope_->sin, heads_, 0, rope_dim_, rope_layout_};
    be.rope(q_rope);
    be.rope(RopeArgs{k, k, ctx.batch.positions, rope_->cos, rope_->sin, 1, 0, rope_dim_, rope_layout_});
  }
  // The head weights in the accumulation dtype (transformers keeps weights_proj in fp32).
  Tensor weights = ctx.alloc_accum({n, heads_});
  be.gemm(GemmArgs{weights, x, weights_proj, false, true, 1.0, 0.0});
  // No query has more keys than a window's tokens: a longer list would only hold padding.
  const int64_t top_k = ctx.batch.seq_len > 0 ? std::min(top_k_, ctx.batch.seq_len) : top_k_;
  Tensor selected = ctx.alloc({n, top_k}, DType::kI32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_) * static_cast<double>(heads_));
  if (!ctx.context_parallel()) {
    be.dsa_indexer_topk(DsaIndexerArgs{selected, q, k, weights, ctx.batch.cu_seqlens, top_k, scale});
    return selected;
  }
  // Context parallelism: each span of this rank scores the keys of its documents up to its end,
  // from every rank; its selection lists rows of those keys, counted from the first
  // (DsaAttention gathers its latent rows alike and attends span by span).
  const Tensor keys = gather_visible_rows(be, *ctx.context_group, *ctx.batch.context, k);
  for (const SpanQueries& p : span_queries(be, *ctx.batch.context, ctx.context_group->rank())) {
    const Tensor key_segments = upload_offsets(be, p.key_cu);
    auto rows = [&](const Tensor& t) { return t.view().slice_rows(p.row, p.row + p.tokens); };
    be.dsa_indexer_topk(DsaIndexerArgs{rows(selected), rows(q), keys.view().slice_rows(p.key_from, p.key_to),
                                       rows(weights), p.cu, top_k, scale, key_segments});
  }
  return selected;
}

}  // namespace moetrain
