#include "core/data/data_source.h"

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/data/dataset_source.h"
#include "core/data/eval_data.h"
#include "core/data/synthetic_data.h"

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
  // data.eval.holdout's documents are left out here: training never reads them (eval_data.h).
  const std::vector<DatasetEntry> entries = training_dataset_entries(config);
  return std::make_unique<DatasetSource>(entries, config, vocab_size, rank, world);
}

}  // namespace moetrain
