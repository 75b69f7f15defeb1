// One micro-batch on the host, in the packed layout every layer consumes: `batch_size`
// windows of `seq_len` tokens laid end to end, cut into segments (documents) by cu_seqlens.
// Attention, convolution and recurrent state never cross a segment boundary; positions
// restart at 0 in every segment; labels are next-token targets within a segment, -1 where a
// token is not a target (the last token of a segment, masked prompt tokens, padding).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/base/error.h"

#include "core/data/context_shards.h"

namespace moetrain {

struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> input_ids;   // [batch_size * seq_len]
  std::vector<int32_t> labels;      // [batch_size * seq_len], -1: not a target
  std::vector<int32_t> positions;   // [batch_size * seq_len], position within its segment
  std::vector<int32_t> cu_seqlens;  // [num_segments + 1], prefix sums over the packed tokens
  // Images (model.vision): every image's patches end to end, each image in raster order over
  // (frame, row, column) and each patch channel-major ([c][y][x], 3 p^2 values), normalised; and
  // each image's grid (frames, rows, columns of patches). The images' tokens sit, in order, at the
  // input_ids equal to model.vision.placeholder_token_id (one per token: the pre-expanded form).
  std::vector<float> image_patches;
  std::vector<int32_t> image_grids;  // [images * 3]

  // `batch_size` windows of `seq_len` tokens: input_ids, labels and positions sized for a data
  // source to fill, cu_seqlens left to set_segments.
  static Batch of_windows(int64_t batch_size, int64_t seq_len) {
    Batch batch;
    batch.batch_size = batch_size;
    batch.seq_len = seq_len;
    const size_t tokens = static_cast<size_t>(batch_size * seq_len);
    batch.input_ids.resize(tokens);
    batch.labels.resize(tokens);
    batch.positions.resize(tokens);
    return batch;
  }

  // cu_seqlens from the segments' lengths, in packed order.
  void set_segments(const std::vector<int32_t>& lengths) {
    cu_seqlens.clear();
    cu_seqlens.reserve(lengths.size() + 1);
    cu_seqlens.push_back(0);
    for (int32_t length : lengths) cu_seqlens.push_back(cu_seqlens.back() + length);
  }

  // Set when this is one rank's shard of a micro-batch split across a context-parallel group
  // (parallel.cp > 1, context_shard() in core/data/context_shards.h): the micro-batch's cut, and
  // that this is shard `context_rank` of it. input_ids, labels and positions then hold the
  // shard's tokens, cu_seqlens its own segments (local_cu), and batch_size, seq_len the
  // micro-batch's.
  std::optional<ContextShards> context;
  int context_rank = 0;

  // The micro-batches of an expert window (train.expert_window) as one packed pass: their tokens
  // end to end in order, every segment kept (so mixers, positions and labels are as they were),
  // batch_size their windows together. Context-parallel shards cannot be joined (the config
  // rules refuse the pair); every part must have the same seq_len.
  static Batch concatenated(const std::vector<const Batch*>& parts) {
    MOETRAIN_ASSERT(!parts.empty(), "no micro-batch to concatenate");
    Batch joined;
    joined.seq_len = parts.front()->seq_len;
    joined.cu_seqlens.push_back(0);
    for (const Batch* part : parts) {
      MOETRAIN_ASSERT(!part->context && part->seq_len == joined.seq_len,
                      "only whole micro-batches of one seq_len are concatenated");
      joined.batch_size += part->batch_size;
      joined.input_ids.insert(joined.input_ids.end(), part->input_ids.begin(), part->input_ids.end());
      joined.labels.insert(joined.labels.end(), part->labels.begin(), part->labels.end());
      joined.positions.insert(joined.positions.end(), part->positions.begin(), part->positions.end());
      const int32_t base = joined.cu_seqlens.back();
      for (size_t s = 1; s < part->cu_seqlens.size(); ++s) joined.cu_seqlens.push_back(base + part->cu_seqlens[s]);
    }
    return joined;
  }

  int64_t num_tokens() const { return context ? context->tokens(context_rank) : batch_size * seq_len; }
  int64_t num_targets() const {
    int64_t n = 0;
    for (int32_t label : labels) n += label >= 0;
    return n;
  }
};

}  // namespace moetrain
