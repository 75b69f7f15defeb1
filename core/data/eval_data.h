// The evaluation set data.eval names (docs/DATA.md, "Evaluation data"): a fixed list of windows,
// the same at every evaluation, on every world size and after every resume.
//
//   data.eval.source: a dataset or mixture   its global samples 0 .. N-1, as training would draw
//                                            them from it (mixture weights, epoch 0's shuffle)
//   data.eval.source: synthetic              windows 2^62 .. 2^62 + N-1 of the synthetic stream
//                                            (same chain; training reads from window 0 up)
//   data.eval.holdout: f                     each training dataset's held-out documents
//                                            (held_out_documents), as a mixture with the
//                                            training weights; training never reads them
//
// N is data.eval.windows, or 0 for every window of the eval data once (one epoch of each dataset).
// An evaluation runs ceil(N / (world x micro_batch)) micro-batches on every rank, the same count
// everywhere (FSDP and expert parallelism need every rank in every forward): micro-batch i of
// rank r holds windows i W B + r B ... + B - 1, and windows >= N are padding (no targets). So
// the sum of losses and the target count over all ranks are those of the N windows on any world
// size, up to the order of the additions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/config/config.h"
#include "core/data/dataset_source.h"
#include "core/data/batch.h"

namespace moetrain {

class SyntheticData;

class EvalData {
 public:
  EvalData(const DataConfig& config, int64_t vocab_size);
  ~EvalData();

  int64_t windows() const { return windows_; }
  // Micro-batches of micro_batch windows every rank of a `world`-rank job runs per evaluation.
  int64_t micro_batches(int64_t micro_batch, int world) const;
  // Rank `rank`'s micro-batch `index` of an evaluation.
  Batch micro_batch(int64_t index, int64_t micro_batch, int rank, int world);
  std::string describe() const;

  static constexpr uint64_t kFirstSyntheticWindow = uint64_t{1} << 62;

 private:
  // Window `i` (< windows()) into `batch` at window slot `slot`.
  void fill_window(Batch& batch, int64_t slot, int64_t i, std::vector<int32_t>& segments);

  int64_t seq_len_;
  int64_t windows_ = 0;
  std::string description_;
  std::unique_ptr<DatasetSource> datasets_;
  std::unique_ptr<SyntheticData> synthetic_;
};

// The eval set of data.eval, or null when data.eval sets none. Error(kBadData) for a missing or
// malformed eval dataset (as for training data).
std::unique_ptr<EvalData> make_eval_data(const DataConfig& config, int64_t vocab_size);

// data.source's datasets as DatasetSource entries, with data.eval.holdout's documents left out
// (training) or only those (`held_out`: the eval set). Opens each dataset's index to count its
// documents when there is a holdout.
std::vector<DatasetEntry> training_dataset_entries(const DataConfig& config, bool held_out = false);

}  // namespace moetrain
