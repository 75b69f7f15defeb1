#include "core/data/synthetic_data.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/base/error.h"
#include "core/base/random.h"

namespace moetrain {
namespace {

// Index of the first cumulative weight above u (the categorical draw for uniform u).
int64_t sample_cdf(const std::vector<double>& cdf, double u) {
  auto it = std::upper_bound(cdf.begin(), cdf.end(), u);
  return std::min<int64_t>(it - cdf.begin(), static_cast<int64_t>(cdf.size()) - 1);
}

constexpr double kSuccessorWeights[SyntheticData::kSuccessors] = {0.6, 0.2, 0.12, 0.08};
constexpr uint64_t kChainStream = 0x636861696e000001ull;   // separate streams for the chain
constexpr uint64_t kWindowStream = 0x77696e646f770002ull;  // and for each window

}  // namespace

SyntheticData::SyntheticData(const DataConfig& config, int64_t vocab_size, int rank, int world)
    : seq_len_(config.seq_len),
      micro_batch_(config.micro_batch),
      vocab_size_(vocab_size),
      seed_(static_cast<uint64_t>(config.seed)),
      rank_(rank),
      world_(world) {
  MOETRAIN_CHECK(config.source == "synthetic", ExitCode::kBadConfig,
                 "data.source is '" + config.source + "', not 'synthetic'");
  MOETRAIN_CHECK(vocab_size >= 2 && vocab_size <= std::numeric_limits<int32_t>::max(),
                 ExitCode::kBadConfig,
                 "model.vocab_size = " + std::to_string(vocab_size) +
                     ": synthetic data needs a vocabulary of at least 2 tokens");
  MOETRAIN_CHECK(seq_len_ >= 1, ExitCode::kBadConfig,
                 "data.seq_len = " + std::to_string(seq_len_) + ": must be at least 1");
  MOETRAIN_CHECK(micro_batch_ >= 1, ExitCode::kBadConfig,
                 "data.micro_batch = " + std::to_string(micro_batch_) + ": must be at least 1");
  MOETRAIN_ASSERT(world >= 1 && rank >= 0 && rank < world, "rank out of range");

  SplitMix64 rng(mix64(seed_ ^ kChainStream));

  // A random ranking (Fisher-Yates) and the Zipf(1) law over it.
  token_by_rank_.resize(vocab_size_);
  for (int64_t i = 0; i < vocab_size_; ++i) token_by_rank_[i] = static_cast<int32_t>(i);
  for (int64_t i = vocab_size_ - 1; i > 0; --i) {
    std::swap(token_by_rank_[i], token_by_rank_[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  zipf_cdf_.resize(vocab_size_);
  double total = 0.0;
  for (int64_t r = 0; r < vocab_size_; ++r) zipf_cdf_[r] = (total += 1.0 / static_cast<double>(r + 1));
  for (double& c : zipf_cdf_) c /= total;
  zipf_cdf_.back() = 1.0;

  const int64_t k = std::min<int64_t>(kSuccessors, vocab_size_);
  double weight_sum = 0.0;
  for (int64_t j = 0; j < k; ++j) weight_sum += kSuccessorWeights[j];
  for (int64_t j = 0; j < k; ++j) successor_probs_.push_back(kSuccessorWeights[j] / weight_sum);
  double cumulative = 0.0;
  for (double p : successor_probs_) successor_cdf_.push_back(cumulative += p);
  successor_cdf_.back() = 1.0;

  // Distinct Zipf-distributed successors for every token (rejection of repeats).
  successor_table_.resize(static_cast<size_t>(vocab_size_ * k));
  for (int64_t token = 0; token < vocab_size_; ++token) {
    int32_t* row = successor_table_.data() + token * k;
    for (int64_t j = 0; j < k;) {
      const int32_t candidate = token_by_rank_[sample_cdf(zipf_cdf_, rng.uniform())];
      if (std::find(row, row + j, candidate) == row + j) row[j++] = candidate;
    }
  }
}

double SyntheticData::entropy_floor_nats() const {
  double entropy = 0.0;
  for (double p : successor_probs_) entropy -= p * std::log(p);
  return entropy;
}

void SyntheticData::generate_window(uint64_t window, int32_t* input_ids, int32_t* labels,
                                    int32_t* positions, std::vector<int32_t>& segment_lengths) const {
  SplitMix64 rng(mix64(mix64(seed_ ^ kWindowStream) ^ mix64(window)));
  // Document lengths in [seq_len / 8, 5 seq_len / 8]: about three segments per window.
  const int64_t min_len = std::max<int64_t>(2, seq_len_ / 8);
  const int64_t max_len = std::max<int64_t>(min_len, seq_len_ * 5 / 8);
  int64_t filled = 0;
  while (filled < seq_len_) {
    const int64_t drawn = min_len + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_len - min_len + 1)));
    const int64_t length = std::min(drawn, seq_len_ - filled);
    int32_t token = token_by_rank_[sample_cdf(zipf_cdf_, rng.uniform())];
    for (int64_t i = 0; i < length; ++i) {
      input_ids[filled + i] = token;
      positions[filled + i] = static_cast<int32_t>(i);
      if (i + 1 < length) {
        const int64_t choice = sample_cdf(successor_cdf_, rng.uniform());
        token = successors(token)[choice];
      }
    }
    for (int64_t i = 0; i < length; ++i) {
      labels[filled + i] = i + 1 < length ? input_ids[filled + i + 1] : -1;
    }
    segment_lengths.push_back(static_cast<int32_t>(length));
    filled += length;
  }
}

Batch SyntheticData::next() {
  Batch batch = Batch::of_windows(micro_batch_, seq_len_);
  std::vector<int32_t> segment_lengths;
  for (int64_t b = 0; b < micro_batch_; ++b) {
    const uint64_t window = cursor_ * static_cast<uint64_t>(world_) + static_cast<uint64_t>(rank_);
    const size_t offset = static_cast<size_t>(b * seq_len_);
    generate_window(window, batch.input_ids.data() + offset, batch.labels.data() + offset,
                    batch.positions.data() + offset, segment_lengths);
    ++cursor_;
  }
  batch.set_segments(segment_lengths);
  return batch;
}

}  // namespace moetrain
