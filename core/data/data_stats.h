// `moetrain data-stats FILE_PREFIX`: what a tokenized dataset holds (documents, tokens, the share
// of tokens that are training targets, the largest token id, and a histogram of document
// lengths), so a user can check a prepared dataset before training on it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/data/indexed_dataset.h"

namespace moetrain {

struct DataStats {
  int64_t documents = 0;
  int64_t sequences = 0;
  int64_t tokens = 0;
  int64_t masked_in = 0;          // tokens with loss mask 1 (all of them without a mask file)
  int64_t max_token_id = -1;
  int64_t min_length = 0, max_length = 0;
  std::vector<int64_t> histogram;  // documents with length in [2^i, 2^(i+1)); bucket 0 also holds empty ones
};

// Reads every token and mask byte once (sequentially, through the mapping).
DataStats compute_data_stats(const IndexedDataset& dataset);

// The human-readable report.
std::string format_data_stats(const IndexedDataset& dataset, const DataStats& stats);

// The subcommand: argv[0] is "data-stats". Accepts `dir/name` or `dir/name.bin` / `.idx`.
// Prints the report on stdout (its usage for --help or -h); Error(kBadConfig) for a bad command
// line, Error(kBadData) for a bad dataset.
int data_stats_command(int argc, char** argv);

// The subcommand's usage lines (also in `moetrain help`).
const char* data_stats_usage();

}  // namespace moetrain
