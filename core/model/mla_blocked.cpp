// MlaBlocks (see mla_blocked.h).
#include "core/model/mla_blocked.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/model/attention_context_parallel.h"
#include "core/model/mla_context_parallel.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;

namespace {

ContextShards query_blocks(const std::vector<int32_t>& cu, int64_t tokens, int64_t query_block) {
  MOETRAIN_CHECK(!cu.empty() && cu.front() == 0 && cu.back() == tokens, ExitCode::kInternal,
                 "blocked MLA: the host segment offsets do not span the layer's rows");
  const int64_t block = query_block > 0 ? query_block : std::max<int64_t>(tokens, 1);
  std::vector<int64_t> cuts{0};
  for (int64_t at = block; at < tokens; at += block) cuts.push_back(at);
  cuts.push_back(tokens);
  return ContextShards(cu, cuts);
}

// Block r: its rows [begin, end) and the first row its queries see (its first token's document
// start), where KeyChunks' visible row 0 sits.
struct Block {
  int64_t begin = 0, end = 0, seen = 0;
};
Block block(const ContextShards& blocks, int r) {
  const int s = blocks.spans_of(r).front();
  const ContextShards::Span& span = blocks.spans()[static_cast<size_t>(s)];
  return Block{span.begin, span.end, blocks.document_start(s)};
}

}  // namespace

MlaBlocks::MlaBlocks(const LayerContext& ctx, const MlaProjections& proj, int64_t tokens, int64_t query_block,
                     int64_t key_chunk)
    : ctx_(ctx), proj_(proj), blocks_(query_blocks(ctx.batch.host_cu_seqlens, tokens, query_block)),
      key_chunk_(key_chunk) {
  // The CUDA backend's blocked backward does not yet give the whole-sequence run's adapter
  // gradients (docs/PARALLEL.md), so it is refused there rather than training on wrong ones.
  MOETRAIN_CHECK(std::string(ctx.backend.name()) != "cuda", ExitCode::kBadConfig,
                 "parallel.attention_query_block / parallel.cp_key_chunk at parallel.cp 1 (MLA in query blocks) "
                 "runs on the CPU backend only for now: set both to 0 on CUDA");
}

void MlaBlocks::forward(const TensorView& kv_normed, const TensorView& k_pe, const TensorView& out,
                        const TensorView& lse, const TensorView& q) const {
  for (int r = 0; r < blocks_.ranks(); ++r) {
    const Block b = block(blocks_, r);
    const int64_t begin = b.begin, end = b.end, seen = b.seen;
    if (begin == end) continue;
    KeyChunks(ctx_.backend, blocks_, r, key_chunk_)
        .forward(AttentionArgs{out.slice_rows(begin, end), lse.slice_rows(begin, end), q.slice_rows(begin, end), {}, {},
                               {}, proj_.softmax_scale()},
                 [&](int64_t from, int64_t to) {
                   return expand_latent_rows(ctx_, proj_, kv_normed.slice_rows(seen + from, seen + to),
                                             k_pe.slice_rows(seen + from, seen + to));
                 });
  }
}

void MlaBlocks::backward(const TensorView& kv_normed, const TensorView& k_pe, const TensorView& dq,
                         const TensorView& dkv_normed, const TensorView& dk_pe, const TensorView& dout,
                         const TensorView& q, const TensorView& out, const TensorView& lse) const {
  // Key rows are seen by every block from theirs to the end of their document: each chunk's
  // latent gradient is added to theirs.
  ctx_.backend.fill(dkv_normed, 0.0);
  ctx_.backend.fill(dk_pe, 0.0);
  for (int r = 0; r < blocks_.ranks(); ++r) {
    const Block b = block(blocks_, r);
    const int64_t begin = b.begin, end = b.end, seen = b.seen;
    if (begin == end) continue;
    KeyChunks(ctx_.backend, blocks_, r, key_chunk_)
        .backward(
            AttentionBackwardArgs{dq.slice_rows(begin, end), {}, {}, dout.slice_rows(begin, end),
                                  q.slice_rows(begin, end), {}, {}, out.slice_rows(begin, end),
                                  lse.slice_rows(begin, end), {}, proj_.softmax_scale()},
            [&](int64_t from, int64_t to) {
              return expand_latent_rows(ctx_, proj_, kv_normed.slice_rows(seen + from, seen + to),
                                        k_pe.slice_rows(seen + from, seen + to));
            },
            [&](int64_t from, int64_t to, const TensorView& dk, const TensorView& dv) {
              Tensor dkv = ctx_.alloc({to - from, proj_.kv_rank()}), dpe = ctx_.alloc({to - from, proj_.rope_dim()});
              proj_.keys_values_backward(ctx_, dkv, dpe, dk, dv, kv_normed.slice_rows(seen + from, seen + to));
              ctx_.backend.axpby(dkv_normed.slice_rows(seen + from, seen + to), dkv, 1.0, 1.0);
              if (proj_.rope_dim() > 0) ctx_.backend.axpby(dk_pe.slice_rows(seen + from, seen + to), dpe, 1.0, 1.0);
            });
  }
}

}  // namespace moetrain
