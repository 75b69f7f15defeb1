// The built-in data: deterministic, packed consistently, split disjointly over ranks,
// resumable, and distributed as its chain says (so its entropy floor is real).
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/data/synthetic_data.h"

using moetrain::Batch;
using moetrain::DataConfig;
using moetrain::Error;
using moetrain::ExitCode;
using moetrain::SyntheticData;

namespace {

DataConfig make_config(int64_t seq_len = 64, int64_t micro_batch = 2, int64_t seed = 7) {
  DataConfig config;
  config.seq_len = seq_len;
  config.micro_batch = micro_batch;
  config.seed = seed;
  return config;
}

bool same_batch(const Batch& a, const Batch& b) {
  return a.batch_size == b.batch_size && a.seq_len == b.seq_len && a.input_ids == b.input_ids &&
         a.labels == b.labels && a.positions == b.positions && a.cu_seqlens == b.cu_seqlens;
}

// One window (row b) of a batch, as its own micro_batch-1 Batch.
Batch window_of(const Batch& batch, int64_t b) {
  Batch w;
  w.batch_size = 1;
  w.seq_len = batch.seq_len;
  const auto begin = static_cast<size_t>(b * batch.seq_len), end = begin + static_cast<size_t>(batch.seq_len);
  w.input_ids.assign(batch.input_ids.begin() + begin, batch.input_ids.begin() + end);
  w.labels.assign(batch.labels.begin() + begin, batch.labels.begin() + end);
  w.positions.assign(batch.positions.begin() + begin, batch.positions.begin() + end);
  for (int32_t offset : batch.cu_seqlens) {
    if (offset >= static_cast<int32_t>(begin) && offset <= static_cast<int32_t>(end)) {
      w.cu_seqlens.push_back(offset - static_cast<int32_t>(begin));
    }
  }
  return w;
}

}  // namespace

TEST_CASE("the same seed gives the same batches, another seed other batches") {
  SyntheticData a(make_config(), 128), b(make_config(), 128), c(make_config(64, 2, 8), 128);
  for (int i = 0; i < 5; ++i) {
    const Batch from_a = a.next();
    CHECK(same_batch(from_a, b.next()));
    CHECK(from_a.input_ids != c.next().input_ids);
  }
}

TEST_CASE("every batch is packed consistently: segments, positions, next-token labels") {
  const int64_t vocab = 100, seq_len = 64;
  SyntheticData data(make_config(seq_len, 3), vocab);
  int64_t segments = 0, windows = 0;
  for (int i = 0; i < 20; ++i) {
    const Batch batch = data.next();
    REQUIRE(batch.batch_size == 3);
    REQUIRE(batch.seq_len == seq_len);
    REQUIRE(batch.input_ids.size() == static_cast<size_t>(3 * seq_len));
    REQUIRE(batch.labels.size() == batch.input_ids.size());
    REQUIRE(batch.positions.size() == batch.input_ids.size());
    const std::vector<int32_t>& cu = batch.cu_seqlens;
    REQUIRE(cu.size() >= 2);
    CHECK(cu.front() == 0);
    CHECK(cu.back() == batch.num_tokens());
    for (size_t s = 0; s + 1 < cu.size(); ++s) REQUIRE(cu[s] < cu[s + 1]);
    // No segment crosses a window boundary.
    for (int64_t b = 0; b <= batch.batch_size; ++b) {
      CHECK(std::find(cu.begin(), cu.end(), static_cast<int32_t>(b * seq_len)) != cu.end());
    }
    for (size_t s = 0; s + 1 < cu.size(); ++s) {
      for (int32_t t = cu[s]; t < cu[s + 1]; ++t) {
        CHECK(batch.positions[t] == t - cu[s]);
        CHECK(batch.input_ids[t] >= 0);
        CHECK(batch.input_ids[t] < vocab);
        const bool last = t + 1 == cu[s + 1];
        CHECK(batch.labels[t] == (last ? -1 : batch.input_ids[t + 1]));
        if (!last) {  // every transition is one the chain allows
          const int32_t* successors = data.successors(batch.input_ids[t]);
          const int32_t* end = successors + data.successors_per_token();
          CHECK(std::find(successors, end, batch.labels[t]) != end);
        }
      }
    }
    segments += static_cast<int64_t>(cu.size()) - 1;
    windows += batch.batch_size;
    CHECK(batch.num_targets() == batch.num_tokens() - (static_cast<int64_t>(cu.size()) - 1));
  }
  // Documents of seq_len/8 .. 5 seq_len/8 tokens: about three per window, never one on average.
  CHECK(static_cast<double>(segments) / static_cast<double>(windows) > 2.0);
}

TEST_CASE("ranks read disjoint windows whose union is the one-rank stream") {
  const int world = 3;
  SyntheticData single(make_config(32, 1), 64);
  std::vector<Batch> global;
  for (int i = 0; i < 4 * world; ++i) global.push_back(single.next());

  std::vector<Batch> rank_windows;
  for (int rank = 0; rank < world; ++rank) {
    SyntheticData data(make_config(32, 2), 64, rank, world);
    for (int k = 0; k < 2; ++k) {
      const Batch batch = data.next();
      for (int64_t b = 0; b < 2; ++b) {
        const Batch window = window_of(batch, b);
        // The rank's (2k + b)-th window is global window (2k + b) * world + rank.
        CHECK(same_batch(window, global[static_cast<size_t>((2 * k + b) * world + rank)]));
        rank_windows.push_back(window);
      }
    }
  }
  for (size_t i = 0; i < rank_windows.size(); ++i) {
    for (size_t j = i + 1; j < rank_windows.size(); ++j) {
      CHECK(rank_windows[i].input_ids != rank_windows[j].input_ids);
    }
  }
}

