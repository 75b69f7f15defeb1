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
};

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
  void pack_sample(const WindowOut& out, std::vector<int32_t>& segments, uint64_t global_sample);

  std::vector<DatasetEntry> entries_;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;
  std::vector<int64_t> windows_;                        // per dataset: windows per epoch
  std::vector<std::optional<EpochPlan>> plans_;         // per dataset: the epoch last used
  MixtureSchedule schedule_;
  int64_t seq_len_;
  int64_t micro_batch_;
  uint64_t seed_;
  int64_t vocab_size_;
  int rank_;
  // At start: every token and mask byte of the selected documents (datasets up to
  // IndexedDataset::kContentCheckBytes; larger ones as their windows are drawn), and at least one
  // target token among them. Error(kBadData).
  void check_contents() const;
  int world_;
  uint64_t cursor_ = 0;
};

}  // namespace moetrain
