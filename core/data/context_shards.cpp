// ContextShards (see context_shards.h).
#include "core/data/context_shards.h"

#include <algorithm>
#include <string>

#include "core/base/error.h"
#include "core/data/batch.h"

namespace moetrain {

ContextLayout context_layout_of(const std::string& name) {
  if (name == "contiguous") return ContextLayout::kContiguous;
  if (name == "balanced") return ContextLayout::kBalanced;
  throw Error(ExitCode::kBadConfig,
              "`parallel.cp_layout` = \"" + name + "\" is not a layout: use balanced or contiguous");
}

ContextShards::ContextShards(std::vector<int32_t> window_cu, std::vector<Span> spans, int ranks)
    : window_cu_(std::move(window_cu)), spans_(std::move(spans)), spans_of_(static_cast<size_t>(std::max(ranks, 0))),
      ranks_(ranks) {
  const int64_t tokens = window_cu_.empty() ? 0 : window_cu_.back();
  bool tiled = window_cu_.size() >= 2 && window_cu_.front() == 0 && ranks_ >= 1 && !spans_.empty() &&
               std::is_sorted(window_cu_.begin(), window_cu_.end());
  std::vector<int64_t> rows(static_cast<size_t>(std::max(ranks_, 0)), 0);
  int64_t at = 0;
  for (size_t s = 0; tiled && s < spans_.size(); ++s) {
    const Span& span = spans_[s];
    tiled = span.begin == at && span.end >= span.begin && span.rank >= 0 && span.rank < ranks_ &&
            span.row == rows[span.rank];
    if (!tiled) break;
    spans_of_[span.rank].push_back(static_cast<int>(s));
    rows[span.rank] += span.tokens();
    at = span.end;
  }
  MOETRAIN_CHECK(tiled && at == tokens, ExitCode::kInternal,
                 "context shards: the spans must tile the window's " + std::to_string(tokens) +
                     " tokens in order, each rank's laid end to end in its rows");
}

namespace {

std::vector<ContextShards::Span> contiguous_spans(const std::vector<int64_t>& cuts) {
  std::vector<ContextShards::Span> spans;
  MOETRAIN_CHECK(cuts.size() >= 2 && cuts.front() == 0 && std::is_sorted(cuts.begin(), cuts.end()),
                 ExitCode::kInternal, "context shards: the cuts must run from 0, never decreasing");
  for (size_t r = 0; r + 1 < cuts.size(); ++r) spans.push_back({cuts[r], cuts[r + 1], static_cast<int>(r), 0});
  return spans;
}

}  // namespace

ContextShards::ContextShards(std::vector<int32_t> window_cu, std::vector<int64_t> cuts)
    : ContextShards(std::move(window_cu), contiguous_spans(cuts), static_cast<int>(cuts.size()) - 1) {}

ContextShards ContextShards::even(std::vector<int32_t> window_cu, int ranks) {
  const int64_t tokens = window_cu.empty() ? 0 : window_cu.back();
  std::vector<int64_t> cuts;
  for (int r = 0; r <= ranks; ++r) cuts.push_back(tokens * r / ranks);
  return ContextShards(std::move(window_cu), std::move(cuts));
}

ContextShards ContextShards::balanced(std::vector<int32_t> window_cu, int ranks, int64_t seq_len) {
  const int64_t tokens = window_cu.empty() ? 0 : window_cu.back();
  MOETRAIN_CHECK(ranks >= 1 && seq_len > 0 && seq_len % (2 * ranks) == 0 && tokens % seq_len == 0,
                 ExitCode::kInternal,
                 "context shards: the balanced layout cuts whole windows of a multiple of 2 x " + std::to_string(ranks) +
                     " tokens (config rules check parallel.cp_layout)");
  const int64_t chunk = seq_len / (2 * ranks);
  std::vector<Span> spans;
  std::vector<int64_t> rows(static_cast<size_t>(ranks), 0);
  for (int64_t window = 0; window < tokens; window += seq_len) {
    for (int c = 0; c < 2 * ranks; ++c) {
      const int rank = std::min(c, 2 * ranks - 1 - c);
      spans.push_back({window + c * chunk, window + (c + 1) * chunk, rank, rows[rank]});
      rows[rank] += chunk;
    }
  }
  return ContextShards(std::move(window_cu), std::move(spans), ranks);
}

int64_t ContextShards::most_spans() const {
  size_t most = 0;
  for (const std::vector<int>& mine : spans_of_) most = std::max(most, mine.size());
  return static_cast<int64_t>(most);
}

int64_t ContextShards::tokens(int r) const {
  int64_t n = 0;
  for (int s : spans_of_[r]) n += spans_[s].tokens();
  return n;
}

int64_t ContextShards::longest_shard() const {
  int64_t longest = 0;
  for (int r = 0; r < ranks(); ++r) longest = std::max(longest, tokens(r));
  return longest;
}

std::vector<int32_t> ContextShards::span_cu(int s) const {
  const Span& span = spans_[s];
  std::vector<int32_t> cu = {0};
  for (int32_t offset : window_cu_)
    if (offset > span.begin && offset < span.end) cu.push_back(static_cast<int32_t>(offset - span.begin));
  cu.push_back(static_cast<int32_t>(span.tokens()));
  return cu;
}

std::vector<int32_t> ContextShards::local_cu(int r) const {
  std::vector<int32_t> cu = {0};
  for (int s : spans_of_[r]) {
    const std::vector<int32_t> own = span_cu(s);
    for (size_t i = 1; i < own.size(); ++i) cu.push_back(static_cast<int32_t>(spans_[s].row + own[i]));
  }
  return cu;
}

bool ContextShards::continues_document(int s) const {
  return std::find(window_cu_.begin(), window_cu_.end(), spans_[s].begin) == window_cu_.end();
}

bool ContextShards::within_one_document(int s) const { return span_cu(s).size() == 2; }

int64_t ContextShards::document_start(int s) const {
  // The last offset at or before the span's first token.
  return *(std::upper_bound(window_cu_.begin(), window_cu_.end(), spans_[s].begin) - 1);
}

std::vector<int32_t> ContextShards::key_cu(int s) const {
  const Span& span = spans_[s];
  const int64_t start = document_start(s);
  std::vector<int32_t> cu = {0};
  for (int32_t offset : window_cu_)
    if (offset > span.begin && offset < span.end) cu.push_back(static_cast<int32_t>(offset - start));
  cu.push_back(static_cast<int32_t>(span.end - start));
  return cu;
}

std::vector<ContextShards::Range> ContextShards::visible_ranges(int r) const {
  std::vector<Range> ranges;
  for (int s : spans_of_[r]) {
    const Range seen{document_start(s), spans_[s].end};
    if (!ranges.empty() && seen.begin <= ranges.back().end) {
      ranges.back().end = std::max(ranges.back().end, seen.end);
    } else {
      ranges.push_back(seen);
    }
  }
  return ranges;
}

int64_t ContextShards::visible_rows(int r) const {
  int64_t rows = 0;
  for (const Range& range : visible_ranges(r)) rows += range.end - range.begin;
  return rows;
}

int64_t ContextShards::visible_row(int r, int64_t token) const {
  int64_t row = 0;
  for (const Range& range : visible_ranges(r)) {
    if (token >= range.begin && token < range.end) return row + token - range.begin;
    row += range.end - range.begin;
  }
  throw Error(ExitCode::kInternal, "context shards: rank " + std::to_string(r) + " does not see window token " +
                                       std::to_string(token));
}

Batch context_shard(const Batch& micro_batch, int ranks, int rank, ContextLayout layout) {
  MOETRAIN_CHECK(!micro_batch.context && ranks >= 1 && rank >= 0 && rank < ranks, ExitCode::kInternal,
                 "context_shard: a whole micro-batch and a rank of the group");
  ContextShards shards = layout == ContextLayout::kBalanced
                             ? ContextShards::balanced(micro_batch.cu_seqlens, ranks, micro_batch.seq_len)
                             : ContextShards::even(micro_batch.cu_seqlens, ranks);
  Batch shard;
  shard.batch_size = micro_batch.batch_size;
  shard.seq_len = micro_batch.seq_len;
  for (int s : shards.spans_of(rank)) {
    const auto first = static_cast<std::ptrdiff_t>(shards.spans()[s].begin);
    const auto last = static_cast<std::ptrdiff_t>(shards.spans()[s].end);
    shard.input_ids.insert(shard.input_ids.end(), micro_batch.input_ids.begin() + first,
                           micro_batch.input_ids.begin() + last);
    shard.labels.insert(shard.labels.end(), micro_batch.labels.begin() + first, micro_batch.labels.begin() + last);
    shard.positions.insert(shard.positions.end(), micro_batch.positions.begin() + first,
                           micro_batch.positions.begin() + last);
  }
  shard.cu_seqlens = shards.local_cu(rank);
  shard.context = std::move(shards);
  shard.context_rank = rank;
  return shard;
}

}  // namespace moetrain
