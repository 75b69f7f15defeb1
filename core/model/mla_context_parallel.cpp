// MlaAcrossRanks (see mla_context_parallel.h).
#include "core/model/mla_context_parallel.h"

#include "core/base/error.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;

namespace {

const ContextShards& checked_shards(const LayerContext& ctx) {
  MOETRAIN_CHECK(ctx.context_parallel() && ctx.context_group != nullptr, ExitCode::kInternal,
                 "MLA across ranks without a context-parallel batch and group");
  return *ctx.batch.context;
}

}  // namespace

MlaAcrossRanks::MlaAcrossRanks(const LayerContext& ctx, const MlaProjections& proj)
    : ctx_(ctx),
      proj_(proj),
      chunks_(ctx.backend, checked_shards(ctx), ctx.context_group->rank(), ctx.context_key_chunk) {}

MlaAcrossRanks::Latent MlaAcrossRanks::gather(const TensorView& kv_normed, const TensorView& k_pe) const {
  kernels::Backend& be = ctx_.backend;
  Communicator& cp = *ctx_.context_group;
  const ContextShards& shards = *ctx_.batch.context;
  Latent visible;
  visible.kv_normed = gather_visible_rows(be, cp, shards, kv_normed);
  // A model without a rope part has no k_pe columns to send.
  visible.k_pe = proj_.rope_dim() > 0 ? gather_visible_rows(be, cp, shards, k_pe)
                                      : ctx_.alloc({chunks_.visible_rows(), 0});
  return visible;
}

KeyChunks::Chunk expand_latent_rows(const LayerContext& ctx, const MlaProjections& proj, const TensorView& kv_normed,
                                    const TensorView& k_pe) {
  const int64_t rows = kv_normed.size(0);
  KeyChunks::Chunk chunk{ctx.alloc({rows, proj.heads(), proj.qk_dim()}), ctx.alloc({rows, proj.heads(), proj.v_dim()})};
  proj.keys_values(ctx, chunk.k, chunk.v, kv_normed, k_pe);
  return chunk;
}

KeyChunks::Chunk MlaAcrossRanks::expand(const Latent& visible, int64_t from, int64_t to) const {
  return expand_latent_rows(ctx_, proj_, visible.kv_normed.view().slice_rows(from, to),
                            visible.k_pe.view().slice_rows(from, to));
}

void MlaAcrossRanks::forward(const Latent& visible, const TensorView& out, const TensorView& lse,
                             const TensorView& q) const {
  chunks_.forward(AttentionArgs{out, lse, q, {}, {}, ctx_.batch.cu_seqlens, proj_.softmax_scale()},
                  [&](int64_t from, int64_t to) { return expand(visible, from, to); });
}

void MlaAcrossRanks::backward(const Latent& visible, const TensorView& dq, const TensorView& dkv_normed,
                              const TensorView& dk_pe, const TensorView& dout, const TensorView& q,
                              const TensorView& out, const TensorView& lse) const {
  // Every visible row belongs to one chunk: each chunk writes its rows of the latent gradient, and
  // kv_b_proj's adapter gradient takes this rank's share of each row once.
  Tensor dkv_visible = ctx_.alloc(visible.kv_normed.shape()), dk_pe_visible = ctx_.alloc(visible.k_pe.shape());
  chunks_.backward(
      AttentionBackwardArgs{dq, {}, {}, dout, q, {}, {}, out, lse, ctx_.batch.cu_seqlens, proj_.softmax_scale()},
      [&](int64_t from, int64_t to) { return expand(visible, from, to); },
      [&](int64_t from, int64_t to, const TensorView& dk, const TensorView& dv) {
        proj_.keys_values_backward(ctx_, dkv_visible.view().slice_rows(from, to),
                                   dk_pe_visible.view().slice_rows(from, to), dk, dv,
                                   visible.kv_normed.view().slice_rows(from, to));
      });
  Communicator& cp = *ctx_.context_group;
  const ContextShards& shards = *ctx_.batch.context;
  return_visible_gradient(ctx_.backend, cp, shards, dkv_visible, dkv_normed);
  if (proj_.rope_dim() > 0) return_visible_gradient(ctx_.backend, cp, shards, dk_pe_visible, dk_pe);
}

}  // namespace moetrain
