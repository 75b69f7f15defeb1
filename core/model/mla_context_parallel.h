// MLA attention over a sequence split across the ranks of a context-parallel group
// (docs/PARALLEL.md, "Context parallelism"). Queries stay on their rank. What travels is each key
// row's compressed latent, kv_normed [kv_rank] and the rotated k_pe [rope] (576 values a token at
// Kimi K3, against heads x (nope + rope + v) = 96 x 320 = 30,720 for the expanded keys and
// values), all-gathered as gather_visible_rows does. Each rank expands the rows its queries see through kv_b_proj (with
// its LoRA) itself, parallel.cp_key_chunk rows at a time, and folds each chunk's attention into
// the result by the log-sum-exp rule (KeyChunks, attention_context_parallel.h): the expanded keys
// and values of one chunk are alive at a time, never those of the whole window.
//
// The backward walks the same chunks with the merged out and lse (the flash backward is exact per
// chunk: dk, dv of the chunk's keys, dq summed over the chunks). kv_b_proj's adapter gradient
// takes this rank's queries' share of every visible row, and the latent gradients go back to
// their owners (return_visible_gradient, one reduce-scatter each): each (key row, query rank)
// pair reaches the adapter gradient once, summed over the ranks as every adapter gradient is,
// and each row's latent gradient reaches its owner once.
//
// The gathered latent is kept from forward to backward rather than gathered again: visible rows x
// (kv_rank + rope) per layer, below the own rows' expanded keys and values a single-rank layer
// keeps (rows x heads x (qk + v)) for any cp up to 30,720 / 576 = 53 at K3, and one all-gather
// fewer per layer.
#pragma once

#include "core/model/attention_context_parallel.h"
#include "core/model/layer_context.h"
#include "core/model/mla_projections.h"

namespace moetrain {

// The keys and values of latent rows kv_normed [rows, kv_rank], k_pe [rows, rope], expanded
// through kv_b_proj into fresh tensors: a key chunk, here and on one rank (mla_blocked.h).
KeyChunks::Chunk expand_latent_rows(const LayerContext& ctx, const MlaProjections& proj, const TensorView& kv_normed,
                                    const TensorView& k_pe);

class MlaAcrossRanks {
 public:
  // The latent rows the queries of this rank see, in its visible layout (ContextShards::visible_ranges).
  struct Latent {
    Tensor kv_normed;  // [visible, kv_rank]
    Tensor k_pe;       // [visible, rope], rotated
  };

  // ctx.context_parallel() must hold; the chunk is ctx.context_key_chunk (0: the longest shard).
  MlaAcrossRanks(const LayerContext& ctx, const MlaProjections& proj);

  // Every shard's own rows all-gathered into the rows this rank's queries see.
  Latent gather(const TensorView& kv_normed, const TensorView& k_pe) const;
  // out [tokens, heads, v] and lse [tokens, heads] overwritten: this shard's queries q against
  // the visible keys.
  void forward(const Latent& visible, const TensorView& out, const TensorView& lse, const TensorView& q) const;
  // dq overwritten; dkv_normed [tokens, kv_rank] and dk_pe [tokens, rope] overwritten with the
  // gradients of this rank's own latent rows, summed over every rank that saw them; kv_b_proj's
  // adapter gradients +=.
  void backward(const Latent& visible, const TensorView& dq, const TensorView& dkv_normed, const TensorView& dk_pe,
                const TensorView& dout, const TensorView& q, const TensorView& out, const TensorView& lse) const;

 private:
  // The chunk's keys and values, expanded from visible latent rows [from, to).
  KeyChunks::Chunk expand(const Latent& visible, int64_t from, int64_t to) const;

  const LayerContext& ctx_;
  const MlaProjections& proj_;
  KeyChunks chunks_;
};

}  // namespace moetrain
