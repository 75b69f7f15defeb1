#include "core/train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/train/schedule.h"
#include "parallel/watchdog.h"

namespace moetrain {
namespace {

// Folds one micro-batch's per-layer loads into the step's: max of the maxima, min of the minima.
void merge_expert_loads(StepRecord& record, const StepResult& result) {
  MOETRAIN_ASSERT(result.expert_load_max.size() == result.expert_load_min.size(),
                  "expert_load_max and expert_load_min differ in length");
  if (record.expert_load_max.empty()) {
    record.expert_load_max = result.expert_load_max;
    record.expert_load_min = result.expert_load_min;
    return;
  }
  MOETRAIN_ASSERT(result.expert_load_max.size() == record.expert_load_max.size(),
                  "micro-batches report expert loads for different numbers of MoE layers");
  for (size_t i = 0; i < result.expert_load_max.size(); ++i) {
    record.expert_load_max[i] = std::max(record.expert_load_max[i], result.expert_load_max[i]);
    record.expert_load_min[i] = std::min(record.expert_load_min[i], result.expert_load_min[i]);
  }
}

// TrainableModel::hold_parameters over a scope (released on the way out of an exception too).
class ParameterHold {
 public:
  explicit ParameterHold(TrainableModel& model) : model_(model) { model_.hold_parameters(true); }
  ~ParameterHold() { model_.hold_parameters(false); }
  ParameterHold(const ParameterHold&) = delete;
  ParameterHold& operator=(const ParameterHold&) = delete;

 private:
  TrainableModel& model_;
};

}  // namespace

Trainer::Trainer(const TrainerOptions& options, TrainableModel& model, BatchSource next_batch,
                 MetricsWriter* metrics)
    : options_(options), model_(model), next_batch_(std::move(next_batch)), metrics_(metrics) {
  MOETRAIN_CHECK(options_.data.grad_accum >= 1, ExitCode::kBadConfig,
                 "data.grad_accum = " + std::to_string(options_.data.grad_accum) + ": must be at least 1");
  MOETRAIN_ASSERT(next_batch_ != nullptr, "no batch source");
  AdamWOptions adamw;
  adamw.beta1 = options_.train.beta1;
  adamw.beta2 = options_.train.beta2;
  adamw.eps = options_.train.eps;
  adamw.weight_decay = options_.train.weight_decay;
  std::vector<ParameterGroup*> groups = model_.parameter_groups();
  optimizer_ = groups.empty() ? std::make_unique<AdamW>(model_.parameters(), adamw, model_.backend())
                              : std::make_unique<AdamW>(groups, adamw, model_.backend());
}

std::vector<double> Trainer::run() {
  if (next_step_ < options_.train.steps) {
    std::string floor;
    if (std::isfinite(options_.loss_floor)) floor = fmt::format(" (the data's loss floor is {:.4f})", options_.loss_floor);
    const int64_t window = std::min(std::max<int64_t>(1, options_.train.expert_window), options_.data.grad_accum);
    const std::string windows =
        window > 1 ? fmt::format(", run {} at a time (train.expert_window)", window) : std::string();
    log::info(fmt::format("training steps {}..{}: {} micro-batch(es) of {} x {} tokens per step{}{}", next_step_ + 1,
                          options_.train.steps, options_.data.grad_accum, options_.data.micro_batch,
                          options_.data.seq_len, windows, floor));
  }
  std::vector<double> losses;
  while (next_step_ < options_.train.steps) losses.push_back(train_step().loss);
  return losses;
}

StepRecord Trainer::train_step() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  if (steps_this_run_ == 0) run_start_ = start;
  StepRecord record;
  record.step = next_step_;
  record.lr = learning_rate(options_.train, next_step_);
  const std::vector<Batch> batches = read_micro_batches(record);
  const double grad_scale = record.targets > 0 ? 1.0 / static_cast<double>(record.targets) : 0.0;
  std::vector<PendingStep> results = queue_micro_batches(batches, grad_scale, record.step);
  watchdog_progress(fmt::format("step {}: gradient reduction", record.step + 1));
  optimizer_->reduce_gradients();
  record.grad_norm = optimizer_->clip_gradients(options_.train.grad_clip);
  read_results(results, record, batches.size());
  update_or_skip(record, batches.size());
  record.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  finish_step(record);
  return record;
}

