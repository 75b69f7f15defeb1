// A run never loses or fakes work (docs/CHECKPOINTS.md, "The run directory" and "Health"):
// a fresh start never mixes with an older run's checkpoints, a run directory has one owner at a
// time, nothing is checkpointed while updates are being skipped as non-finite, a checkpoint
// holding a NaN is refused (and --resume auto falls back past it), a checkpoint at or past
// train.steps is "nothing to do", the end of a run always saves, and a config that cannot
// continue a checkpoint names the keys that changed.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/run_directory.h"
#include "tiny_model.h"
#include "training_run.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

Config safety_config(const std::string& name) {
  Config c = testing::short_lora_run_config(6);
  c.data.seq_len = 8;
  const fs::path dir = fs::temp_directory_path() / ("moetrain_test_run_safety_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  c.logging.run_dir = dir.string();
  c.checkpoint.every = 2;
  c.checkpoint.export_adapter = "false";
  return c;
}

std::string checkpoints_of(const Config& c) { return (fs::path(c.logging.run_dir) / "checkpoints").string(); }

std::vector<int64_t> committed_steps(const Config& c) {
  std::vector<int64_t> steps;
  for (const CheckpointRef& ref : list_committed_checkpoints(checkpoints_of(c))) steps.push_back(ref.step);
  return steps;
}

// What `error` says, and its exit code, from running `body`.
template <class F>
std::pair<ExitCode, std::string> error_of(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ExitCode::kOk, ""};
}

// What resuming a run of `config` says, and its exit code; the run is gone afterwards.
std::pair<ExitCode, std::string> resume_error(const Config& config) {
  testing::TrainingRun run(config);
  return error_of([&] { run.session->resume(); });
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void poison_first_adapter(testing::TrainingRun& run) {
  run.model->parameters().front()->value.ptr<float>()[0] = std::numeric_limits<float>::quiet_NaN();
}

// Starts `run` (resuming what its run directory holds) and trains `steps` steps (a saved
// checkpoint every 2 steps).
void start_and_train(testing::TrainingRun& run, int steps) {
  run.session->resume();
  for (int i = 0; i < steps; ++i) run.trainer->train_step();
}

// Trains `steps` steps of `c` into its run directory.
void train_steps(const Config& c, int steps) {
  testing::TrainingRun run(c);
  start_and_train(run, steps);
}

// Trains `steps` steps of `c`, then resumes with the config `change` makes of `c`: the resume is
// refused as a bad config, and what it says is returned.
template <class F>
std::string refused_resume(const Config& c, int steps, F&& change) {
  train_steps(c, steps);
  Config changed = c;
  change(changed);
  auto [code, message] = resume_error(changed);
  CHECK(code == ExitCode::kBadConfig);
  return message;
}

}  // namespace

