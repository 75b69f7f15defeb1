#include "core/train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/base/error.h"
#include "core/base/log.h"

namespace moetrain {
namespace {

std::string format_rate(double tokens_per_s) {
  if (tokens_per_s >= 1e6) return fmt::format("{:.2f}M tok/s", tokens_per_s / 1e6);
  if (tokens_per_s >= 1e3) return fmt::format("{:.1f}k tok/s", tokens_per_s / 1e3);
  return fmt::format("{:.0f} tok/s", tokens_per_s);
}

}  // namespace

ExpertRowHistogram expert_row_histogram(const std::vector<int64_t>& rows, int64_t calls) {
  MOETRAIN_ASSERT(calls > 0 && !rows.empty(), "an expert row histogram needs experts and calls");
  std::vector<int64_t> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double per_call = static_cast<double>(calls);
  ExpertRowHistogram h;
  h.min = static_cast<double>(sorted.front()) / per_call;
  h.max = static_cast<double>(sorted.back()) / per_call;
  h.median = static_cast<double>(sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0 / per_call;
  h.mean = static_cast<double>(std::accumulate(sorted.begin(), sorted.end(), int64_t{0})) / static_cast<double>(n) /
           per_call;
  return h;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t whole = static_cast<int64_t>(std::llround(seconds));
  if (whole < 60) return fmt::format("{}s", whole);
  if (whole < 3600) return fmt::format("{}m{:02d}s", whole / 60, whole % 60);
  return fmt::format("{}h{:02d}m", whole / 3600, whole / 60 % 60);
}

std::string format_progress_line(const StepMetrics& m) {
  std::string line = fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | grad {:.3f} | {} | max load {:.2f}",
                                 m.step, m.total_steps, m.loss, m.lr, m.grad_norm,
                                 format_rate(m.tokens_per_s), m.max_expert_load);
  for (const auto& [key, value] : m.extra) {
    // mfu is a fraction in metrics.jsonl, a percentage on the console.
    if (key == "mfu") line += fmt::format(" | mfu {:.1f}%", 100.0 * value);
    else if (key == "eval_loss") line += fmt::format(" | eval loss {:.4f}", value);
    else if (key == "eval_ppl") line += fmt::format(" | eval ppl {:.4g}", value);
    else line += fmt::format(" | {} {:.4g}", key, value);
  }
  if (std::isfinite(m.elapsed_s)) line += " | " + format_duration(m.elapsed_s) + " elapsed";
  if (std::isfinite(m.eta_s)) line += " | eta " + format_duration(m.eta_s);
  return line;
}

MetricsWriter::MetricsWriter(const std::string& run_dir)
    : path_((std::filesystem::path(run_dir) / "metrics.jsonl").string()) {
  std::error_code error;
  std::filesystem::create_directories(run_dir, error);
  MOETRAIN_CHECK(!error, ExitCode::kBadConfig,
                 "logging.run_dir: cannot create directory '" + run_dir + "': " + error.message());
  file_.open(path_, std::ios::out | std::ios::app);
  MOETRAIN_CHECK(file_.is_open(), ExitCode::kBadConfig,
                 "logging.run_dir: cannot open '" + path_ + "' for appending; check permissions");
}

void MetricsWriter::write(const StepMetrics& m, bool log_progress) {
  // nlohmann::json writes NaN/Inf as null, which keeps every line valid JSON.
  nlohmann::ordered_json line = {
      {"step", m.step},
      {"loss", m.loss},
      {"lr", m.lr},
      {"grad_norm", m.grad_norm},
      {"tokens", m.tokens},
      {"tokens_per_s", m.tokens_per_s},
      {"max_expert_load", m.max_expert_load},
  };
  for (const auto& [key, value] : m.extra) line[key] = value;
  if (std::isfinite(m.loss_floor)) line["loss_floor"] = m.loss_floor;
  // The per-layer arrays last: the scalars stay readable at the start of a long line.
  if (!m.expert_load_max.empty()) {
    line["expert_load_max"] = m.expert_load_max;
    line["expert_load_min"] = m.expert_load_min;
  }
  if (!m.expert_rows.empty()) {
    std::vector<double> min, median, max, ratio;
    for (const ExpertRowHistogram& h : m.expert_rows) {
      min.push_back(h.min);
      median.push_back(h.median);
      max.push_back(h.max);
      ratio.push_back(h.max_over_mean());
    }
    line["expert_rows_min"] = min;
    line["expert_rows_median"] = median;
    line["expert_rows_max"] = max;
    line["expert_rows_max_over_mean"] = ratio;
  }
  file_ << line.dump() << '\n';
  file_.flush();
  MOETRAIN_CHECK(file_.good(), ExitCode::kInternal, "writing " + path_ + " failed (disk full?)");
  if (log_progress) log::info(format_progress_line(m));
}

}  // namespace moetrain
