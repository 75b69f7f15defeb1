#include "core/data/data_source.h"

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/data/dataset_source.h"
#include "core/train/synthetic_data.h"

namespace moetrain {
namespace {

// SyntheticData behind the DataSource interface. Its own cursor counts the windows one rank has
// read (rank r of W reads global windows r, r + W, ...); the job-wide cursor is that times W.
// Resuming at another world size W' needs the job-wide cursor to be a multiple of W'.
class SyntheticSource final : public DataSource {
 public:
  SyntheticSource(const DataConfig& config, int64_t vocab_size, int rank, int world)
      : data_(config, vocab_size, rank, world), world_(world) {}
  Batch next() override { return data_.next(); }
  uint64_t cursor() const override { return data_.cursor() * static_cast<uint64_t>(world_); }
  void seek(uint64_t cursor) override {
    MOETRAIN_CHECK(cursor % static_cast<uint64_t>(world_) == 0, ExitCode::kBadCheckpoint,
                   fmt::format("synthetic data: the saved data cursor {} is not a multiple of the world size {}, so "
                               "this job cannot continue its stream exactly: resume on a world size dividing it",
                               cursor, world_));
    data_.seek(cursor / static_cast<uint64_t>(world_));
  }
  double loss_floor() const override { return data_.entropy_floor_nats(); }
  std::string describe() const override { return "synthetic Markov-chain data"; }

 private:
  SyntheticData data_;
  int world_;
};

}  // namespace

std::unique_ptr<DataSource> make_data_source(const DataConfig& config, int64_t vocab_size, int rank, int world) {
  if (config.source == "synthetic") return std::make_unique<SyntheticSource>(config, vocab_size, rank, world);
  std::vector<DatasetEntry> entries;
  if (!config.mixture.empty()) {
    MOETRAIN_CHECK(config.source == kDataSourceMixture, ExitCode::kBadConfig,
                   fmt::format("data.source is `{}` but a mixture list is also set", config.source));
    for (const DataSourceSpec& spec : config.mixture) entries.push_back({spec.path, spec.weight});
  } else {
    MOETRAIN_CHECK(config.source != kDataSourceMixture, ExitCode::kBadConfig,
                   "data.source `mixture` needs a list of {path, weight} entries");
    entries.push_back({config.source, 1.0});
  }
  return std::make_unique<DatasetSource>(entries, config, vocab_size, rank, world);
}

}  // namespace moetrain
