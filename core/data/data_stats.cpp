#include "core/data/data_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <string>

#include "core/base/error.h"

namespace moetrain {
namespace {

const char* dtype_name_of_code(int code) {
  switch (code) {
    case 1: return "uint8";
    case 4: return "int32";
    case 5: return "int64";
    default: return "uint16";
  }
}

std::string strip_extension(const std::string& path) {
  for (const char* ext : {".bin", ".idx", ".mask"}) {
    const std::string e = ext;
    if (path.size() > e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0) {
      return path.substr(0, path.size() - e.size());
    }
  }
  return path;
}

}  // namespace

DataStats compute_data_stats(const IndexedDataset& dataset) {
  DataStats stats;
  stats.documents = dataset.num_documents();
  stats.sequences = dataset.num_sequences();
  stats.tokens = dataset.num_tokens();
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (int64_t d = 0; d < stats.documents; ++d) {
    const int64_t n = dataset.document_length(d);
    if (d == 0 || n < stats.min_length) stats.min_length = n;
    stats.max_length = std::max(stats.max_length, n);
    size_t bucket = 0;
    while ((int64_t{2} << bucket) <= n) ++bucket;
    if (stats.histogram.size() <= bucket) stats.histogram.resize(bucket + 1, 0);
    ++stats.histogram[bucket];
    tokens.resize(static_cast<size_t>(n));
    mask.resize(static_cast<size_t>(n));
    dataset.read(tokens.data(), mask.data(), d, 0, n, /*vocab_size=*/0);
    for (int64_t i = 0; i < n; ++i) {
      stats.max_token_id = std::max<int64_t>(stats.max_token_id, tokens[i]);
      stats.masked_in += mask[i];
    }
  }
  return stats;
}

std::string format_data_stats(const IndexedDataset& dataset, const DataStats& stats) {
  std::string text = fmt::format("dataset    {} (.bin {} tokens{})\n", dataset.prefix(),
                                 dtype_name_of_code(dataset.dtype_code()),
                                 dataset.has_loss_mask() ? ", .mask" : ", no .mask: every token is a target");
  text += fmt::format("documents  {}\n", stats.documents);
  if (stats.sequences != stats.documents) text += fmt::format("sequences  {}\n", stats.sequences);
  text += fmt::format("tokens     {}\n", stats.tokens);
  const double ratio = stats.tokens > 0 ? static_cast<double>(stats.masked_in) / static_cast<double>(stats.tokens) : 0;
  text += fmt::format("mask ratio {:.4f} ({} of {} tokens have loss mask 1)\n", ratio, stats.masked_in, stats.tokens);
  text += fmt::format("max token  {} (the model's vocab_size must be larger)\n", stats.max_token_id);
  if (stats.documents > 0) {
    text += fmt::format("length     min {}, mean {:.1f}, max {} tokens per document\n", stats.min_length,
                        static_cast<double>(stats.tokens) / static_cast<double>(stats.documents), stats.max_length);
  }
  text += "length histogram (tokens per document):\n";
  int64_t most = 1;
  for (int64_t count : stats.histogram) most = std::max(most, count);
  for (size_t b = 0; b < stats.histogram.size(); ++b) {
    const int64_t low = b == 0 ? 0 : int64_t{1} << b;
    const int64_t high = (int64_t{2} << b) - 1;
    const int64_t count = stats.histogram[b];
    const size_t bar = static_cast<size_t>((count * 40 + most - 1) / most);
    text += fmt::format("  {:>9} - {:<9} {:>10}  {}\n", low, high, count, std::string(bar, '#'));
  }
  return text;
}

const char* data_stats_usage() {
  return "  moetrain data-stats FILE_PREFIX\n"
         "      documents, tokens, loss-mask ratio and length histogram of a dataset (FILE_PREFIX.bin/.idx)\n";
}

int data_stats_command(int argc, char** argv) {
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << "usage:\n" << data_stats_usage() << std::flush;
    return 0;
  }
  MOETRAIN_CHECK(argc == 2 && argv[1][0] != '-', ExitCode::kBadConfig,
                 "command line: usage: moetrain data-stats FILE_PREFIX (dir/name for dir/name.bin + dir/name.idx)");
  IndexedDataset dataset(strip_extension(argv[1]));
  std::cout << format_data_stats(dataset, compute_data_stats(dataset)) << std::flush;
  return 0;
}

}  // namespace moetrain
