// How a packed window is cut across the ranks of a context-parallel group (docs/PARALLEL.md,
// "Context parallelism"): into spans of consecutive tokens, each held by one rank, a rank's spans
// laid end to end in its rows in window order. The window's document offsets (cu_seqlens) are
// global, so a document may span several spans and ranks.
//
// Two layouts (parallel.cp_layout): `contiguous`, one span per rank, rank r holding the r-th
// part of the token stream; and `balanced`, every window cut into 2 cp equal chunks, rank r
// holding chunks r and 2 cp - 1 - r (the zigzag of Megatron's and ring attention's context
// parallelism). Causal attention's work grows with a query's position, so contiguous shards give
// the last rank about 2 cp / (cp + 1) times the mean; the balanced pairs give every rank the same.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain {

struct Batch;

enum class ContextLayout { kContiguous, kBalanced };

// "contiguous" | "balanced"; anything else throws a config error naming parallel.cp_layout.
ContextLayout context_layout_of(const std::string& name);

class ContextShards {
 public:
  // Window tokens [begin, end), held by `rank` at its rows [row, row + end - begin).
  struct Span {
    int64_t begin = 0, end = 0;
    int rank = 0;
    int64_t row = 0;
    int64_t tokens() const { return end - begin; }
  };
  // Rows [first, last) of a rank's visible layout hold window tokens [begin, begin + last - first).
  struct Range {
    int64_t begin = 0, end = 0;
  };

  // The contiguous layout: rank r holds [cuts[r], cuts[r + 1]). window_cu: the window's segment
  // offsets [segments + 1], from 0 to the window's tokens; cuts: [ranks + 1], from 0 to the
  // window's tokens, never decreasing.
  ContextShards(std::vector<int32_t> window_cu, std::vector<int64_t> cuts);
  // The window split as evenly as it goes: shard r holds [tokens * r / ranks, tokens * (r + 1) / ranks).
  static ContextShards even(std::vector<int32_t> window_cu, int ranks);
  // The balanced layout over windows of `seq_len` tokens (a multiple of 2 ranks): in each window,
  // rank r holds chunks r and 2 ranks - 1 - r of seq_len / (2 ranks) tokens.
  static ContextShards balanced(std::vector<int32_t> window_cu, int ranks, int64_t seq_len);

  int ranks() const { return ranks_; }
  // The window's segment offsets, as given.
  const std::vector<int32_t>& window_cu() const { return window_cu_; }
  // Every span in window order.
  const std::vector<Span>& spans() const { return spans_; }
  // Rank r's spans (indices into spans()), in window order, which is also their order in its rows.
  const std::vector<int>& spans_of(int r) const { return spans_of_[r]; }
  // The most spans a rank holds.
  int64_t most_spans() const;
  int64_t tokens(int r) const;
  int64_t longest_shard() const;

  // Rank r's own segment offsets (its documents cut at its spans' edges), from 0 to tokens(r).
  std::vector<int32_t> local_cu(int r) const;
  // Span s's own segment offsets, from 0 to its tokens.
  std::vector<int32_t> span_cu(int s) const;
  // Span s's first token continues a document of the span before it.
  bool continues_document(int s) const;
  // No document starts inside span s (after its first token).
  bool within_one_document(int s) const;
  // The first token of the document that span s's first token belongs to.
  int64_t document_start(int s) const;
  // The keys span s's queries see, window tokens [document_start(s), end), in segments that pair
  // with span_cu(s)'s: each of its documents from the document's start, offsets from 0.
  std::vector<int32_t> key_cu(int s) const;

  // The window tokens rank r's queries see, in the order its visible rows hold them: the union of
  // [document_start(s), end(s)) over its spans, as disjoint ranges in window order.
  std::vector<Range> visible_ranges(int r) const;
  int64_t visible_rows(int r) const;
  // The row of rank r's visible layout that holds window token `token` (one it sees).
  int64_t visible_row(int r, int64_t token) const;

 private:
  ContextShards(std::vector<int32_t> window_cu, std::vector<Span> spans, int ranks);

  std::vector<int32_t> window_cu_;
  std::vector<Span> spans_;
  std::vector<std::vector<int>> spans_of_;
  int ranks_ = 0;
};

// Rank `rank`'s shard of `micro_batch` over a group of `ranks`: its spans' tokens, labels and
// positions (labels and positions as the whole micro-batch has them, so no shard needs its
// neighbour's tokens), its own segment offsets, and the cut in Batch::context. `contiguous` cuts
// the micro-batch's whole token stream (every window, end to end) evenly; `balanced` pairs the
// chunks of every window (its seq_len a multiple of 2 ranks).
Batch context_shard(const Batch& micro_batch, int ranks, int rank, ContextLayout layout = ContextLayout::kContiguous);

}  // namespace moetrain
