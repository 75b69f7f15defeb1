// The single-process training loop: micro-batches -> forward/backward (gradients accumulate)
// -> global-norm clip -> AdamW at the scheduled lr -> metrics -> after-step hook.
//
// Loss normalisation: every target token of an optimizer step weighs the same, however the
// targets fall into micro-batches. The trainer reads all grad_accum micro-batches first, counts
// their targets T, and passes grad_scale = 1 / T to every backward; the reported loss is
// sum(loss) / T. So accumulating two micro-batches gives exactly the gradient of one batch
// holding both.
//
// Non-finite loss or gradient norm: the update is skipped (grads zeroed, parameters and Adam
// state untouched) with a warning, and the step still counts (its data is consumed and the lr
// schedule moves on, as in Megatron). After max_nonfinite_steps such steps in a row the run
// stops with Error(kInternal), naming the step and what to change.
//
// Expert windows (train.expert_window = w > 1): the step's micro-batches run w at a time, each
// window as one pass (TrainableModel::forward_backward_window_async: every MoE layer's grouped GEMM
// takes the rows of all w), the last window holding what is left. The data, the gradient scale
// and the loss (the micro-batches' loss sums added in order) are as without windows.
//
// Host waits: the micro-batches are queued with forward_backward_async (the adapters held:
// hold_parameters) and their results (loss, expert loads, aux loss) are read after the gradient
// norm, the one read of a step the host must wait for (clipping and the skip above need the norm
// on the host). The device has finished the micro-batches by then, so reading their results adds
// no wait, and the skip, the metrics and the after-step hook (checkpoints) see the step's own
// loss and norm, as before.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "core/base/error.h"
#include "core/config/config.h"
#include "core/data/batch.h"
#include "core/model/trainable_model.h"
#include "core/train/metrics.h"
#include "core/train/optimizer.h"
#include "kernels/ops.h"

namespace moetrain {

struct TrainerOptions {
  TrainConfig train;
  DataConfig data;        // grad_accum is read here; batches come from next_batch
  LoggingConfig logging;  // every: progress-line interval
  int max_nonfinite_steps = 5;
  // The data's best achievable loss (nats), logged for comparison; NaN when unknown.
  double loss_floor = std::numeric_limits<double>::quiet_NaN();
  // MFU, reported as `mfu` when both are set: the model FLOPs of one micro-batch
  // (core/plan/model_flops.h) and one device's peak rate (FLOP/s).
  std::function<double(const Batch&)> batch_flops;
  double peak_flops = 0.0;
  // data.eval (core/data/eval_data.h): an evaluation runs eval_micro_batches forward-only
  // micro-batches, eval_batch(0) .. eval_batch(n - 1) (the same count on every rank), after every
  // train.eval_every-th step and after the last step. 0: no evaluation.
  int64_t eval_micro_batches = 0;
  std::function<Batch(int64_t)> eval_batch;
};

// One evaluation over the whole eval set (every rank's share summed).
struct EvalRecord {
  double loss = std::numeric_limits<double>::quiet_NaN();  // mean cross-entropy over its targets
  int64_t targets = 0;
  double seconds = 0.0;
};

// One optimizer step's outcome.
struct StepRecord {
  int64_t step = 0;           // 0-based index of this optimizer step
  double loss = 0.0;          // mean over the step's targets (NaN/Inf when it went wrong)
  double grad_norm = 0.0;     // before clipping
  double lr = 0.0;
  int64_t targets = 0;
  int64_t tokens = 0;         // tokens in this step
  double model_flops = 0.0;   // of this step on every rank together (0: not counted)
  double max_expert_load = 0.0;
  // Per MoE layer: the max over the step's micro-batches of their max load, and the min of
  // their min (loads per micro-batch, as the expert GEMMs see them, not of the step's sums).
  // Empty in Trainer::history().
  std::vector<double> expert_load_max, expert_load_min;
  // Per MoE layer: rows per expert per grouped GEMM call over the step (ExpertRowHistogram;
  // this rank's routing). Empty in Trainer::history().
  std::vector<ExpertRowHistogram> expert_rows;
  double aux_loss = 0.0;      // mean over micro-batches
  double seconds = 0.0;       // the step's own time (an evaluation after it not included)
  bool skipped = false;       // update skipped (non-finite loss or grad norm, or no targets)
  // The evaluation after this step (data.eval) when one ran, else NaN.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
};

class Trainer {
 public:
  using BatchSource = std::function<Batch()>;
  using StepHook = std::function<void(const StepRecord&)>;

