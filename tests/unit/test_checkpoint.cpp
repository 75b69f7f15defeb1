// Checkpoint files: the commit protocol, manifest validation, corruption detection, keep-last
// pruning, and resharding (a tensor saved by 4 ranks read back by 2 and by 1). Multi-rank
// saves run as threads through an in-process CheckpointGroup, so the protocol's collectives
// are exercised without MPI.
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/checkpoint/checkpoint_writer.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

// Ranks as threads: every collective is a barrier over a shared slot table.
class ThreadWorld {
 public:
  // The logger is created on first use; do that here, not racing in the rank threads.
  explicit ThreadWorld(int world) : world_(world), slots_(world) { log::set_level(log::Level::kWarn); }
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    int generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }
  std::vector<std::string> exchange(int rank, const std::string& text) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[rank] = text;
    }
    barrier();
    std::vector<std::string> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all = slots_;
    }
    barrier();
    return all;
  }
  int world() const { return world_; }

 private:
  int world_;
  std::vector<std::string> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int generation_ = 0;
};

class ThreadGroup final : public CheckpointGroup {
 public:
  ThreadGroup(ThreadWorld& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return world_.world(); }
  void barrier() override { world_.barrier(); }
  bool any(bool flag) override {
    for (const std::string& s : world_.exchange(rank_, flag ? "1" : "0"))
      if (s == "1") return true;
    return false;
  }
  std::vector<std::string> gather_to_root(const std::string& text) override {
    std::vector<std::string> all = world_.exchange(rank_, text);
    return rank_ == 0 ? all : std::vector<std::string>{};
  }
  std::string broadcast_from_root(const std::string& text) override { return world_.exchange(rank_, text)[0]; }

 private:
  ThreadWorld& world_;
  int rank_;
};

std::string fresh_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("moetrain_test_checkpoint_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// A global [rows, 3] tensor with value 100 * row + column, and a [rows] one with -row.
Tensor global_matrix(int64_t rows) {
  Tensor t({rows, 3}, DType::kF32);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 3; ++c) t.ptr<float>()[r * 3 + c] = static_cast<float>(100 * r + c);
  return t;
}

