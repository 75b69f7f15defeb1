// The subcommands of moetrain-bench (main.cpp parses the command line and calls one of them):
//   ops    op timings against the H200 ceilings and peer baselines (ops_*.cpp, one group a call)
//   step   forward + backward of a model config (step.cpp)
//   ep     expert-parallel dispatch + combine against NCCL's all-to-all (ep.cpp)
#pragma once

#include <string>
#include <vector>

#include "apps/bench/common.h"
#include "parallel/runtime.h"

namespace moetrain::bench {

struct OpsBenchOptions {
  int reps = 10;            // timed repetitions per op
  double heat_up_ms = 500;  // each op run this long untimed first
  std::string only;         // comma-separated groups; empty: all
};

struct StepBenchOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // --set key.path=value
  int steps = 5;                       // timed, after 2 warm-up steps
  bool op_times = false;               // then one more step, timed op by op
  int64_t expert_window = 0;           // > 0: train.expert_window (data.grad_accum raised to it)
};

int bench_ops(const OpsBenchOptions& options);
int bench_step(Runtime& runtime, const StepBenchOptions& bench);
int bench_ep(Runtime& runtime, int mib, int reps);

// The groups of `ops`, each appending its rows.
void bench_gemm(Backend& be, int reps, std::vector<Row>& rows);
void bench_experts(Backend& be, int reps, std::vector<Row>& rows);
void bench_grouped_gemm(Backend& be, int reps, std::vector<Row>& rows);
void bench_attention(Backend& be, int reps, std::vector<Row>& rows);
void bench_kda(Backend& be, int reps, std::vector<Row>& rows);
void bench_dsa(Backend& be, int reps, std::vector<Row>& rows);
void bench_memory(Backend& be, int reps, std::vector<Row>& rows);
void bench_fp8(Backend& be, int reps, std::vector<Row>& rows);

}  // namespace moetrain::bench
