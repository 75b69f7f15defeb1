// AdamW over the trainable parameters, sharded over the ranks that share their gradients, with
// global-norm gradient clipping.
//
// The parameters come in ParameterGroups (core/model/parameter_group.h): flat value and grad
// buffers, each split evenly into one shard per rank of the group. One step:
//   reduce_gradients()  reduce-scatter the flat grads: this rank's shard now holds the sum over
//                       the group's ranks (the flat grads are zeroed for the next step)
//   clip_gradients()    global norm over every group's reduced shard, summed over the ranks
//   step(lr)            AdamW on this rank's shard only (the moments exist for that shard
//                       only), then all-gather of the updated values into every rank's copy
// On one rank (or a group of size 1) the shard is the whole group and nothing is communicated.
//
// The update itself is the backend's `adamw` op, so this class is the same on CPU and CUDA.
// Everything is visited in a fixed order, so the grad norm is reproducible run to run.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/model/parameter.h"
#include "core/model/parameter_group.h"
#include "kernels/ops.h"

namespace moetrain {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied only to parameters with Parameter::weight_decay
};

// One parameter's whole optimizer state, by the parameter's name (what a checkpoint stores).
struct AdamWStateView {
  std::string name;
  TensorView exp_avg;
  TensorView exp_avg_sq;
};

class AdamW {
 public:
  // Groups are not owned and must outlive the optimizer.
  AdamW(const std::vector<ParameterGroup*>& groups, const AdamWOptions& options, kernels::Backend& backend);
  // Loose parameters on one rank (tests, single-process tools): the optimizer gathers them into
  // one group it owns, so their value and grad become views into its buffers until the
  // optimizer is destroyed, which gives them their own storage back.
  AdamW(const std::vector<Parameter*>& params, const AdamWOptions& options, kernels::Backend& backend);
  ~AdamW();

  // After the step's last backward: this rank's shard of every group receives the gradient
  // summed over the group's ranks. A no-op for unsharded groups.
  void reduce_gradients();

  // sqrt(sum of squares of every reduced gradient), summed over every group's ranks (and over the
  // expert blocks for block-partitioned groups), the same on every rank.
  double global_grad_norm();

  // Scales every reduced gradient by max_norm / norm when the global norm exceeds max_norm.
  // Returns the norm before clipping. max_norm <= 0 disables the scaling (the norm is still
  // returned). A non-finite norm leaves the grads untouched: the caller decides to skip the step.
  double clip_gradients(double max_norm);

  // One AdamW update at learning rate `lr` (bias correction uses the 1-based update count) of
  // this rank's shards, the all-gather of the values, then zeroes every grad.
  void step(double lr);

  // Zeroes every grad (and reduced shard) without updating (a skipped step).
  void zero_grad();

  // Completed updates; the next step() uses step_count() + 1 for bias correction.
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t count) { step_count_ = count; }  // resume

  std::vector<Parameter*> parameters() const;
  // Elements of each Adam moment this rank holds: its shards (memory accounting, tests).
  int64_t moment_numel() const;

  // Checkpoints see whole per-parameter moments, whatever the sharding. gather_state() (collective
  // over every sharded group) returns them; the views stay valid until release_state(). To
  // restore, write into the views, then scatter_state() keeps this rank's shard and releases.
  std::vector<AdamWStateView> gather_state();
  void scatter_state();
  void release_state();

  // After reduce_gradients() (tests): writes the reduced gradients back into every parameter's
  // grad, whole, on every rank (collective).
  void gather_gradients();

  const AdamWOptions& options() const { return options_; }

 private:
  // A group's optimizer state: the Adam moments and the reduced gradient of this rank's shard.
  struct GroupState {
    ParameterGroup* group;
    Tensor exp_avg, exp_avg_sq;  // [shard]
    Tensor reduced;              // [shard] when sharded; else the group's grads are the reduced ones
    Tensor send;                 // [shard] when sharded: the all-gather's input
    Tensor whole_avg, whole_avg_sq;  // [ranks * shard] between gather_state() and release_state()
    TensorView reduced_grads() const { return group->sharded() ? reduced.view() : group->grads(); }
  };

  void init_groups(const std::vector<ParameterGroup*>& groups);

  std::unique_ptr<ParameterGroup> owned_group_;
  std::vector<GroupState> groups_;
  AdamWOptions options_;
  kernels::Backend& backend_;
  int64_t step_count_ = 0;
};

}  // namespace moetrain
