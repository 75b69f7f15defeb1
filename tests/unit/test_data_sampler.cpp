// Sampling: the mixture schedule, data-parallel sharding (disjoint, covering, the same stream as
// one rank), determinism, and resuming from the cursor on the same and on another world size.
#include <map>
#include <set>

#include "catch.h"
#include "core/base/error.h"
#include "core/data/data_source.h"
#include "core/data/dataset_source.h"
#include "core/data/sampler.h"
#include "expected_error.h"
#include "test_data_support.h"

namespace moetrain {
namespace {

using testing::DataScratchDir;
using testing::numbered_documents;

// The message of the data error (exit code 3) that make_data_source raises at start for
// `config`; a test that gets none fails.
std::string data_error(const DataConfig& config, int64_t vocab_size) {
  return testing::expected_error(ExitCode::kBadData, [&] { make_data_source(config, vocab_size, 0, 1); });
}

TEST_CASE("the mixture schedule gives each dataset its share, each sample once, in order") {
  MixtureSchedule schedule({3.0, 1.0, 0.5});
  std::vector<uint64_t> next_local(3, 0);
  std::vector<int64_t> counts(3, 0);
  const uint64_t n = 2 * MixtureSchedule::kBlock + 777;
  for (uint64_t g = 0; g < n; ++g) {
    auto [dataset, local] = schedule.locate(g);
    REQUIRE(dataset >= 0);
    REQUIRE(dataset < 3);
    // A dataset's samples are taken in order, none skipped or repeated.
    REQUIRE(local == next_local[dataset]);
    ++next_local[dataset];
    ++counts[dataset];
    if (g + 1 == 2 * static_cast<uint64_t>(MixtureSchedule::kBlock)) {
      // Whole blocks: the shares are the weights' to within one ticket per block.
      const double total = 2.0 * MixtureSchedule::kBlock;
      CHECK(std::abs(counts[0] - total * 3.0 / 4.5) <= 2.0);
      CHECK(std::abs(counts[1] - total * 1.0 / 4.5) <= 2.0);
      CHECK(std::abs(counts[2] - total * 0.5 / 4.5) <= 2.0);
    }
  }
  // The interleaving is fine-grained: each count stays within one of its share, so within any 19
  // consecutive samples the 1/9 share shows up.
  for (uint64_t g = 0; g + 19 < 3000; ++g) {
    bool seen = false;
    for (uint64_t k = g; k < g + 19; ++k) seen = seen || schedule.locate(k).first == 2;
    CHECK(seen);
  }
  CHECK_THROWS_AS(MixtureSchedule({1.0, 1e-9}), Error);
  MixtureSchedule single({2.5});
  CHECK(single.locate(123456789).first == 0);
  CHECK(single.locate(123456789).second == 123456789);
}

DataConfig data_config(int64_t seq_len, int64_t micro_batch, int64_t seed = 99) {
  DataConfig config;
  config.seq_len = seq_len;
  config.micro_batch = micro_batch;
  config.seed = seed;
  return config;
}

// The windows of a batch, each as its token ids.
std::vector<std::vector<int32_t>> windows_of(const Batch& batch) {
  std::vector<std::vector<int32_t>> windows;
  for (int64_t b = 0; b < batch.batch_size; ++b) {
    windows.emplace_back(batch.input_ids.begin() + b * batch.seq_len, batch.input_ids.begin() + (b + 1) * batch.seq_len);
  }
  return windows;
}

struct Stream {
  std::vector<std::vector<int32_t>> windows;  // in global sample order
  std::vector<Batch> batches;                 // per step, ranks in order
};

// `steps` micro-batch steps of a job of `world` ranks starting at `cursor`; the windows in
// global sample order (rank 0's batch, then rank 1's, ...).
Stream run_job(const std::vector<DatasetEntry>& entries, const DataConfig& config, int world, int64_t steps,
               uint64_t cursor = 0, uint64_t* cursor_after = nullptr) {
  std::vector<std::unique_ptr<DatasetSource>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::make_unique<DatasetSource>(entries, config, 1 << 20, r, world));
    ranks.back()->seek(cursor);
  }
  Stream stream;
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      Batch batch = ranks[r]->next();
      for (auto& w : windows_of(batch)) stream.windows.push_back(w);
      stream.batches.push_back(batch);
    }
  }
  for (int r = 1; r < world; ++r) REQUIRE(ranks[r]->cursor() == ranks[0]->cursor());
  if (cursor_after) *cursor_after = ranks[0]->cursor();
  return stream;
}

bool same_batch(const Batch& a, const Batch& b) {
  return a.batch_size == b.batch_size && a.seq_len == b.seq_len && a.input_ids == b.input_ids &&
         a.labels == b.labels && a.positions == b.positions && a.cu_seqlens == b.cu_seqlens;
}

