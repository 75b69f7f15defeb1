// The learning-rate schedule: linear warmup, then cosine or linear decay to lr * min_lr_ratio
// at the last step, or constant.
//
// `step` is the 0-based optimizer step. Warmup follows the Megatron/Hugging Face convention
// shifted by one so that no step runs at lr 0: step s < warmup_steps gets lr * (s + 1) / warmup.
// Decay runs from lr at step `warmup_steps` to lr * min_lr_ratio at step `steps - 1`; steps
// past the end keep the final value. With no room to decay (steps - 1 <= warmup_steps) the
// peak lr holds after warmup.
#pragma once

#include <cstdint>

#include "core/config/config.h"

namespace moetrain {

// Throws Error(kBadConfig) for an unknown train.schedule.
double learning_rate(const TrainConfig& train, int64_t step);

}  // namespace moetrain