TEST_CASE("run directory: a fresh start among another run's checkpoints is refused, or moved aside on consent") {
  Config c = safety_config("fresh");
  train_steps(c, 4);  // step_2, step_4
  REQUIRE(committed_steps(c) == std::vector<int64_t>{2, 4});
  { std::ofstream(fs::path(c.logging.run_dir) / "metrics.jsonl") << "{\"step\": 1}\n"; }

  Config fresh = c;
  fresh.checkpoint.resume = "none";
  auto [code, message] = error_of([&] { RunDirectory claim(fresh); });
  CHECK(code == ExitCode::kBadConfig);
  CHECK(contains(message, "holds checkpoints of another run (steps 2, 4)"));
  CHECK(contains(message, "checkpoint.overwrite=true"));
  CHECK(committed_steps(c) == std::vector<int64_t>{2, 4});  // untouched

  // A resume from step 2 by path, with step 4 present, would rotate step 4's successors out too.
  Config from_two = c;
  from_two.checkpoint.resume = checkpoints_of(c) + "/step_2";
  CHECK(error_of([&] { RunDirectory claim(from_two); }).first == ExitCode::kBadConfig);

  fresh.checkpoint.overwrite = true;
  {
    RunDirectory claim(fresh);
    CHECK(claim.fresh_start());
  }
  CHECK(committed_steps(c).empty());
  int moved_dirs = 0, moved_metrics = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(c.logging.run_dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("checkpoints.old-", 0) == 0) {
      ++moved_dirs;
      CHECK(fs::exists(e.path() / "step_2" / "manifest.json"));
      CHECK(fs::exists(e.path() / "step_4" / "manifest.json"));
    }
    if (name.rfind("metrics.old-", 0) == 0) ++moved_metrics;
  }
  CHECK(moved_dirs == 1);
  CHECK(moved_metrics == 1);
  CHECK(!fs::exists(fs::path(c.logging.run_dir) / "metrics.jsonl"));
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("run directory: one owner at a time, named; a dead owner's lock is taken over") {
  Config c = safety_config("lock");
  {
    RunDirectory owner(c);
    auto [code, message] = error_of([&] { RunDirectory second(c); });
    CHECK(code == ExitCode::kBadConfig);
    CHECK(contains(message, "is in use by another run (pid " + std::to_string(::getpid()) + " on host "));
  }
  // Released: the next run takes it.
  { CHECK_NOTHROW(RunDirectory{c}); }
  // A lock file left by a run that died (its owner named, no flock held) does not block.
  { std::ofstream(fs::path(c.logging.run_dir) / "moetrain.lock") << "pid 999999 on host elsewhere\n"; }
  CHECK_NOTHROW(RunDirectory{c});
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("run directory: every output path is checked before the first step") {
  Config c = safety_config("paths");
  fs::create_directories(c.logging.run_dir);
  const std::string file = (fs::path(c.logging.run_dir) / "a_file").string();
  { std::ofstream(file) << "x"; }
  Config export_to_file = c;
  export_to_file.checkpoint.export_adapter = file;
  auto [code, message] = error_of([&] { RunDirectory claim(export_to_file); });
  CHECK(code == ExitCode::kBadConfig);
  CHECK(contains(message, "checkpoint.export_adapter: " + file + " exists and is not a directory"));
  Config root_is_file = c;
  root_is_file.checkpoint.dir = file;
  std::tie(code, message) = error_of([&] { RunDirectory claim(root_is_file); });
  CHECK(code == ExitCode::kBadConfig);
  CHECK(contains(message, "checkpoint.dir: " + file + " exists and is not a directory"));
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("health: no checkpoint is written or rotated while updates are skipped as non-finite") {
  Config c = safety_config("unhealthy");
  testing::TrainingRun run(c);
  start_and_train(run, 2);  // step_2
  poison_first_adapter(run);
  run.trainer->train_step();  // non-finite: skipped
  run.trainer->train_step();  // due a save at step 4: not written
  CHECK(run.trainer->nonfinite_in_a_row() == 2);
  CHECK(committed_steps(c) == std::vector<int64_t>{2});
  auto [code, message] = error_of([&] { run.session->finish(); });
  CHECK(code == ExitCode::kInternal);
  CHECK(contains(message, "training ended unhealthy"));
  CHECK(contains(message, "the last good checkpoint is " + checkpoints_of(c) + "/step_2"));
  CHECK(committed_steps(c) == std::vector<int64_t>{2});
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("health: a checkpoint holding a NaN is refused by path, and --resume auto falls back past it") {
  Config c = safety_config("nan_checkpoint");
  {
    testing::TrainingRun run(c);
    start_and_train(run, 3);  // step_2, then a step more
    poison_first_adapter(run);
    run.session->save_now();    // step_3, as an older moetrain would have saved it
  }
  REQUIRE(committed_steps(c) == std::vector<int64_t>{2, 3});
  Config by_path = c;
  by_path.checkpoint.resume = checkpoints_of(c) + "/step_3";
  {
    auto [code, message] = resume_error(by_path);
    CHECK(code == ExitCode::kBadCheckpoint);
    CHECK(contains(message, "holds a non-finite value"));
    CHECK(contains(message, "param/"));
  }
  testing::TrainingRun resumed(c);
  REQUIRE(resumed.session->resume());
  CHECK(resumed.trainer->next_step() == 2);
  CHECK(committed_steps(c) == std::vector<int64_t>{2});
  CHECK(fs::exists(checkpoints_of(c) + "/step_3.unusable/manifest.json"));  // kept for a look
  // The run goes on and saves step 4 (and could save step 3 again) without a collision.
  for (int i = 0; i < 2; ++i) resumed.trainer->train_step();
  CHECK(committed_steps(c) == std::vector<int64_t>{2, 4});
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("resume: a checkpoint at or past train.steps is nothing to do, not a silent success") {
  Config c = safety_config("nothing_to_do");
  const std::string message = refused_resume(c, 4, [](Config& shorter) { shorter.train.steps = 4; });
  CHECK(contains(message, "nothing to do: " + checkpoints_of(c) + "/step_4 is at step 4 and train.steps is 4"));
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("finish: the end of a run is saved with checkpoint.every 0") {
  Config c = safety_config("every_zero");
  c.checkpoint.every = 0;
  c.train.steps = 3;
  testing::TrainingRun run(c);
  run.session->resume();
  run.trainer->run();
  CHECK(committed_steps(c).empty());
  run.session->finish();
  CHECK(committed_steps(c) == std::vector<int64_t>{3});
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("resume: a config that cannot continue the checkpoint names what changed") {
  Config c = safety_config("differs");
  const std::string message = refused_resume(c, 2, [](Config& other_rank) { other_rank.lora.rank = 8; });
  CHECK(contains(message, "it differs in lora.rank: 4 -> 8"));
  CHECK(contains(message, "use another logging.run_dir"));
  fs::remove_all(c.logging.run_dir);
}

TEST_CASE("finish: an export that fails loses nothing: the checkpoint is saved first and named") {
  Config c = safety_config("export_fails");
  c.checkpoint.every = 0;
  c.train.steps = 2;
  const std::string out = (fs::path(c.logging.run_dir) / "adapter_out").string();
  c.checkpoint.export_adapter = out;
  testing::TrainingRun run(c);
  run.session->resume();
  run.trainer->run();
  // The export directory was fine at start (RunDirectory checks it); now a file is in the way.
  fs::create_directories(c.logging.run_dir);
  { std::ofstream(out) << "in the way"; }
  auto [code, message] = error_of([&] { run.session->finish(); });
  CHECK(code != ExitCode::kOk);
  CHECK(contains(message, "The adapter was not exported, but the training is saved in " + checkpoints_of(c) + "/step_2"));
  CHECK(contains(message, "moetrain export --checkpoint " + checkpoints_of(c) + "/step_2"));
  CHECK(committed_steps(c) == std::vector<int64_t>{2});
  fs::remove_all(c.logging.run_dir);
}
