// `moetrain train`: from a checked config to a finished run. Picks the backend, builds the
// model (Hugging Face weights or a seeded random base), the data and the trainer, writes the
// resolved config and metrics.jsonl into logging.run_dir, and trains.
#pragma once

#include "core/config/config.h"
#include "parallel/runtime.h"

namespace moetrain {

// Returns the process exit code; errors a user can cause throw moetrain::Error.
int run_training(Runtime& runtime, const Config& config);

}  // namespace moetrain
