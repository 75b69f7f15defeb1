// The tokenized-dataset pipeline behind data.source = a path prefix or a mixture: indexed
// datasets (mmap) -> mixture schedule and per-epoch plans (sampler.h) -> packed windows
// (packing.h) -> this rank's micro-batches.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/data/data_source.h"
#include "core/data/indexed_dataset.h"
#include "core/data/packing.h"
#include "core/data/sampler.h"

namespace moetrain {

struct DatasetEntry {
  std::string path;  // the prefix
  double weight = 1.0;
  // The dataset's documents this source reads, ascending (data.eval.holdout splits a dataset in
  // two); empty: all of them.
  std::vector<int64_t> documents;
};

// data.eval.holdout: the documents of a dataset of `documents` documents (entry `dataset` of the
// mixture) held out for evaluation, ascending: round(fraction x documents) of them, at least one
// and never all, chosen at random from (seed, dataset) only, so every rank, world size and
// resume agrees. Error(kBadData) for a dataset of fewer than two documents.
std::vector<int64_t> held_out_documents(int64_t documents, double fraction, uint64_t seed, int dataset,
                                        const std::string& name);
// The complement: documents 0 .. documents - 1 not in `held_out` (ascending).
std::vector<int64_t> documents_except(int64_t documents, const std::vector<int64_t>& held_out);

// Which window a global sample is (tests and tools).
struct SampleLocation {
  int dataset = 0;
  int64_t epoch = 0;
  int64_t window = 0;  // in the epoch's concatenation
};

class DatasetSource final : public DataSource {
 public:
  // Opens every dataset (headers and sizes checked: Error(kBadData)); an empty dataset is an error.
  DatasetSource(const std::vector<DatasetEntry>& entries, const DataConfig& config, int64_t vocab_size, int rank,
                int world);

  Batch next() override;
  uint64_t cursor() const override { return cursor_; }
  void seek(uint64_t cursor) override { cursor_ = cursor; }
  std::string describe() const override;

  SampleLocation locate(uint64_t global_sample) const;
  // The window of one global sample, as a one-window Batch (tests, tools).
  Batch sample(uint64_t global_sample);
  const IndexedDataset& dataset(int j) const { return *datasets_[static_cast<size_t>(j)]; }
  int64_t windows_per_epoch(int j) const { return windows_[static_cast<size_t>(j)]; }

 private:
  const EpochPlan& plan(int dataset, int64_t epoch);
  // At start: every token and mask byte of the selected documents (datasets up to
  // IndexedDataset::kContentCheckBytes; larger ones as their windows are drawn), and at least one
  // target token among them. Error(kBadData).
  void check_contents() const;
  void pack_sample(const WindowOut& out, std::vector<int32_t>& segments, uint64_t global_sample);

  std::vector<DatasetEntry> entries_;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;
  std::vector<std::vector<int64_t>> lengths_;           // per dataset: lengths of the documents read
  std::vector<int64_t> windows_;                        // per dataset: windows per epoch
  std::vector<std::optional<EpochPlan>> plans_;         // per dataset: the epoch last used
  MixtureSchedule schedule_;
  int64_t seq_len_;
  int64_t micro_batch_;
  uint64_t seed_;
  int64_t vocab_size_;
  int rank_;
  int world_;
  uint64_t cursor_ = 0;
};

}  // namespace moetrain
