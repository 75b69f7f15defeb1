// MLA attention on one rank in query blocks x key chunks (parallel.attention_query_block,
// parallel.cp_key_chunk), so that no tensor of the attention is [tokens, heads, ...] but the
// queries and their output: the keys and values of one (query block, key chunk) pair are
// expanded from the latent through kv_b_proj (with its LoRA) at a time. A query block is what a
// context-parallel shard is (ContextShards cut at the block edges), so each block runs the key
// chunks of KeyChunks (attention_context_parallel.h) over the latent rows it sees, [the start of
// its first token's document, its end), read in place: nothing is gathered. The chunks' results
// fold by the log-sum-exp rule (ops.h attention_merge).
//
// The backward walks the same blocks and chunks with the merged out and lse: the flash backward
// is exact per key chunk, dq sums over a block's chunks, and each chunk's dk, dv go through
// kv_b_proj's backward into the latent gradient rows of its keys (summed over the blocks that see
// them) and kv_b_proj's adapter gradients.
#pragma once

#include "core/data/context_shards.h"
#include "core/model/layer_context.h"
#include "core/model/mla_projections.h"

namespace moetrain {

class MlaBlocks {
 public:
  // tokens: the layer's rows (ctx.batch.host_cu_seqlens' last offset); query_block 0: the whole
  // sequence in one block; key_chunk 0: a block's visible rows in chunks of the block's length.
  MlaBlocks(const LayerContext& ctx, const MlaProjections& proj, int64_t tokens, int64_t query_block,
            int64_t key_chunk);

  // out [tokens, heads, v] and lse [tokens, heads] overwritten: q against the keys and values of
  // the latent kv_normed [tokens, kv_rank], k_pe [tokens, rope] (rotated).
  void forward(const TensorView& kv_normed, const TensorView& k_pe, const TensorView& out, const TensorView& lse,
               const TensorView& q) const;
  // dq, dkv_normed, dk_pe overwritten; kv_b_proj's adapter gradients +=.
  void backward(const TensorView& kv_normed, const TensorView& k_pe, const TensorView& dq,
                const TensorView& dkv_normed, const TensorView& dk_pe, const TensorView& dout, const TensorView& q,
                const TensorView& out, const TensorView& lse) const;

 private:
  const LayerContext& ctx_;
  const MlaProjections& proj_;
  ContextShards blocks_;
  int64_t key_chunk_ = 0;
};

}  // namespace moetrain
