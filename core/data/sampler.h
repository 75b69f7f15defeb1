// Which window each training sample is: deterministic from data.seed, shuffled per epoch,
// sharded over data-parallel ranks, resumable from one number.
//
// The global sample stream. Samples are numbered 0, 1, 2, ... over the whole job. A micro-batch
// step of a job with W ranks and micro_batch B consumes W * B samples: rank r takes
// [cursor + r B, cursor + (r + 1) B), then every rank's cursor moves on by W B. So ranks never
// overlap and leave no gap, the cursor is the same number on every rank, and a job resumed at
// that cursor on any world size continues the same stream with nothing repeated or skipped.
//
// Mixture. Global sample g comes from dataset j of the mixture by a fixed interleaving of blocks
// of kBlock samples: weights become integer tickets t_j summing to kBlock (largest remainder),
// and inside a block each sample goes to the dataset furthest behind its share
// (argmax_j t_j (q + 1) - count_j kBlock, ties to the lower j). So locating g is O(1) (no replay
// from the start), proportions are exact per block, and no dataset waits long for its turn.
//
// Epochs. Dataset j's own samples s = 0, 1, ... run through its epochs: epoch e = s / windows,
// and inside an epoch the windows are visited in a random order. Each epoch also concatenates
// the documents in a fresh random order before cutting windows (packing.h), so neither the
// windows' contents nor their order repeat between epochs. Both shuffles are seeded by
// (data.seed, dataset j, epoch e) only.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace moetrain {

class MixtureSchedule {
 public:
  static constexpr int64_t kBlock = int64_t{1} << 16;

  // Weights > 0, one per dataset. Throws Error(kBadConfig) when a weight is so small next to the
  // others that it would get no ticket (below 1 / kBlock of the total).
  explicit MixtureSchedule(const std::vector<double>& weights);

  int num_datasets() const { return static_cast<int>(block_totals_.size()); }
  // Global sample g -> (dataset, index among that dataset's samples).
  std::pair<int, uint64_t> locate(uint64_t g) const;

 private:
  std::vector<int32_t> block_dataset_;   // [kBlock]: the dataset of each position in a block
  std::vector<int32_t> block_rank_;      // [kBlock]: samples of that dataset earlier in the block
  std::vector<int64_t> block_totals_;    // [datasets]: samples of each dataset per block
};

// One dataset epoch's order: the documents in their concatenation order (with each one's first
// token offset in the concatenation), and the order the windows are visited in.
struct EpochPlan {
  int64_t epoch = 0;
  std::vector<int64_t> document_order;   // [documents]
  std::vector<int64_t> document_starts;  // [documents + 1]: prefix sums of their lengths
  std::vector<int64_t> window_order;     // [windows]
};

// Windows of seq_len tokens one epoch of a dataset with these document lengths fills (the last
// one padded): ceil(total tokens / seq_len).
int64_t windows_per_epoch(int64_t total_tokens, int64_t seq_len);

// The plan of `epoch` for dataset number `dataset` of the mixture.
EpochPlan make_epoch_plan(const std::vector<int64_t>& document_lengths, int64_t seq_len, uint64_t seed,
                          int64_t dataset, int64_t epoch);

// The first global sample of `rank`'s share of the micro-batch step that starts at `cursor`.
inline uint64_t first_sample_of_rank(uint64_t cursor, int64_t micro_batch, int rank) {
  return cursor + static_cast<uint64_t>(rank) * static_cast<uint64_t>(micro_batch);
}

}  // namespace moetrain
