// Causal attention over a sequence split across the ranks of a context-parallel group
// (docs/PARALLEL.md, "Context parallelism"): queries stay on their rank and attend the keys of
// their documents up to their span's end, which other ranks hold. A rank holds one span of the
// window (parallel.cp_layout contiguous) or two per window (balanced); its visible rows are the
// window tokens any of its spans sees (ContextShards::visible_ranges), and each span attends its
// own part of them, a prefix of its documents in window order. KeyChunks runs that attention over
// the visible rows a chunk at a time, each chunk once for every span that sees some of it, folding
// the chunks by their log-sum-exp (ops.h attention_merge), so that one chunk's keys and values
// exist at a time; where the keys come from is its caller's: MLA layers expand each chunk from the
// gathered latent (mla_context_parallel.h), and AttentionAcrossRanks all-gathers keys and values
// as they are (padded to the longest shard) and reduce-scatters their gradients back to the ranks
// that own them. DSA layers exchange their latent rows and indexer keys the same way
// (gather_visible_rows).
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

// The rows of a [tokens, ...] tensor that the queries of rank cp.rank() see, in its visible
// layout (ContextShards::visible_ranges), every rank's rows all-gathered (padded to the longest).
// Allocated from and copied by `backend`.
Tensor gather_visible_rows(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                           const TensorView& own);
// `visible`, this rank's gradient of those rows, summed over every rank that saw them into this
// rank's own rows `own` (overwritten): one reduce-scatter.
void return_visible_gradient(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                             const TensorView& visible, const TensorView& own);
// int32 offsets on the backend's device.
Tensor upload_offsets(kernels::Backend& backend, const std::vector<int32_t>& cu);

// Where one of a rank's spans sits: its queries at the rank's rows [row, row + tokens), its
// keys at visible rows [key_from, key_to) (the last `tokens` of them its own), with segments
// key_cu (offsets from key_from) pairing with its own, cu (offsets from row, on the device).
struct SpanQueries {
  int64_t row = 0, tokens = 0, key_from = 0, key_to = 0;
  std::vector<int32_t> key_cu;
  Tensor cu;
};
// Rank `rank`'s spans that hold tokens, in row order.
std::vector<SpanQueries> span_queries(kernels::Backend& backend, const ContextShards& shards, int rank);

// This rank's queries against the rows gather_visible_rows lays out, chunk_rows of them at a time.
class KeyChunks {
 public:
  struct Chunk {
    Tensor k, v;  // [rows, heads, qk], [rows, heads, v] of visible rows [from, to)
  };
  using Keys = std::function<Chunk(int64_t from, int64_t to)>;
  // Each chunk's key gradients, dk and dv shaped as its k and v, summed over the spans that see it.
  using KeyGradients = std::function<void(int64_t from, int64_t to, const TensorView& dk, const TensorView& dv)>;

  // chunk_rows 0: the longest shard.
  KeyChunks(kernels::Backend& backend, const ContextShards& shards, int rank, int64_t chunk_rows);

  int64_t visible_rows() const { return visible_rows_; }
  // args: the rank's q, out, lse (overwritten) and scale; k, v and both segment offsets are this
  // class's (per span).
  void forward(const kernels::AttentionArgs& args, const Keys& keys) const;
  // args: dq (overwritten: the sum over the chunks), dout, q and the merged out and lse, and
  // scale; each chunk's keys are asked for again.
  void backward(const kernels::AttentionBackwardArgs& args, const Keys& keys, const KeyGradients& key_gradients) const;

 private:
  // Span p's key segments over visible rows [from, to) on the backend's device, offsets from `from`.
  Tensor segments(const SpanQueries& p, int64_t from, int64_t to) const;
  template <typename Body>
  void for_each_chunk(Body&& body) const;

  kernels::Backend& backend_;
  std::vector<SpanQueries> spans_;
  int64_t visible_rows_ = 0, chunk_rows_ = 0;
};

// Attention whose keys and values travel as they are: all-gathered (padded to the longest shard)
// and attended in chunks (KeyChunks); their gradients reduce-scattered to their owners.
class AttentionAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding shard r of `shards`. Neither is owned.
  // key_chunk: rows of keys attended at a time (0: the longest shard).
  AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                       int64_t key_chunk = 0);

  // args: this rank's rows (q, k, v, out, lse; dq, dk, dv for its own keys); the segment offsets
  // are this class's.
  void forward(const kernels::AttentionArgs& args);
  void backward(const kernels::AttentionBackwardArgs& args);

 private:
  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
  int64_t key_chunk_ = 0;
};

}  // namespace moetrain