// Rank r of `world` owns rows [begin, end) of a tensor of `rows` rows (uneven split: FSDP pads,
// EP gives contiguous expert ranges; any contiguous partition must work).
std::pair<int64_t, int64_t> rows_of(int rank, int world, int64_t rows) {
  int64_t base = rows / world, extra = rows % world;
  int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

SaveRequest request_for(const std::string& root, int64_t step) {
  SaveRequest request;
  request.root = root;
  request.step = step;
  request.tokens = step * 10;
  request.optimizer_steps = step;
  request.config_yaml = "train: {steps: 5}\n";
  request.keep_last = 2;
  return request;
}

// Saves step `step` from `world` threads, each holding its rows of a 10-row matrix.
void save_sharded(const std::string& root, int world, int64_t step) {
  Tensor global = global_matrix(10);
  ThreadWorld threads(world);
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      try {
        ThreadGroup group(threads, r);
        auto [begin, end] = rows_of(r, world, 10);
        RankShard shard;
        shard.tensors.push_back(ShardTensor{"param/w", global.view().slice_rows(begin, end), {{10, 3}, begin}});
        shard.data_cursor = 7 + r;
        save_checkpoint(group, request_for(root, step), shard);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const std::string& e : errors) REQUIRE(e == "");
}

void check_rows(const Tensor& got, int64_t first_row) {
  for (int64_t r = 0; r < got.size(0); ++r)
    for (int64_t c = 0; c < 3; ++c) CHECK(got.ptr<float>()[r * 3 + c] == static_cast<float>(100 * (first_row + r) + c));
}

ExitCode code_of(const std::function<void()>& f, std::string* message) {
  try {
    f();
  } catch (const Error& e) {
    *message = e.what();
    return e.code();
  }
  return ExitCode::kOk;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("resharding: 4 saved shards read back at world 4, 2 and 1") {
  std::string root = fresh_dir("reshard");
  save_sharded(root, 4, 3);
  CheckpointReader reader(root + "/step_3");
  CHECK(reader.manifest().world == 4);
  CHECK(reader.manifest().files.size() == 4);
  CHECK(reader.global_shape("param/w") == Shape{10, 3});
  for (int world : {4, 2, 1, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      auto [begin, end] = rows_of(rank, world, 10);
      Tensor got = reader.read_rows("param/w", begin, end, DType::kF32);
      REQUIRE(got.shape() == Shape{end - begin, 3});
      check_rows(got, begin);
    }
  }
  Tensor as_double = reader.read("param/w", DType::kF64);
  CHECK(as_double.ptr<double>()[9 * 3 + 2] == 902.0);
  // Cursors of every saving rank are in the manifest, in rank order.
  for (int r = 0; r < 4; ++r) CHECK(reader.manifest().ranks[r].data_cursor == static_cast<uint64_t>(7 + r));
}

TEST_CASE("commit protocol: latest, keep_last, no overwrite, leftovers cleaned") {
  std::string root = fresh_dir("protocol");
  for (int64_t step : {2, 4, 6}) save_sharded(root, 2, step);
  std::vector<CheckpointRef> all = list_committed_checkpoints(root);
  REQUIRE(all.size() == 2);  // keep_last 2: step_2 went after step_6 was committed
  CHECK(all[0].step == 4);
  CHECK(all[1].step == 6);
  std::ifstream latest(root + "/latest");
  std::string line;
  std::getline(latest, line);
  CHECK(line == "step_6");

  // An existing checkpoint is never written into.
  std::string message;
  auto group = make_single_process_group();
  Tensor w = global_matrix(10);
  RankShard shard;
  shard.tensors.push_back(ShardTensor{"param/w", w.view(), {{10, 3}, 0}});
  CHECK(code_of([&] { save_checkpoint(*group, request_for(root, 6), shard); }, &message) == ExitCode::kBadCheckpoint);
  CHECK(message.find("already exists") != std::string::npos);
  CheckpointReader still(root + "/step_6");  // intact: verifies every checksum
  CHECK(still.manifest().world == 2);

  // Leftovers of a crash are not checkpoints, and are removed.
  fs::create_directories(root + "/step_8.tmp");
  fs::create_directories(root + "/step_2.deleting");
  fs::create_directories(root + "/step_9");  // no manifest: never committed
  CHECK(newest_committed_checkpoint(root)->step == 6);
  CHECK(remove_incomplete_checkpoints(root) == 2);
  CHECK(!fs::exists(root + "/step_8.tmp"));
  CHECK(resolve_checkpoint_path(root) == all[1].path);
}

TEST_CASE("corruption: flipped byte, truncation, missing shard, bad manifest are exit 4 naming the file") {
  struct Case {
    const char* name;
    std::function<void(const std::string& dir)> damage;
    const char* expected;
  };
  std::vector<Case> cases = {
      {"flipped byte", [](const std::string& d) { flip_byte(d + "/rank_00001.safetensors", 200); },
       "rank_00001.safetensors has crc32"},
      {"truncated", [](const std::string& d) { fs::resize_file(d + "/rank_00000.safetensors", 100); },
       "rank_00000.safetensors has 100 bytes"},
      {"missing shard", [](const std::string& d) { fs::remove(d + "/rank_00001.safetensors"); },
       "rank_00001.safetensors is missing"},
      {"manifest not JSON", [](const std::string& d) { std::ofstream(d + "/manifest.json") << "{\"step\": 3,"; },
       "manifest.json: not valid JSON"},
      {"manifest flipped", [](const std::string& d) { flip_byte(d + "/manifest.json", 2); }, "manifest.json"},
      {"manifest missing", [](const std::string& d) { fs::remove(d + "/manifest.json"); }, "manifest.json"},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      std::string root = fresh_dir("corrupt");
      save_sharded(root, 2, 3);
      c.damage(root + "/step_3");
      std::string message;
      CHECK(code_of([&] { CheckpointReader reader(root + "/step_3"); }, &message) == ExitCode::kBadCheckpoint);
      INFO(message);
      CHECK(message.find(c.expected) != std::string::npos);
    }
  }
}

TEST_CASE("manifest: paths confined to the checkpoint directory, entries per rank") {
  Manifest m;
  m.step = 3;
  m.tokens = 30;
  m.optimizer_steps = 3;
  m.world = 2;
  m.config_yaml = "x: 1";
  m.ranks = {{0, 5, 1}, {1, 6, 2}};
  m.files = {{"rank_00000.safetensors", 0, 10, 0xdeadbeef}, {"rank_00001.safetensors", 1, 11, 0x1}};
  Manifest back = parse_manifest(manifest_to_json(m), "m.json");
  CHECK(back.files[0].crc32 == 0xdeadbeefu);
  CHECK(back.ranks[1].data_cursor == 6u);
  CHECK(back.ranks[1].rng_state == 2u);
  std::string message;
  for (const char* path : {"../rank_00000.safetensors", "/etc/passwd", "sub/rank.safetensors", "..", ""}) {
    Manifest bad = m;
    bad.files[0].path = path;
    CHECK(code_of([&] { parse_manifest(manifest_to_json(bad), "m.json"); }, &message) == ExitCode::kBadCheckpoint);
    CHECK(message.find("leaves the checkpoint directory") != std::string::npos);
  }
  Manifest short_ranks = m;
  short_ranks.ranks.pop_back();
  CHECK(code_of([&] { parse_manifest(manifest_to_json(short_ranks), "m.json"); }, &message) == ExitCode::kBadCheckpoint);
  CHECK(message.find("1 ranks and 2 files for a world of 2") != std::string::npos);
  CHECK(parse_checkpoint_dir_name("step_12") == 12);
  CHECK(parse_checkpoint_dir_name("step_12.tmp") == -1);
  CHECK(parse_checkpoint_dir_name("step_") == -1);
}

TEST_CASE("resharding: a gap or an overlap between shards is an error naming the tensor") {
  std::string root = fresh_dir("tiling");
  Tensor global = global_matrix(10);
  ThreadWorld threads(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ThreadGroup group(threads, r);
      RankShard shard;
      // Rank 0 holds rows [0, 4), rank 1 rows [5, 10): row 4 is in no shard.
      int64_t begin = r == 0 ? 0 : 5, end = r == 0 ? 4 : 10;
      shard.tensors.push_back(ShardTensor{"param/w", global.view().slice_rows(begin, end), {{10, 3}, begin}});
      save_checkpoint(group, request_for(root, 1), shard);
    });
  }
  for (std::thread& t : ranks) t.join();
  std::string message;
  CHECK(code_of([&] { CheckpointReader reader(root + "/step_1"); }, &message) == ExitCode::kBadCheckpoint);
  CHECK(message.find("tensor \"param/w\": rows [4, 5) are in no shard") != std::string::npos);
}
