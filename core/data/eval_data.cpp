#include "core/data/eval_data.h"

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/data/indexed_dataset.h"
#include "core/data/packing.h"
#include "core/data/synthetic_data.h"

namespace moetrain {

std::vector<DatasetEntry> training_dataset_entries(const DataConfig& config, bool held_out) {
  std::vector<DatasetEntry> entries;
  if (!config.mixture.empty()) {
    MOETRAIN_CHECK(config.source == kDataSourceMixture, ExitCode::kBadConfig,
                   fmt::format("data.source is `{}` but a mixture list is also set", config.source));
    for (const DataSourceSpec& spec : config.mixture) entries.push_back({spec.path, spec.weight, {}});
  } else {
    MOETRAIN_CHECK(config.source != kDataSourceMixture, ExitCode::kBadConfig,
                   "data.source `mixture` needs a list of {path, weight} entries");
    entries.push_back({config.source, 1.0, {}});
  }
  if (config.eval.holdout > 0.0) {
    for (size_t j = 0; j < entries.size(); ++j) {
      const int64_t documents = IndexedDataset(entries[j].path).num_documents();
      std::vector<int64_t> eval = held_out_documents(documents, config.eval.holdout,
                                                     static_cast<uint64_t>(config.seed), static_cast<int>(j),
                                                     entries[j].path);
      entries[j].documents = held_out ? std::move(eval) : documents_except(documents, eval);
    }
  } else {
    MOETRAIN_ASSERT(!held_out, "held-out documents asked for without data.eval.holdout");
  }
  return entries;
}

EvalData::EvalData(const DataConfig& config, int64_t vocab_size) : seq_len_(config.seq_len) {
  const EvalDataConfig& eval = config.eval;
  MOETRAIN_ASSERT(eval.enabled(), "no data.eval");
  DataConfig one = config;  // windows are read one at a time
  one.micro_batch = 1;
  if (eval.source == "synthetic") {
    synthetic_ = std::make_unique<SyntheticData>(one, vocab_size, 0, 1);
    windows_ = eval.windows;
    description_ = fmt::format("{} windows of the synthetic stream that training never reaches", windows_);
    return;
  }
  std::vector<DatasetEntry> entries;
  if (eval.holdout > 0.0) {
    entries = training_dataset_entries(config, /*held_out=*/true);
  } else if (!eval.mixture.empty()) {
    for (const DataSourceSpec& spec : eval.mixture) entries.push_back({spec.path, spec.weight, {}});
  } else {
    entries.push_back({eval.source, 1.0, {}});
  }
  datasets_ = std::make_unique<DatasetSource>(entries, one, vocab_size, 0, 1);
  int64_t epoch = 0;
  for (size_t j = 0; j < entries.size(); ++j) epoch += datasets_->windows_per_epoch(static_cast<int>(j));
  windows_ = eval.windows > 0 ? eval.windows : epoch;
  description_ = fmt::format("{} windows of {}{}", windows_,
                             eval.holdout > 0.0 ? fmt::format("the held-out {:g}% of ", 100.0 * eval.holdout) : "",
                             datasets_->describe());
}

EvalData::~EvalData() = default;

int64_t EvalData::micro_batches(int64_t micro_batch, int world) const {
  const int64_t per_round = micro_batch * world;
  return (windows_ + per_round - 1) / per_round;
}

void EvalData::fill_window(Batch& batch, int64_t slot, int64_t i, std::vector<int32_t>& segments) {
  const size_t offset = static_cast<size_t>(slot * seq_len_);
  int32_t* ids = batch.input_ids.data() + offset;
  int32_t* labels = batch.labels.data() + offset;
  int32_t* positions = batch.positions.data() + offset;
  if (i >= windows_) {  // padding: every rank runs the same number of forwards
    for (int64_t t = 0; t < seq_len_; ++t) ids[t] = kPadToken, labels[t] = -1, positions[t] = static_cast<int32_t>(t);
    segments.push_back(static_cast<int32_t>(seq_len_));
    return;
  }
  Batch window;
  if (synthetic_) {
    synthetic_->seek(kFirstSyntheticWindow + static_cast<uint64_t>(i));
    window = synthetic_->next();
  } else {
    window = datasets_->sample(static_cast<uint64_t>(i));
  }
  std::copy(window.input_ids.begin(), window.input_ids.end(), ids);
  std::copy(window.labels.begin(), window.labels.end(), labels);
  std::copy(window.positions.begin(), window.positions.end(), positions);
  for (size_t s = 0; s + 1 < window.cu_seqlens.size(); ++s) {
    segments.push_back(window.cu_seqlens[s + 1] - window.cu_seqlens[s]);
  }
}

Batch EvalData::micro_batch(int64_t index, int64_t micro_batch, int rank, int world) {
  MOETRAIN_ASSERT(index >= 0 && index < micro_batches(micro_batch, world) && rank >= 0 && rank < world,
                  "eval micro-batch out of range");
  Batch batch = Batch::of_windows(micro_batch, seq_len_);
  std::vector<int32_t> segments;
  const int64_t first = index * world * micro_batch + rank * micro_batch;
  for (int64_t b = 0; b < micro_batch; ++b) fill_window(batch, b, first + b, segments);
  batch.set_segments(segments);
  return batch;
}

std::string EvalData::describe() const { return description_; }

std::unique_ptr<EvalData> make_eval_data(const DataConfig& config, int64_t vocab_size) {
  if (!config.eval.enabled()) return nullptr;
  return std::make_unique<EvalData>(config, vocab_size);
}

}  // namespace moetrain
