// ContextShards (see context_shards.h).
#include "core/data/context_shards.h"

#include <algorithm>
#include <string>

#include "core/base/error.h"
#include "core/data/batch.h"

namespace moetrain {

ContextShards::ContextShards(std::vector<int32_t> window_cu, std::vector<int64_t> cuts)
    : window_cu_(std::move(window_cu)), cuts_(std::move(cuts)) {
  MOETRAIN_CHECK(window_cu_.size() >= 2 && window_cu_.front() == 0 && cuts_.size() >= 2 && cuts_.front() == 0 &&
                     cuts_.back() == window_cu_.back() && std::is_sorted(cuts_.begin(), cuts_.end()) &&
                     std::is_sorted(window_cu_.begin(), window_cu_.end()),
                 ExitCode::kInternal,
                 "context shards: the window's offsets and the cuts must both run from 0 to the window's " +
                     std::to_string(window_cu_.empty() ? 0 : window_cu_.back()) + " tokens, never decreasing");
}

ContextShards ContextShards::even(std::vector<int32_t> window_cu, int ranks) {
  const int64_t tokens = window_cu.empty() ? 0 : window_cu.back();
  std::vector<int64_t> cuts;
  for (int r = 0; r <= ranks; ++r) cuts.push_back(tokens * r / ranks);
  return ContextShards(std::move(window_cu), std::move(cuts));
}

int64_t ContextShards::longest_shard() const {
  int64_t longest = 0;
  for (int r = 0; r < ranks(); ++r) longest = std::max(longest, tokens(r));
  return longest;
}

std::vector<int32_t> ContextShards::local_cu(int r) const {
  std::vector<int32_t> cu = {0};
  for (int32_t offset : window_cu_)
    if (offset > begin(r) && offset < end(r)) cu.push_back(static_cast<int32_t>(offset - begin(r)));
  cu.push_back(static_cast<int32_t>(tokens(r)));
  return cu;
}

bool ContextShards::continues_document(int r) const {
  return std::find(window_cu_.begin(), window_cu_.end(), begin(r)) == window_cu_.end();
}

bool ContextShards::within_one_document(int r) const { return local_cu(r).size() == 2; }

int64_t ContextShards::document_start(int r) const {
  // The last offset at or before the shard's first token.
  return *(std::upper_bound(window_cu_.begin(), window_cu_.end(), begin(r)) - 1);
}

std::vector<int32_t> ContextShards::key_cu(int r) const {
  const int64_t start = document_start(r);
  std::vector<int32_t> cu = {0};
  for (int32_t offset : window_cu_)
    if (offset > begin(r) && offset < end(r)) cu.push_back(static_cast<int32_t>(offset - start));
  cu.push_back(static_cast<int32_t>(end(r) - start));
  return cu;
}

Batch context_shard(const Batch& micro_batch, int ranks, int rank) {
  MOETRAIN_CHECK(!micro_batch.context && ranks >= 1 && rank >= 0 && rank < ranks, ExitCode::kInternal,
                 "context_shard: a whole micro-batch and a rank of the group");
  ContextShards shards = ContextShards::even(micro_batch.cu_seqlens, ranks);
  Batch shard;
  shard.batch_size = micro_batch.batch_size;
  shard.seq_len = micro_batch.seq_len;
  const auto first = static_cast<std::ptrdiff_t>(shards.begin(rank)), last = static_cast<std::ptrdiff_t>(shards.end(rank));
  shard.input_ids.assign(micro_batch.input_ids.begin() + first, micro_batch.input_ids.begin() + last);
  shard.labels.assign(micro_batch.labels.begin() + first, micro_batch.labels.begin() + last);
  shard.positions.assign(micro_batch.positions.begin() + first, micro_batch.positions.begin() + last);
  shard.cu_seqlens = shards.local_cu(rank);
  shard.context = std::move(shards);
  shard.context_rank = rank;
  return shard;
}

}  // namespace moetrain
