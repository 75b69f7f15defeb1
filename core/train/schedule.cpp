#include "core/train/schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/base/error.h"

namespace moetrain {

double learning_rate(const TrainConfig& train, int64_t step) {
  const bool cosine = train.schedule == "cosine";
  const bool linear = train.schedule == "linear";
  const bool constant = train.schedule == "constant";
  MOETRAIN_CHECK(cosine || linear || constant, ExitCode::kBadConfig,
                 "train.schedule: unknown schedule '" + train.schedule +
                     "'; use cosine, linear or constant");
  const double peak = train.lr;
  step = std::max<int64_t>(step, 0);
  if (step < train.warmup_steps) {
    return peak * static_cast<double>(step + 1) / static_cast<double>(train.warmup_steps);
  }
  const int64_t warmup = std::max<int64_t>(train.warmup_steps, 0);
  const int64_t decay_steps = train.steps - 1 - warmup;
  if (constant || decay_steps <= 0) return peak;

  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
  const double floor = peak * train.min_lr_ratio;
  if (linear) return peak - (peak - floor) * progress;
  const double pi = std::acos(-1.0);
  return floor + (peak - floor) * 0.5 * (1.0 + std::cos(pi * progress));
}

}  // namespace moetrain
