// The step metrics the progress-line tests format: step 12 of 150 with every number the line
// shows, so that one expected line serves the trainer's and the eval's tests.
#pragma once

#include "core/train/metrics.h"

namespace moetrain::testing {

inline StepMetrics progress_line_metrics() {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 150;
  m.loss = 4.12341;
  m.lr = 1.2e-3;
  m.grad_norm = 0.5321;
  m.tokens_per_s = 12345;
  m.max_expert_load = 1.4213;
  return m;
}

}  // namespace moetrain::testing
