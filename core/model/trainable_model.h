// The model as the training loop sees it (core/train/trainer.h drives it): its parameters, one
// micro-batch's forward and backward with the result the loop reads (StepResult, possibly still
// on its way from the device: PendingStep), and forward-only evaluation. core/model/model.h
// implements it; tests implement small ones.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/base/error.h"
#include "core/data/batch.h"
#include "core/model/parameter.h"
#include "core/model/parameter_group.h"
#include "kernels/ops.h"

namespace moetrain {

// What one pass's forward/backward reports: one micro-batch's, or an expert window's (the
// micro-batches run together, forward_backward_window_async).
struct StepResult {
  double loss_sum = 0.0;         // summed cross-entropy over the pass's targets (unscaled)
  // Per micro-batch of the pass, in order: its loss sum, each summed as a pass of its own would
  // be, so that a step adding them in order gets the sequential micro-batches' sum bit for bit.
  std::vector<double> micro_batch_loss_sums;
  int64_t targets = 0;           // its target tokens (labels >= 0)
  double max_expert_load = 0.0;  // max over MoE layers and experts of load / mean load
  double aux_loss = 0.0;         // its load-balancing loss value, summed over its micro-batches
  // Per MoE layer, in layer order: max and min over experts of load / mean load (empty when
  // the model has no MoE layer).
  std::vector<double> expert_load_max, expert_load_min;
  // Per MoE layer, per expert (all of them, as this rank routed its tokens): the rows the pass
  // sent it, summed over the pass's grouped GEMM calls (one per feed-forward token chunk).
  std::vector<std::vector<int64_t>> expert_rows;
  int64_t expert_gemm_calls = 0;  // those calls per MoE layer (0: no MoE layer)
};

// A micro-batch's StepResult that may still be on its way from the device: get() waits for it
// (a host wait only when the device has not finished the micro-batch yet) and reads it once.
class PendingStep {
 public:
  PendingStep() = default;
  explicit PendingStep(StepResult ready) : result_(std::move(ready)), ready_(true) {}
  explicit PendingStep(std::function<StepResult()> read) : read_(std::move(read)) {}
  const StepResult& get() {
    if (!ready_) {
      result_ = read_();
      read_ = nullptr;
      ready_ = true;
    }
    return result_;
  }

 private:
  std::function<StepResult()> read_;
  StepResult result_;
  bool ready_ = false;
};

// State outside the parameters that training changes and checkpoints save (the MoE layers'
// selection biases under aux-loss-free balancing): its name (the HF tensor's) and value, the
// same on every rank.
struct TrainedBuffer {
  std::string name;
  Tensor* value = nullptr;
};

// The model as the loop sees it.
class TrainableModel {
 public:
  virtual ~TrainableModel() = default;
  // The trainable parameters, in a fixed order (the optimizer and grad norm follow it).
  virtual std::vector<Parameter*> parameters() = 0;
  // Forward and backward on one micro-batch: ADDS grad_scale * d(sum of target losses)/dparam
  // to every parameter's grad (plus the aux loss's gradient, by the model's own scaling).
  virtual StepResult forward_backward(const Batch& batch, double grad_scale) = 0;
  // The same, returning once the work is queued: the result is read when asked for, so the host
  // can queue further micro-batches (and the optimizer) while the device works. By default the
  // work is done when forward_backward returns.
  virtual PendingStep forward_backward_async(const Batch& batch, double grad_scale) {
    return PendingStep(forward_backward(batch, grad_scale));
  }
  // An expert window (train.expert_window): forward and backward of these micro-batches of one
  // optimizer step together, as forward_backward_async of each would ADD to the gradients, in one
  // pass (each MoE layer's grouped GEMM takes the rows of all of them at once). The result is the
  // window's (micro_batch_loss_sums in order). By default a model cannot.
  virtual PendingStep forward_backward_window_async(const std::vector<const Batch*>& /*window*/,
                                                    double /*grad_scale*/) {
    throw Error(ExitCode::kBadConfig, "this model runs no expert window: set train.expert_window to 1");
  }
  // hold_parameters(true): the trainable parameters keep their values until hold_parameters(false)
  // (the trainer holds them over an optimizer step's micro-batches), so the model may reuse what
  // it derives from them (the experts' adapters packed in the compute dtype) across
  // forward_backward calls; false drops those copies. Not held, every call derives them afresh.
  virtual void hold_parameters(bool /*hold*/) {}
  virtual kernels::Backend& backend() = 0;
  // Forward only (data.eval): the micro-batch's summed loss and target count, with no gradient,
  // no change to any parameter, and no change to what later forward_backward calls compute (the
  // router-noise stream stays where it was; no noise is drawn). By default a model cannot.
  virtual StepResult evaluate(const Batch& /*batch*/) {
    throw Error(ExitCode::kInternal, "this model has no forward-only evaluation (data.eval)");
  }

  // The parameters grouped by the ranks their gradients sum over (data parallelism), in the
  // order of parameters(); the optimizer shards each group over its ranks. Empty: one rank,
  // and the optimizer groups parameters() itself.
  virtual std::vector<ParameterGroup*> parameter_groups() { return {}; }
  // A value summed over all data-parallel ranks (the identity on one rank).
  virtual double sum_over_data_ranks(double local) { return local; }

  // Aux-loss-free balancing (model.moe.bias_update_rate), after an optimizer step: `step_rows`
  // per MoE layer, per expert, the rows this rank sent it over the whole step
  // (StepResult::expert_rows summed over the step's passes); the model sums them over every rank
  // and moves each layer's selection bias. Every rank calls it together. By default a no-op.
  virtual void update_expert_bias(const std::vector<std::vector<int64_t>>& /*step_rows*/) {}
  // What that update changes (empty without it): checkpoints save and restore it.
  virtual std::vector<TrainedBuffer> trained_buffers() { return {}; }
};

}  // namespace moetrain