TEST_CASE("ranks read disjoint windows that together are the one-rank stream") {
  DataScratchDir dir("shard");
  const std::vector<int64_t> lengths = {30, 7, 55, 12, 3, 90, 41, 16, 8, 22, 64, 5, 19};  // 372 tokens
  write_indexed_dataset(dir.file("d"), numbered_documents(lengths));
  const std::vector<DatasetEntry> entries = {{dir.file("d"), 1.0}};
  const DataConfig config = data_config(16, 2);  // 24 windows per epoch
  DatasetSource probe(entries, config, 1 << 20, 0, 1);
  REQUIRE(probe.windows_per_epoch(0) == 24);

  const Stream one = run_job(entries, config, 1, 24);  // two epochs
  const Stream four = run_job(entries, config, 4, 6);
  REQUIRE(one.windows.size() == 48);
  CHECK(four.windows == one.windows);

  // Each epoch: every token exactly once over all ranks' windows.
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::map<int32_t, int> count;
    for (int w = epoch * 24; w < (epoch + 1) * 24; ++w) {
      for (int32_t token : four.windows[w]) {
        if (token != kPadToken) ++count[token];
      }
    }
    CHECK(count.size() == 372);
    for (const auto& [token, n] : count) CHECK(n == 1);
  }
  // Within a step the four ranks' windows are disjoint (no token twice).
  for (int step = 0; step < 6; ++step) {
    std::set<int32_t> tokens;
    size_t total = 0;
    for (int r = 0; r < 4; ++r) {
      for (int32_t token : four.batches[step * 4 + r].input_ids) {
        if (token != kPadToken) tokens.insert(token), ++total;
      }
    }
    CHECK(tokens.size() == total);
  }
  // The two epochs differ in order.
  CHECK(std::vector<std::vector<int32_t>>(one.windows.begin(), one.windows.begin() + 24) !=
        std::vector<std::vector<int32_t>>(one.windows.begin() + 24, one.windows.end()));
}

TEST_CASE("the stream is deterministic from the seed") {
  DataScratchDir dir("seed");
  write_indexed_dataset(dir.file("d"), numbered_documents({30, 7, 55, 12, 3, 90, 41}));
  const std::vector<DatasetEntry> entries = {{dir.file("d"), 1.0}};
  const Stream a = run_job(entries, data_config(16, 2, 5), 1, 10);
  const Stream b = run_job(entries, data_config(16, 2, 5), 1, 10);
  const Stream c = run_job(entries, data_config(16, 2, 6), 1, 10);
  CHECK(a.windows == b.windows);
  CHECK(a.windows != c.windows);
}

TEST_CASE("resuming at step N gives exactly the uninterrupted batches, on any world size") {
  DataScratchDir dir("resume");
  write_indexed_dataset(dir.file("a"), numbered_documents({30, 7, 55, 12, 3, 90, 41, 16, 8, 22}));
  write_indexed_dataset(dir.file("b"), numbered_documents({11, 60, 9, 33}, 100000));
  const std::vector<DatasetEntry> single = {{dir.file("a"), 1.0}};
  const std::vector<DatasetEntry> mixture = {{dir.file("a"), 2.0}, {dir.file("b"), 1.0}};
  for (const auto* entries : {&single, &mixture}) {
    const DataConfig config = data_config(16, 2);
    for (int world : {1, 4}) {
      INFO("world " << world << ", datasets " << entries->size());
      const Stream whole = run_job(*entries, config, world, 20);
      uint64_t cursor = 0;
      run_job(*entries, config, world, 7, 0, &cursor);
      CHECK(cursor == 7u * world * 2);
      const Stream resumed = run_job(*entries, config, world, 13, cursor);
      REQUIRE(resumed.batches.size() == whole.batches.size() - 7u * world);
      for (size_t i = 0; i < resumed.batches.size(); ++i) {
        CHECK(same_batch(resumed.batches[i], whole.batches[i + 7u * world]));
      }
    }
    // World 2 for 5 steps, then world 4 (and world 3) from its cursor: the same global stream as
    // world 1, nothing repeated, nothing skipped.
    const Stream reference = run_job(*entries, config, 1, 40);
    uint64_t cursor = 0;
    const Stream first = run_job(*entries, config, 2, 5, 0, &cursor);
    REQUIRE(cursor == 20);
    for (int world : {4, 3}) {
      const Stream second = run_job(*entries, config, world, 3, cursor);
      std::vector<std::vector<int32_t>> joined = first.windows;
      joined.insert(joined.end(), second.windows.begin(), second.windows.end());
      CHECK(joined == std::vector<std::vector<int32_t>>(reference.windows.begin(),
                                                        reference.windows.begin() + joined.size()));
    }
  }
}