// All micro-batches first: the gradient scale needs the whole step's target count.
std::vector<Batch> Trainer::read_micro_batches(StepRecord& record) {
  std::vector<Batch> batches;
  batches.reserve(static_cast<size_t>(options_.data.grad_accum));
  for (int64_t i = 0; i < options_.data.grad_accum; ++i) {
    watchdog_progress(fmt::format("step {}: reading micro-batch {}", record.step + 1, i + 1));
    batches.push_back(next_batch_());
    record.targets += batches.back().num_targets();
    record.tokens += batches.back().num_tokens();
  }
  // Every target token of the step weighs the same on every data-parallel rank.
  record.targets = static_cast<int64_t>(model_.sum_over_data_ranks(static_cast<double>(record.targets)));
  record.tokens = static_cast<int64_t>(model_.sum_over_data_ranks(static_cast<double>(record.tokens)));
  if (options_.batch_flops) {  // MFU: the step's model FLOPs on every rank together
    for (const Batch& batch : batches) record.model_flops += options_.batch_flops(batch);
    record.model_flops = model_.sum_over_data_ranks(record.model_flops);
    if (data_ranks_ == 0.0) data_ranks_ = model_.sum_over_data_ranks(1.0);
  }
  return batches;
}

// The micro-batches are queued without waiting for their results (loss, expert loads): the
// device runs them back to back while the host queues the next. With train.expert_window they
// go window by window.
std::vector<PendingStep> Trainer::queue_micro_batches(const std::vector<Batch>& batches, double grad_scale,
                                                      int64_t step) {
  std::vector<PendingStep> results;
  ParameterHold hold(model_);  // the parameters change only in the optimizer step, after this
  const size_t window = static_cast<size_t>(std::max<int64_t>(1, options_.train.expert_window));
  for (size_t first = 0; first < batches.size(); first += window) {
    const size_t last = std::min(batches.size(), first + window);  // one past
    const std::string which = last - first == 1 ? fmt::format("micro-batch {}", first + 1)
                                                : fmt::format("micro-batches {}-{}", first + 1, last);
    watchdog_progress(fmt::format("step {}: forward/backward of {}", step + 1, which));
    try {
      if (last - first == 1) {
        results.push_back(model_.forward_backward_async(batches[first], grad_scale));
      } else {
        std::vector<const Batch*> parts;
        for (size_t i = first; i < last; ++i) parts.push_back(&batches[i]);
        results.push_back(model_.forward_backward_window_async(parts, grad_scale));
      }
    } catch (const Error& error) {  // an out-of-memory, a bad token...: say where in the run
      throw Error(error.code(), fmt::format("step {}, {}: {}", step + 1, which, error.what()));
    }
  }
  return results;
}

