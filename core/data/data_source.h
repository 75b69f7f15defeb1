// Where training batches come from: the one interface the trainer reads, built from data.source.
//
//   synthetic                      the built-in Markov-chain data (core/data/synthetic_data.h)
//   dir/name                       a tokenized dataset dir/name.{bin,idx[,mask]} (indexed_dataset.h)
//   [{path: a, weight: 2}, ...]    a weighted mixture of such datasets (sampler.h)
//
// The cursor is the number of global samples (windows) the whole job has consumed, the same on
// every rank: checkpoints save it, and seek() to it continues the stream on any world size with
// no sample repeated or skipped (see sampler.h). docs/DATA.md describes the whole data path.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "core/config/config.h"
#include "core/data/batch.h"

namespace moetrain {

class DataSource {
 public:
  virtual ~DataSource() = default;
  // This rank's next micro-batch (data.micro_batch windows of data.seq_len tokens).
  virtual Batch next() = 0;
  // Global samples consumed by the whole job so far.
  virtual uint64_t cursor() const = 0;
  virtual void seek(uint64_t cursor) = 0;
  // The best achievable loss in nats where the data knows it (synthetic), else NaN.
  virtual double loss_floor() const { return std::numeric_limits<double>::quiet_NaN(); }
  // One line for the log: what is being read.
  virtual std::string describe() const = 0;
};

// The source data.source selects, for `rank` of a data-parallel job of `world` ranks. Token ids
// are checked against vocab_size as batches are built. Throws Error(kBadData) for a missing or
// malformed dataset, Error(kBadConfig) for a bad selection.
std::unique_ptr<DataSource> make_data_source(const DataConfig& config, int64_t vocab_size, int rank = 0,
                                             int world = 1);

}  // namespace moetrain
