// The quickstart's built-in data: token windows with structure a small model can learn.
//
// Documents are walks of a fixed random first-order Markov chain over the vocabulary: every
// token has kSuccessors possible next tokens with fixed probabilities (0.6, 0.2, 0.12, 0.08),
// and the successors and document starts are drawn from a Zipf distribution over a random
// ranking of the vocabulary (so the unigram statistics are skewed too, and are learnt first).
// The best possible mean loss is then the entropy of the successor distribution
// (entropy_floor_nats()): the trainer logs it so a run shows how close it gets.
//
// Layout: an endless stream of windows of seq_len tokens, each filled with documents of
// varying length (the last one cut at the window's end) so every window has several segments.
// Window w depends only on (seed, w), never on the rank, world or micro-batch size. Rank r of
// world W reads windows r, r + W, r + 2W, ...; a Batch is the next micro_batch of them. So the
// ranks' streams are disjoint, their union is the one-rank stream, and the cursor (windows this
// rank has read) resumes the stream exactly, even with another micro_batch.
//
// All randomness is splitmix64 with our own sampling: identical on every platform and standard
// library (std:: distributions are not).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/data/batch.h"

namespace moetrain {

class SyntheticData {
 public:
  static constexpr int kSuccessors = 4;

  // Throws Error(kBadConfig) when data.source is not "synthetic", vocab_size < 2, or seq_len or
  // micro_batch < 1.
  SyntheticData(const DataConfig& config, int64_t vocab_size, int rank = 0, int world = 1);

  Batch next();

  // Windows this rank has read so far; seek() to a saved cursor reproduces the stream from there.
  uint64_t cursor() const { return cursor_; }
  void seek(uint64_t cursor) { cursor_ = cursor; }

  // The expected loss (nats per target token) of a model that knows the chain exactly.
  double entropy_floor_nats() const;

  // The chain, for tests: the successors of `token` (successors_per_token() of them, distinct)
  // and their probabilities (the same for every token).
  int64_t successors_per_token() const { return static_cast<int64_t>(successor_probs_.size()); }
  const int32_t* successors(int32_t token) const {
    return successor_table_.data() + static_cast<size_t>(token) * successor_probs_.size();
  }
  const std::vector<double>& successor_probs() const { return successor_probs_; }

 private:
  // Writes window `window` of the global stream (seq_len tokens) and appends its segment
  // lengths to `segment_lengths`.
  void generate_window(uint64_t window, int32_t* input_ids, int32_t* labels, int32_t* positions,
                       std::vector<int32_t>& segment_lengths) const;

  int64_t seq_len_;
  int64_t micro_batch_;
  int64_t vocab_size_;
  uint64_t seed_;
  int rank_;
  int world_;
  uint64_t cursor_ = 0;
  std::vector<int32_t> token_by_rank_;   // a random ranking of the vocabulary for the Zipf law
  std::vector<double> zipf_cdf_;         // cumulative Zipf(1) weights over ranks, last = 1
  std::vector<int32_t> successor_table_; // [vocab, successors_per_token()]
  std::vector<double> successor_probs_;  // [successors_per_token()]
  std::vector<double> successor_cdf_;    // their prefix sums, last = 1
};

}  // namespace moetrain