// Read after the gradient norm, which has waited for the device: the results are there by then,
// so reading them adds no wait. The skip that follows needs both the loss and the norm on the host.
void Trainer::read_results(std::vector<PendingStep>& results, StepRecord& record, size_t micro_batches) {
  double loss_sum = 0.0;
  std::vector<std::vector<int64_t>>& expert_rows = step_expert_rows_;
  expert_rows.clear();
  int64_t expert_calls = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    StepResult result;
    try {
      result = results[i].get();
    } catch (const Error& error) {  // a device failure surfaces where the host waits for it
      throw Error(error.code(), fmt::format("step {}, pass {} of {}: reading its loss: {}", record.step + 1, i + 1,
                                            results.size(), error.what()));
    }
    // Micro-batch by micro-batch, in order: windows or not, the same sum.
    if (result.micro_batch_loss_sums.empty()) loss_sum += result.loss_sum;
    for (double part : result.micro_batch_loss_sums) loss_sum += part;
    record.max_expert_load = std::max(record.max_expert_load, result.max_expert_load);
    merge_expert_loads(record, result);
    record.aux_loss += result.aux_loss / static_cast<double>(micro_batches);
    if (expert_rows.empty()) expert_rows.resize(result.expert_rows.size());
    MOETRAIN_ASSERT(expert_rows.size() == result.expert_rows.size(),
                    "passes report expert rows for different numbers of MoE layers");
    for (size_t layer = 0; layer < expert_rows.size(); ++layer) {
      std::vector<int64_t>& sum = expert_rows[layer];
      const std::vector<int64_t>& rows = result.expert_rows[layer];
      if (sum.empty()) sum.assign(rows.size(), 0);
      MOETRAIN_ASSERT(sum.size() == rows.size(), "passes report expert rows for different numbers of experts");
      for (size_t e = 0; e < rows.size(); ++e) sum[e] += rows[e];
    }
    expert_calls += result.expert_gemm_calls;
  }
  for (const std::vector<int64_t>& rows : expert_rows) {
    if (expert_calls > 0 && !rows.empty()) record.expert_rows.push_back(expert_row_histogram(rows, expert_calls));
  }
  loss_sum = model_.sum_over_data_ranks(loss_sum);
  record.loss = record.targets > 0 ? loss_sum / static_cast<double>(record.targets) : 0.0;
}

// The optimizer step, or its skip: a step without target tokens or with a non-finite loss or
// gradient norm leaves the adapters as they were.
void Trainer::update_or_skip(StepRecord& record, size_t micro_batches) {
  const bool finite = std::isfinite(record.loss) && std::isfinite(record.grad_norm);
  if (record.targets == 0) {
    log::warn(fmt::format("step {}: no target tokens in {} micro-batch(es); update skipped",
                          record.step + 1, micro_batches));
    record.skipped = true;
    optimizer_->zero_grad();
  } else if (!finite) {
    record.skipped = true;
    optimizer_->zero_grad();
    ++nonfinite_in_a_row_;
    log::warn(fmt::format("step {}: loss {:.6g}, grad norm {:.6g}: not finite; update skipped ({} in a row, stop at {})",
                          record.step + 1, record.loss, record.grad_norm, nonfinite_in_a_row_,
                          options_.max_nonfinite_steps));
  } else {
    watchdog_progress(fmt::format("step {}: optimizer", record.step + 1));
    optimizer_->step(record.lr);
    model_.update_expert_bias(step_expert_rows_);
    nonfinite_in_a_row_ = 0;
  }
}

// After the update: the counters, the evaluation due, the history and metrics, the hook, and the
// stop after too many non-finite steps in a row.
void Trainer::finish_step(StepRecord& record) {
  tokens_seen_ += record.tokens;
  tokens_this_run_ += record.tokens;
  ++steps_this_run_;
  ++next_step_;
  const int64_t done = record.step + 1;
  const int64_t eval_every = options_.train.eval_every;
  if (options_.eval_micro_batches > 0 && ((eval_every > 0 && done % eval_every == 0) || done == options_.train.steps)) {
    record.eval_loss = evaluate().loss;
  }
  history_.push_back(record);
  // The per-layer loads live on in metrics.jsonl; in memory a long run's history would grow by
  // two numbers per MoE layer per step.
  history_.back().expert_load_max = {};
  history_.back().expert_load_min = {};
  history_.back().expert_rows = {};
  report(record);
  watchdog_progress(fmt::format("step {}: after the step (checkpoint, metrics)", record.step + 1));
  if (after_step_) after_step_(record);

  MOETRAIN_CHECK(nonfinite_in_a_row_ < options_.max_nonfinite_steps, ExitCode::kInternal,
                 fmt::format("training stopped at step {}: {} steps in a row had a non-finite loss or "
                             "gradient norm (last: loss {:.6g}, grad norm {:.6g}). Lower train.lr, set "
                             "train.grad_clip, or check the data, then resume from the last checkpoint",
                             record.step + 1, nonfinite_in_a_row_, record.loss, record.grad_norm));
}