TEST_CASE("a mixture draws from each dataset by weight, each dataset's epochs complete") {
  DataScratchDir dir("mix");
  write_indexed_dataset(dir.file("a"), numbered_documents({40, 24}));         // 4 windows of 16
  write_indexed_dataset(dir.file("b"), numbered_documents({16, 16}, 100000)); // 2 windows of 16
  const std::vector<DatasetEntry> entries = {{dir.file("a"), 3.0}, {dir.file("b"), 1.0}};
  const Stream stream = run_job(entries, data_config(16, 4), 1, 20);  // 80 samples
  int64_t from_a = 0, from_b = 0;
  std::map<int32_t, int> tokens_of_b;
  for (const auto& window : stream.windows) {
    if (window[0] >= 100000) ++from_b;
    else ++from_a;
    if (window[0] >= 100000) for (int32_t t : window) ++tokens_of_b[t];
  }
  CHECK(from_a == 60);
  CHECK(from_b == 20);
  // b ran through 10 whole epochs: each of its tokens 10 times.
  CHECK(tokens_of_b.size() == 32);
  for (const auto& [token, n] : tokens_of_b) CHECK(n == 10);
}

TEST_CASE("make_data_source picks the source data.source names") {
  DataScratchDir dir("make");
  write_indexed_dataset(dir.file("a"), numbered_documents({40, 24}));
  DataConfig config = data_config(16, 2);
  config.source = dir.file("a");
  std::unique_ptr<DataSource> source = make_data_source(config, 1 << 20, 1, 2);
  Batch batch = source->next();
  CHECK(batch.batch_size == 2);
  CHECK(source->cursor() == 4);
  CHECK(source->describe().find("2 documents, 64 tokens") != std::string::npos);
  CHECK(std::isnan(source->loss_floor()));

  config.source = "synthetic";
  std::unique_ptr<DataSource> synthetic = make_data_source(config, 64, 1, 2);
  synthetic->next();
  CHECK(synthetic->cursor() == 4);  // job-wide windows: 2 ranks x 2
  CHECK(synthetic->loss_floor() > 0);
  // Resuming the synthetic stream at its cursor on another world size continues it.
  std::unique_ptr<DataSource> one_rank = make_data_source(config, 64, 0, 1);
  one_rank->seek(4);
  std::unique_ptr<DataSource> reference = make_data_source(config, 64, 0, 1);
  reference->seek(0);
  for (int i = 0; i < 2; ++i) reference->next();
  CHECK(same_batch(one_rank->next(), reference->next()));
  CHECK_THROWS_AS(synthetic->seek(3), Error);

  config.source = kDataSourceMixture;
  config.mixture = {{dir.file("a"), 1.0}, {dir.file("a"), 1.0}};
  CHECK(make_data_source(config, 1 << 20, 0, 1)->describe().find("weight 1") != std::string::npos);

  config.mixture.clear();
  config.source = dir.file("nothing_here");
  CHECK(data_error(config, 1 << 20).find("nothing_here.idx") != std::string::npos);
}

TEST_CASE("a token id >= vocab is exit code 3 naming file and offset, at start, before any batch") {
  DataScratchDir dir("vocab");
  write_indexed_dataset(dir.file("a"), numbered_documents({10, 6}));  // ids 1..16
  DataConfig config = data_config(8, 2);
  config.source = dir.file("a");
  // Token 16 is the 16th int32 of a.bin: byte offset 60.
  CHECK(data_error(config, 16).find(dir.file("a") + ".bin: token id 16 at byte offset 60") != std::string::npos);
}

TEST_CASE("data whose loss mask selects no token is exit code 3 at start; one such dataset of a mixture warns") {
  DataScratchDir dir("no_targets");
  IndexedDatasetContents none = numbered_documents({10, 6});
  none.loss_masks = {std::vector<uint8_t>(10, 0), std::vector<uint8_t>(6, 0)};
  write_indexed_dataset(dir.file("none"), none);
  IndexedDatasetContents some = numbered_documents({10, 6});
  some.loss_masks = {std::vector<uint8_t>(10, 0), std::vector<uint8_t>(6, 1)};
  write_indexed_dataset(dir.file("some"), some);
  DataConfig config = data_config(8, 2);
  config.source = dir.file("none");
  CHECK(data_error(config, 1 << 20).find(dir.file("none") + ".mask) has no target tokens") != std::string::npos);
  config.source = dir.file("some");
  CHECK_NOTHROW(make_data_source(config, 1 << 20, 0, 1));
  config.source = kDataSourceMixture;
  config.mixture = {DataSourceSpec{dir.file("none"), 1.0}, DataSourceSpec{dir.file("some"), 1.0}};
  CHECK_NOTHROW(make_data_source(config, 1 << 20, 0, 1));
}

}  // namespace
}  // namespace moetrain
