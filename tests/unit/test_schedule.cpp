// The lr schedule against values worked out by hand from its definition (schedule.h):
// warmup lr * (s + 1) / W, then decay from lr at step W to lr * min_lr_ratio at step steps - 1.
#include <cmath>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/train/schedule.h"

using moetrain::Error;
using moetrain::ExitCode;
using moetrain::TrainConfig;
using moetrain::learning_rate;

namespace {

bool near(double actual, double expected, double tolerance = 1e-15) {
  return std::abs(actual - expected) <= tolerance;
}

TrainConfig schedule_config(double lr, int64_t warmup_steps, int64_t steps, double min_lr_ratio, const char* schedule) {
  TrainConfig train;
  train.lr = lr;
  train.warmup_steps = warmup_steps;
  train.steps = steps;
  train.min_lr_ratio = min_lr_ratio;
  train.schedule = schedule;
  return train;
}

// lr 1e-3, 4 warmup steps, 13 steps: decay over steps 4..12 (8 intervals), floor 1e-4.
TrainConfig thirteen_steps(const char* schedule) { return schedule_config(1e-3, 4, 13, 0.1, schedule); }

}  // namespace

TEST_CASE("warmup rises linearly and never runs a step at lr 0") {
  for (const char* schedule : {"cosine", "linear", "constant"}) {
    const TrainConfig train = thirteen_steps(schedule);
    CHECK(near(learning_rate(train, 0), 0.25e-3));
    CHECK(near(learning_rate(train, 1), 0.50e-3));
    CHECK(near(learning_rate(train, 2), 0.75e-3));
    CHECK(near(learning_rate(train, 3), 1.00e-3));
    CHECK(near(learning_rate(train, 4), 1.00e-3));  // the first decay step is the peak
  }
}

TEST_CASE("cosine decay hits hand-computed points") {
  const TrainConfig train = thirteen_steps("cosine");
  // step 6: progress 2/8, 0.5 * (1 + cos(pi/4)) = 0.5 + sqrt(2)/4
  CHECK(near(learning_rate(train, 6), 1e-4 + 9e-4 * (0.5 + std::sqrt(2.0) / 4)));
  // step 8: progress 1/2, halfway between peak and floor
  CHECK(near(learning_rate(train, 8), 5.5e-4));
  // step 10: progress 6/8, 0.5 * (1 + cos(3 pi/4)) = 0.5 - sqrt(2)/4
  CHECK(near(learning_rate(train, 10), 1e-4 + 9e-4 * (0.5 - std::sqrt(2.0) / 4)));
  CHECK(near(learning_rate(train, 12), 1e-4));   // the last step ends at the floor
  CHECK(near(learning_rate(train, 50), 1e-4));   // and stays there past the end
}

TEST_CASE("linear decay hits hand-computed points") {
  const TrainConfig train = thirteen_steps("linear");
  CHECK(near(learning_rate(train, 6), 1e-3 - 9e-4 * 0.25));
  CHECK(near(learning_rate(train, 8), 5.5e-4));
  CHECK(near(learning_rate(train, 11), 1e-3 - 9e-4 * 7.0 / 8.0));
  CHECK(near(learning_rate(train, 12), 1e-4));
}

TEST_CASE("constant holds the peak after warmup") {
  const TrainConfig train = thirteen_steps("constant");
  for (int64_t step = 4; step < 40; ++step) CHECK(near(learning_rate(train, step), 1e-3));
}

TEST_CASE("decaying schedules are monotone and stay within [floor, peak]") {
  for (const char* schedule : {"cosine", "linear"}) {
    const TrainConfig train = schedule_config(3e-4, 10, 100, 0.05, schedule);
    double previous = 0.0;
    for (int64_t step = 0; step < train.steps; ++step) {
      const double lr = learning_rate(train, step);
      if (step < train.warmup_steps) {
        CHECK(lr > previous);
      } else if (step > train.warmup_steps) {
        CHECK(lr < previous);
      }
      CHECK(lr <= 3e-4 * (1 + 1e-12));
      CHECK(lr >= 3e-4 * 0.05 * (1 - 1e-12));
      previous = lr;
    }
    CHECK(near(learning_rate(train, 99), 3e-4 * 0.05, 1e-18));
  }
}

TEST_CASE("no warmup starts at the peak; no room to decay keeps the peak") {
  TrainConfig train;
  train.lr = 2e-4;
  train.warmup_steps = 0;
  train.steps = 5;
  train.min_lr_ratio = 0.0;
  train.schedule = "linear";
  CHECK(near(learning_rate(train, 0), 2e-4));
  CHECK(near(learning_rate(train, 2), 1e-4));  // progress 2/4
  CHECK(near(learning_rate(train, 4), 0.0));

  train.steps = 1;
  CHECK(near(learning_rate(train, 0), 2e-4));
  train.steps = 3;
  train.warmup_steps = 3;  // every step is warmup
  CHECK(near(learning_rate(train, 2), 2e-4));
}

TEST_CASE("an unknown schedule is a config error naming the key") {
  TrainConfig train;
  train.schedule = "cosine_with_restarts";
  CHECK_THROWS_AS(learning_rate(train, 0), Error);
  try {
    learning_rate(train, 0);
  } catch (const Error& error) {
    CHECK(error.code() == ExitCode::kBadConfig);
    CHECK(std::string(error.what()).find("train.schedule") != std::string::npos);
  }
}