EvalRecord Trainer::evaluate() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  MOETRAIN_ASSERT(options_.eval_micro_batches > 0 && options_.eval_batch != nullptr, "no eval set");
  double loss_sum = 0.0;
  int64_t targets = 0;
  {
    ParameterHold hold(model_);  // nothing changes the parameters during an evaluation
    for (int64_t i = 0; i < options_.eval_micro_batches; ++i) {
      watchdog_progress(fmt::format("evaluation after step {}: micro-batch {} of {}", next_step_, i + 1,
                                    options_.eval_micro_batches));
      const Batch batch = options_.eval_batch(i);
      const StepResult result = model_.evaluate(batch);
      loss_sum += result.loss_sum;
      targets += result.targets;
    }
  }
  EvalRecord record;
  record.targets = static_cast<int64_t>(model_.sum_over_data_ranks(static_cast<double>(targets)));
  loss_sum = model_.sum_over_data_ranks(loss_sum);
  if (record.targets > 0) {
    record.loss = loss_sum / static_cast<double>(record.targets);
  } else {
    log::warn(fmt::format("evaluation after step {}: the eval windows hold no target tokens, so there is no eval "
                          "loss; check data.eval (its loss mask)",
                          next_step_));
  }
  record.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  last_eval_ = record;
  return record;
}

double Trainer::seconds_this_run() const {
  if (steps_this_run_ == 0) return 0.0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
}

void Trainer::report(const StepRecord& record) {
  StepMetrics m;
  m.step = record.step + 1;
  m.total_steps = options_.train.steps;
  m.loss = record.loss;
  m.lr = record.lr;
  m.grad_norm = record.grad_norm;
  m.tokens = tokens_seen_;
  m.tokens_per_s = record.seconds > 0.0 ? static_cast<double>(record.tokens) / record.seconds : 0.0;
  m.max_expert_load = record.max_expert_load;
  m.expert_load_max = record.expert_load_max;
  m.expert_load_min = record.expert_load_min;
  m.expert_rows = record.expert_rows;
  m.loss_floor = options_.loss_floor;
  if (record.aux_loss != 0.0) m.extra.emplace_back("aux_loss", record.aux_loss);
  if (record.model_flops > 0.0 && options_.peak_flops > 0.0 && record.seconds > 0.0) {
    // Per device: every data-parallel rank ran its share of the step's FLOPs in the same time.
    m.extra.emplace_back("mfu", record.model_flops / data_ranks_ / record.seconds / options_.peak_flops);
  }
  if (record.skipped) m.extra.emplace_back("skipped", 1.0);
  if (!std::isnan(record.eval_loss)) {
    m.extra.emplace_back("eval_loss", record.eval_loss);
    m.extra.emplace_back("eval_ppl", std::exp(record.eval_loss));
  }
  const auto now = std::chrono::steady_clock::now();
  if (steps_this_run_ == 1) first_step_end_ = now;
  m.elapsed_s = std::chrono::duration<double>(now - run_start_).count();
  if (steps_this_run_ >= 2) {
    const double per_step = std::chrono::duration<double>(now - first_step_end_).count() /
                            static_cast<double>(steps_this_run_ - 1);
    m.eta_s = per_step * static_cast<double>(std::max<int64_t>(options_.train.steps - m.step, 0));
  }

  const int64_t every = std::max<int64_t>(options_.logging.every, 1);
  // A step with an evaluation always shows it.
  const bool log_progress = m.step % every == 0 || m.step == options_.train.steps || m.step == 1 ||
                            !std::isnan(record.eval_loss);
  // metrics.jsonl gets every step (docs/ARCHITECTURE.md §7); logging.every thins the console only.
  if (metrics_ != nullptr) {
    metrics_->write(m, log_progress);
  } else if (log_progress) {
    log::info(format_progress_line(m));
  }
}

}  // namespace moetrain
