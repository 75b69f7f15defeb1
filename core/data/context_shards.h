// How a packed window is cut across the ranks of a context-parallel group: rank r holds the
// window's tokens [cuts[r], cuts[r + 1]), and the window's document offsets (cu_seqlens) are
// global, so a document may span several shards (docs/ARCHITECTURE.md §5).
#pragma once

#include <cstdint>
#include <vector>

namespace moetrain {

struct Batch;

class ContextShards {
 public:
  // window_cu: the window's segment offsets [segments + 1], from 0 to the window's tokens;
  // cuts: [ranks + 1], from 0 to the window's tokens, never decreasing.
  ContextShards(std::vector<int32_t> window_cu, std::vector<int64_t> cuts);
  // The window split as evenly as it goes: shard r holds [tokens * r / ranks, tokens * (r + 1) / ranks).
  static ContextShards even(std::vector<int32_t> window_cu, int ranks);

  int ranks() const { return static_cast<int>(cuts_.size()) - 1; }
  int64_t begin(int r) const { return cuts_[r]; }
  int64_t end(int r) const { return cuts_[r + 1]; }
  int64_t tokens(int r) const { return end(r) - begin(r); }
  int64_t longest_shard() const;

  // Shard r's own segment offsets (its documents cut at its edges), from 0 to tokens(r).
  std::vector<int32_t> local_cu(int r) const;
  // Its first token continues a document of the shard before.
  bool continues_document(int r) const;
  // No document starts inside it (after its first token).
  bool within_one_document(int r) const;
  // The first token of the document that shard r's first token belongs to.
  int64_t document_start(int r) const;
  // The keys shard r's queries see, [document_start(r), end(r)), in segments that pair with
  // local_cu(r)'s: each of its documents from the document's start, offsets from 0.
  std::vector<int32_t> key_cu(int r) const;

 private:
  std::vector<int32_t> window_cu_;
  std::vector<int64_t> cuts_;
};

// Shard `rank` of `micro_batch` cut evenly into `ranks` contiguous pieces over its whole token
// stream (every window, end to end): its tokens, labels and positions (labels and positions as
// the whole micro-batch has them, so no shard needs its neighbour's tokens), its own segment
// offsets, and the cut in Batch::context.
Batch context_shard(const Batch& micro_batch, int ranks, int rank);

}  // namespace moetrain