TEST_CASE("a batch of two windows is two batches of one") {
  SyntheticData pairs(make_config(48, 2), 80), singles(make_config(48, 1), 80);
  for (int i = 0; i < 3; ++i) {
    const Batch pair = pairs.next();
    CHECK(same_batch(window_of(pair, 0), singles.next()));
    CHECK(same_batch(window_of(pair, 1), singles.next()));
  }
}

TEST_CASE("seek to a saved cursor reproduces the stream, even with another micro_batch") {
  SyntheticData data(make_config(40, 2), 90);
  for (int i = 0; i < 3; ++i) data.next();
  const uint64_t cursor = data.cursor();
  CHECK(cursor == 6);  // windows read
  const Batch expected_a = data.next(), expected_b = data.next();

  SyntheticData resumed(make_config(40, 2), 90);
  resumed.seek(cursor);
  CHECK(same_batch(resumed.next(), expected_a));
  CHECK(same_batch(resumed.next(), expected_b));

  SyntheticData resumed_single(make_config(40, 1), 90);
  resumed_single.seek(cursor + 1);
  CHECK(same_batch(resumed_single.next(), window_of(expected_a, 1)));
}

TEST_CASE("transitions follow the chain's probabilities, so the entropy floor is real") {
  const double weights[4] = {0.6, 0.2, 0.12, 0.08};  // the documented successor law
  double floor = 0.0;
  for (double p : weights) floor -= p * std::log(p);
  SyntheticData data(make_config(128, 4), 50);
  CHECK(std::abs(data.entropy_floor_nats() - floor) < 1e-12);

  // Empirical choice frequencies and the true chain's mean cross-entropy over the data.
  std::vector<int64_t> chosen(4, 0);
  int64_t transitions = 0;
  double log_loss = 0.0;
  for (int i = 0; i < 60; ++i) {
    const Batch batch = data.next();
    for (size_t t = 0; t < batch.labels.size(); ++t) {
      if (batch.labels[t] < 0) continue;
      const int32_t* successors = data.successors(batch.input_ids[t]);
      const int64_t choice = std::find(successors, successors + 4, batch.labels[t]) - successors;
      REQUIRE(choice < 4);
      ++chosen[choice];
      ++transitions;
      log_loss -= std::log(weights[choice]);
    }
  }
  REQUIRE(transitions > 20000);
  for (int j = 0; j < 4; ++j) {
    CHECK(std::abs(static_cast<double>(chosen[j]) / transitions - weights[j]) < 0.015);
  }
  CHECK(std::abs(log_loss / transitions - floor) < 0.03);
}

TEST_CASE("successors are distinct tokens and skewed towards a few frequent ones") {
  const int64_t vocab = 200;
  SyntheticData data(make_config(), vocab);
  std::map<int32_t, int64_t> counts;
  for (int32_t token = 0; token < vocab; ++token) {
    const int32_t* s = data.successors(token);
    for (int j = 0; j < 4; ++j) {
      CHECK(s[j] >= 0);
      CHECK(s[j] < vocab);
      for (int i = 0; i < j; ++i) CHECK(s[i] != s[j]);
      ++counts[s[j]];
    }
  }
  // Zipf(1) over 200 ranks gives the top token ~17% of the mass: far above a uniform 0.5%.
  int64_t most = 0;
  for (const auto& [token, count] : counts) most = std::max(most, count);
  CHECK(most > 4 * vocab * 4 / 100);
}

TEST_CASE("tiny vocabularies and one-token windows still work") {
  SyntheticData two(make_config(16, 1), 2);
  CHECK(two.successors_per_token() == 2);
  const Batch batch = two.next();
  for (int32_t id : batch.input_ids) CHECK((id == 0 || id == 1));

  SyntheticData one_token(make_config(1, 4), 10);
  const Batch ones = one_token.next();
  CHECK(ones.num_targets() == 0);
  CHECK(ones.cu_seqlens == std::vector<int32_t>({0, 1, 2, 3, 4}));
}

TEST_CASE("bad settings are config errors naming the key") {
  auto code_of = [](auto&& make) {
    try {
      make();
    } catch (const Error& error) {
      return error.code();
    }
    return ExitCode::kOk;
  };
  CHECK(code_of([] { SyntheticData(make_config(), 1); }) == ExitCode::kBadConfig);
  CHECK(code_of([] { SyntheticData(make_config(0), 10); }) == ExitCode::kBadConfig);
  CHECK(code_of([] { SyntheticData(make_config(8, 0), 10); }) == ExitCode::kBadConfig);
  DataConfig from_file = make_config();
  from_file.source = "data/tokens";
  CHECK(code_of([&] { SyntheticData(from_file, 10); }) == ExitCode::kBadConfig);
}