  // `metrics` may be null (no metrics.jsonl; the progress line is still logged).
  Trainer(const TrainerOptions& options, TrainableModel& model, BatchSource next_batch,
          MetricsWriter* metrics = nullptr);

  // Called after every optimizer step, skipped or not (checkpoints go here: the optimizer's
  // state and next_step() are final for that step when it runs).
  void set_after_step(StepHook hook) { after_step_ = std::move(hook); }

  // Runs steps next_step() .. train.steps - 1; returns their losses in order.
  std::vector<double> run();

  // One optimizer step; throws Error(kInternal) after max_nonfinite_steps bad steps in a row.
  // The evaluation due after it (eval_micro_batches) runs before the metrics and the hook.
  StepRecord train_step();

  // One evaluation now: forward only, over every micro-batch of the eval set, the loss sum and
  // the target count summed over data-parallel ranks. Training state is left as it was.
  EvalRecord evaluate();
  const std::optional<EvalRecord>& last_eval() const { return last_eval_; }

  // This process's share of the run (a resumed run counts from its resume): optimizer steps,
  // their tokens (all ranks), and the wall time since its first step began (evaluations and
  // checkpoints included).
  int64_t steps_this_run() const { return steps_this_run_; }
  int64_t tokens_this_run() const { return tokens_this_run_; }
  double seconds_this_run() const;

  int64_t next_step() const { return next_step_; }
  int64_t tokens_seen() const { return tokens_seen_; }
  // Resume: the step to run next and the tokens already counted (the optimizer's state and
  // step count are restored through optimizer()).
  void set_progress(int64_t next_step, int64_t tokens_seen) {
    next_step_ = next_step;
    tokens_seen_ = tokens_seen;
  }
  AdamW& optimizer() { return *optimizer_; }
  TrainableModel& model() { return model_; }
  const std::vector<StepRecord>& history() const { return history_; }
  // Steps in a row, up to the last, whose update was skipped for a non-finite loss or gradient
  // norm: 0 while the run is healthy. Checkpoints are not written while it is not.
  int nonfinite_in_a_row() const { return nonfinite_in_a_row_; }

 private:
  // The parts of train_step, in order.
  std::vector<Batch> read_micro_batches(StepRecord& record);
  std::vector<PendingStep> queue_micro_batches(const std::vector<Batch>& batches, double grad_scale, int64_t step);
  void read_results(std::vector<PendingStep>& results, StepRecord& record, size_t micro_batches);
  void update_or_skip(StepRecord& record, size_t micro_batches);
  void finish_step(StepRecord& record);
  void report(const StepRecord& record);

  TrainerOptions options_;
  TrainableModel& model_;
  BatchSource next_batch_;
  MetricsWriter* metrics_;
  std::unique_ptr<AdamW> optimizer_;
  StepHook after_step_;
  int64_t next_step_ = 0;
  int64_t tokens_seen_ = 0;
  int nonfinite_in_a_row_ = 0;
  // Per MoE layer, per expert: the rows this rank routed over the current step (read_results),
  // which the aux-loss-free bias update after the optimizer step reads.
  std::vector<std::vector<int64_t>> step_expert_rows_;
  double data_ranks_ = 0.0;  // counted at the first step that needs it (MFU)
  std::vector<StepRecord> history_;
  std::optional<EvalRecord> last_eval_;
  // Progress of this process's run: the ETA is the mean wall time per step after the first (which
  // carries the warm-up: allocations, first gathers) times the steps left.
  std::chrono::steady_clock::time_point run_start_, first_step_end_;
  int64_t steps_this_run_ = 0;
  int64_t tokens_this_run_ = 0;
};

}  // namespace moetrain
