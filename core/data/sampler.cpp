#include "core/data/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/base/error.h"
#include "core/base/random.h"

namespace moetrain {
namespace {

constexpr uint64_t kDocumentStream = 0x646f63756d656e74ull;
constexpr uint64_t kWindowStream = 0x77696e646f777373ull;

// Tickets summing to kBlock, in proportion to the weights (largest remainder).
std::vector<int64_t> tickets_of(const std::vector<double>& weights) {
  double total = 0.0;
  for (double w : weights) total += w;
  std::vector<int64_t> tickets(weights.size());
  std::vector<std::pair<double, size_t>> remainders;
  int64_t assigned = 0;
  for (size_t j = 0; j < weights.size(); ++j) {
    const double exact = weights[j] / total * static_cast<double>(MixtureSchedule::kBlock);
    tickets[j] = static_cast<int64_t>(std::floor(exact));
    assigned += tickets[j];
    remainders.emplace_back(exact - std::floor(exact), j);
  }
  // Largest remainders first; the lower index wins ties, so the result is platform-independent
  // as long as the division is (IEEE double).
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = 0; assigned < MixtureSchedule::kBlock; ++i, ++assigned) ++tickets[remainders[i].second];
  return tickets;
}

}  // namespace

MixtureSchedule::MixtureSchedule(const std::vector<double>& weights) {
  MOETRAIN_ASSERT(!weights.empty(), "a mixture of no datasets");
  for (double w : weights) MOETRAIN_ASSERT(std::isfinite(w) && w > 0, "mixture weights are checked by the config");
  const std::vector<int64_t> tickets = tickets_of(weights);
  for (size_t j = 0; j < tickets.size(); ++j) {
    MOETRAIN_CHECK(tickets[j] > 0, ExitCode::kBadConfig,
                   fmt::format("data.source: the weight {} of mixture entry {} is less than 1/{} of the total: "
                               "raise it or drop the entry",
                               weights[j], j, kBlock));
  }
  const size_t n = tickets.size();
  block_dataset_.resize(kBlock);
  block_rank_.resize(kBlock);
  block_totals_.assign(n, 0);
  for (int64_t q = 0; q < kBlock; ++q) {
    size_t best = 0;
    int64_t best_score = INT64_MIN;
    for (size_t j = 0; j < n; ++j) {
      const int64_t score = tickets[j] * (q + 1) - block_totals_[j] * kBlock;  // < 2^33: no overflow
      if (score > best_score) best_score = score, best = j;
    }
    block_dataset_[q] = static_cast<int32_t>(best);
    block_rank_[q] = static_cast<int32_t>(block_totals_[best]++);
  }
}

std::pair<int, uint64_t> MixtureSchedule::locate(uint64_t g) const {
  const uint64_t block = g / kBlock;
  const uint64_t q = g % kBlock;
  const int j = block_dataset_[q];
  return {j, block * static_cast<uint64_t>(block_totals_[j]) + static_cast<uint64_t>(block_rank_[q])};
}

int64_t windows_per_epoch(int64_t total_tokens, int64_t seq_len) { return (total_tokens + seq_len - 1) / seq_len; }

EpochPlan make_epoch_plan(const std::vector<int64_t>& document_lengths, int64_t seq_len, uint64_t seed,
                          int64_t dataset, int64_t epoch) {
  EpochPlan plan;
  plan.epoch = epoch;
  const int64_t documents = static_cast<int64_t>(document_lengths.size());
  plan.document_order = random_permutation(
      documents, derive_seed(seed, kDocumentStream, static_cast<uint64_t>(dataset), static_cast<uint64_t>(epoch)));
  plan.document_starts.resize(static_cast<size_t>(documents) + 1);
  plan.document_starts[0] = 0;
  for (int64_t i = 0; i < documents; ++i) {
    plan.document_starts[i + 1] = plan.document_starts[i] + document_lengths[plan.document_order[i]];
  }
  plan.window_order = random_permutation(
      windows_per_epoch(plan.document_starts.back(), seq_len),
      derive_seed(seed, kWindowStream, static_cast<uint64_t>(dataset), static_cast<uint64_t>(epoch)));
  return plan;
}

}  // namespace moetrain
