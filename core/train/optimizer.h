// AdamW over the trainable parameters, with global-norm gradient clipping.
//
// The moments live next to their parameter (same shape and dtype, on the backend's device) and
// the update itself is the backend's `adamw` op, so this class is the same on CPU and CUDA.
// Everything that visits all parameters does so in the order they were given, so the grad
// norm (a sum of per-parameter sums) is reproducible run to run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/model/parameter.h"
#include "kernels/ops.h"

namespace moetrain {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied only to parameters with Parameter::weight_decay
};

// One parameter's optimizer state, by the parameter's name (what a checkpoint stores).
// The views alias the optimizer's tensors: a checkpoint loader writes into them.
struct AdamWStateView {
  std::string name;
  TensorView exp_avg;
  TensorView exp_avg_sq;
};

class AdamW {
 public:
  // Allocates zero moments for every parameter on backend.allocator(). Parameters must have a
  // defined grad of the value's shape and dtype and unique names (checked: a bug otherwise).
  AdamW(const std::vector<Parameter*>& params, const AdamWOptions& options, kernels::Backend& backend);

  // sqrt(sum over parameters of sum(grad^2)), in parameter order; the expert_partitioned
  // parameters' part goes through `sum_over_expert_blocks` when set (expert parallelism).
  double global_grad_norm();
  void set_expert_block_sum(std::function<double(double)> sum_over_expert_blocks) {
    sum_over_expert_blocks_ = std::move(sum_over_expert_blocks);
  }

  // Scales every grad by max_norm / norm when the global norm exceeds max_norm. Returns the
  // norm before clipping. max_norm <= 0 disables the scaling (the norm is still returned). A
  // non-finite norm leaves the grads untouched: the caller decides to skip the step.
  double clip_gradients(double max_norm);

  // One AdamW update at learning rate `lr` (bias correction uses the 1-based update count),
  // then zeroes every grad for the next accumulation.
  void step(double lr);

  // Zeroes every grad without updating (a skipped step).
  void zero_grad();

  // Completed updates; the next step() uses step_count() + 1 for bias correction.
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t count) { step_count_ = count; }  // resume

  const std::vector<Parameter*>& parameters() const { return params_; }
  std::vector<AdamWStateView> state();
  const AdamWOptions& options() const { return options_; }

 private:
  std::function<double(double)> sum_over_expert_blocks_;
  struct Moments {
    Tensor exp_avg;
    Tensor exp_avg_sq;
  };

  std::vector<Parameter*> params_;
  std::vector<Moments> moments_;
  AdamWOptions options_;
  kernels::Backend& backend_;
  int64_t step_count_ = 0;
};

}  // namespace moetrain
