// `ops`: the chosen groups' rows, then the table.
#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "core/base/error.h"

namespace moetrain::bench {

int bench_ops(const OpsBenchOptions& options) {
  auto backend = kernels::make_cuda_backend();
  const int reps = options.reps;
  heat_up_ms = options.heat_up_ms;
  MOETRAIN_CHECK(heat_up_ms >= 0, ExitCode::kBadConfig, "moetrain-bench: --heat-up-ms must be 0 or more");
  std::vector<Row> rows;
  const std::string& only = options.only;
  auto wanted = [&only](const char* group) { return only.empty() || only.find(group) != std::string::npos; };
  if (wanted("gemm")) bench_gemm(*backend, reps, rows);
  if (wanted("experts")) bench_experts(*backend, reps, rows);
  if (wanted("grouped")) bench_grouped_gemm(*backend, reps, rows);
  if (wanted("attention")) bench_attention(*backend, reps, rows);
  if (wanted("kda")) bench_kda(*backend, reps, rows);
  if (wanted("dsa")) bench_dsa(*backend, reps, rows);
  if (wanted("memory")) bench_memory(*backend, reps, rows);
  if (wanted("fp8")) bench_fp8(*backend, reps, rows);
  print_rows(rows);
  return 0;
}

}  // namespace moetrain::bench
