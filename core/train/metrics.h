// Per-step training metrics: one JSON object per line in <run_dir>/metrics.jsonl (appended, so
// a resumed run continues the same file) and a readable progress line in the log. The keys are
// described in docs/METRICS.md; scripts/plot_metrics.py draws them.
#pragma once

#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace moetrain {

// One MoE layer's balance as its grouped GEMMs see it: the rows per expert of one call (the
// mean over the step's calls: one per pass, i.e. per micro-batch or per expert window, and per
// feed-forward token chunk), min / median / max over experts, and max over mean (1 = balanced).
struct ExpertRowHistogram {
  double min = 0.0, median = 0.0, max = 0.0, mean = 0.0;
  double max_over_mean() const { return mean > 0.0 ? max / mean : 0.0; }
};

// From the rows each expert got over `calls` grouped GEMM calls (calls > 0).
ExpertRowHistogram expert_row_histogram(const std::vector<int64_t>& rows, int64_t calls);

struct StepMetrics {
  int64_t step = 0;            // optimizer steps completed (1 after the first)
  int64_t total_steps = 0;     // for the progress line
  double loss = 0.0;           // mean cross-entropy over the step's target tokens
  double lr = 0.0;
  double grad_norm = 0.0;      // before clipping
  int64_t tokens = 0;          // cumulative tokens processed
  double tokens_per_s = 0.0;
  double max_expert_load = 0.0;  // max over layers and experts of load / mean load (1 = balanced)
  // Per MoE layer (written as arrays when the model has MoE layers): max and min over experts of
  // load / mean load, the extremes over the step's micro-batches (docs/METRICS.md).
  std::vector<double> expert_load_max, expert_load_min;
  // Per MoE layer: rows per expert per grouped GEMM call (written as expert_rows_min, _median,
  // _max and _max_over_mean arrays).
  std::vector<ExpertRowHistogram> expert_rows;
  // The data's best achievable loss (synthetic data), written when finite, for plots.
  double loss_floor = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, double>> extra;  // further keys, written in this order
                                                      // (e.g. aux_loss, mfu as a fraction, skipped,
                                                      // eval_loss and eval_ppl)
  // Console only (NaN: not shown): seconds since this process's run started, and the estimated
  // seconds left (NaN until a step after the first has timed the steady state).
  double elapsed_s = std::numeric_limits<double>::quiet_NaN();
  double eta_s = std::numeric_limits<double>::quiet_NaN();
};

// "12s", "4m05s", "2h07m": a duration for the console.
std::string format_duration(double seconds);

// "step 12/150 | loss 4.1234 | lr 1.20e-03 | grad 0.532 | 12.3k tok/s | max load 1.42"
// then the extra keys ("| eval loss 3.2100 | eval ppl 24.8", "| mfu 42.4%"), then
// "| 1m05s elapsed | eta 14m20s" when known.
std::string format_progress_line(const StepMetrics& metrics);

class MetricsWriter {
 public:
  // Creates run_dir (and parents) and opens metrics.jsonl for appending. Throws
  // Error(kBadConfig) naming the path when that fails (logging.run_dir is a user setting).
  explicit MetricsWriter(const std::string& run_dir);

  // Appends the JSON line (flushed at once, so a killed run keeps every finished step) and,
  // when `log_progress`, logs the progress line at info.
  void write(const StepMetrics& metrics, bool log_progress = true);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream file_;
};

}  // namespace moetrain
