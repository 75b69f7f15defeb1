// Causal attention over a sequence split across the ranks of a context-parallel group
// (docs/ARCHITECTURE.md §5): queries stay on their rank and attend the keys of their documents up
// to their shard's end, which other ranks hold. KeyChunks runs that attention over those keys a
// chunk of rows at a time, folding the chunks by their log-sum-exp (ops.h attention_merge), so
// that one chunk's keys and values exist at a time; where the keys come from is its caller's:
// MLA layers expand each chunk from the gathered latent (mla_context_parallel.h), and
// AttentionAcrossRanks all-gathers keys and values as they are (padded to the longest shard) and
// reduce-scatters their gradients back to the ranks that own them.
// DSA layers exchange their latent rows and indexer keys the same way (gather_visible_rows).
// The gathers and scatters are the backend's copies and the communicator's collectives, so they
// run where the tensors live (on CUDA, on the backend's stream; the attention with key segments
// then runs on the SIMT kernels, kernels/cuda/attention/attention.cu).
#pragma once

#include <functional>
#include <vector>

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

// The rows of a [tokens, ...] tensor that the queries of shard cp.rank() see: window tokens
// [document_start, end) of that shard, every shard's rows all-gathered (padded to the longest).
// Allocated from and copied by `backend`.
Tensor gather_visible_rows(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                           const TensorView& own);
// `visible`, this rank's gradient of those rows, summed over every rank that saw them into this
// rank's own rows `own` (overwritten): one reduce-scatter.
void return_visible_gradient(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                             const TensorView& visible, const TensorView& own);
// The visible rows' segments, paired with the shard's own (ContextShards::key_cu), as int32 on
// the backend's device.
Tensor visible_key_segments(kernels::Backend& backend, const ContextShards& shards, int rank);
// The int32 offsets `cu` on the backend's device.
Tensor upload_offsets(kernels::Backend& backend, const std::vector<int32_t>& cu);

// This shard's queries against the rows gather_visible_rows lays out (window tokens
// [document_start, end) of the shard), chunk_rows of them at a time.
class KeyChunks {
 public:
  struct Chunk {
    Tensor k, v;  // [rows, heads, qk], [rows, heads, v] of visible rows [from, to)
  };
  using Keys = std::function<Chunk(int64_t from, int64_t to)>;
  // Each chunk's key gradients, dk and dv shaped as its k and v.
  using KeyGradients = std::function<void(int64_t from, int64_t to, const TensorView& dk, const TensorView& dv)>;

  // chunk_rows 0: the longest shard.
  KeyChunks(kernels::Backend& backend, const ContextShards& shards, int rank, int64_t chunk_rows);

  int64_t visible_rows() const { return visible_rows_; }
  // args: the shard's q, out, lse (overwritten), cu_seqlens (its shards.local_cu()) and scale; k,
  // v and the key segments are this class's.
  void forward(const kernels::AttentionArgs& args, const Keys& keys) const;
  // args: dq (overwritten: the sum over the chunks), dout, q and the merged out and lse,
  // cu_seqlens and scale; each chunk's keys are asked for again.
  void backward(const kernels::AttentionBackwardArgs& args, const Keys& keys, const KeyGradients& key_gradients) const;

 private:
  // Visible rows [from, to): their key segments (paired with the shard's own) on the backend's
  // device, and the key_shift that places them (ops.h AttentionArgs::key_shift).
  Tensor segments(int64_t from, int64_t to) const;
  int64_t shift(int64_t from) const { return visible_rows_ - own_rows_ - from; }
  template <typename Body>
  void for_each_chunk(Body&& body) const;

  kernels::Backend& backend_;
  std::vector<int32_t> key_cu_;
  int64_t visible_rows_ = 0, own_rows_ = 0, chunk_rows_ = 0;
};

// Attention whose keys and values travel as they are: all-gathered (padded to the longest shard)
// and attended in chunks (KeyChunks); their gradients reduce-scattered to their owners.
class AttentionAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding shard r of `shards`. Neither is owned.
  // key_chunk: rows of keys attended at a time (0: the longest shard).
  AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                       int64_t key_chunk = 0);

  // args: this shard's rows (q, k, v, out, lse; dq, dk, dv for its own keys), cu_seqlens its
  // shards.local_cu(), no cu_seqlens_k (this class sets it).
  void forward(const kernels::AttentionArgs& args);
  void backward(const kernels::AttentionBackwardArgs& args);

 private:
  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
  int64_t key_chunk_ = 0;
};

}  // namespace moetrain
