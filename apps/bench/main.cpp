// moetrain-bench: times the CUDA backend's ops and whole training steps on one GPU and states
// each result against the H200 ceilings and peer baselines of docs/PERF.md:
//   ops      GEMM, the MoE expert block (grouped GEMM), attention, KDA, DSA, memory-bound kernels,
//            the GEMMs on FP8 weights against BF16 at DeepSeek-V3's shapes
//   step     forward + backward of a model config (tokens/s, MFU); --op-times: per-op breakdown
//   ep       expert-parallel dispatch + combine across GPUs against NCCL's all-to-all (mpirun)
// Each op timing is the median of `--reps` runs after warm-up, each run timed by CUDA events on
// the backend's stream (as the PyTorch baselines are); steps are timed on the host.
// Inputs are random (never zeros: zeros make matrix units run faster than real data).
//
//   moetrain-bench ops [--reps N] [--only gemm,experts,grouped,attention,kda,dsa,memory,fp8]
//   moetrain-bench step --config FILE [--set k=v]... [--steps N] [--op-times] [--expert-window N]
//   mpirun -np 2 moetrain-bench ep [--mib 256] [--reps N]
//
// This file parses the command line and calls the subcommand (apps/bench/bench.h).
#include <cstdio>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "apps/bench/bench.h"
#include "core/base/error.h"
#include "kernels/cuda/common/device.h"
#include "parallel/runtime.h"

namespace moetrain::bench {
namespace {

int run(Runtime& runtime, int argc, char** argv) {
  cxxopts::Options options("moetrain-bench", "time the CUDA backend against the H200 ceilings");
  options.add_options()("mode", "ops | step | ep", cxxopts::value<std::string>()->default_value("ops"))(
      "mib", "MiB per rank and direction for `ep`", cxxopts::value<int>()->default_value("256"))(
      "config", "model config for `step`", cxxopts::value<std::string>())(
      "set", "config override key.path=value", cxxopts::value<std::vector<std::string>>())(
      "steps", "timed steps", cxxopts::value<int>()->default_value("5"))(
      "reps", "timed repetitions per op", cxxopts::value<int>()->default_value("10"))(
      "heat-up-ms", "`ops`: run each op this long before timing it (the GPU settles at its power-capped clock)",
      cxxopts::value<double>()->default_value("500"))(
      "only", "`ops`: these groups only (comma-separated: gemm, experts, grouped, attention, kda, dsa, memory, fp8)",
      cxxopts::value<std::string>()->default_value(""))(
      "op-times", "`step`: after the timed steps, time one more step op by op")(
      "expert-window", "`step`: run this many micro-batches as one pass (train.expert_window)",
      cxxopts::value<int64_t>()->default_value("0"))("h,help", "print this usage");
  options.parse_positional({"mode"});
  options.positional_help("ops | step | ep");
  cxxopts::ParseResult result;
  try {
    result = options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    if (runtime.is_root()) std::fprintf(stderr, "%s\n", options.help().c_str());
    throw Error(ExitCode::kBadConfig, std::string("command line: ") + e.what() + " (see the usage above)");
  }
  if (result.count("help")) {
    if (runtime.is_root()) std::printf("%s\n", options.help().c_str());
    return 0;
  }
  MOETRAIN_CHECK(cuda::device_count() > 0, ExitCode::kBadConfig, "moetrain-bench needs a CUDA device");
  const std::string mode = result["mode"].as<std::string>();
  if (mode == "step") {
    MOETRAIN_CHECK(result.count("config"), ExitCode::kBadConfig, "moetrain-bench step needs --config FILE");
    StepBenchOptions bench;
    bench.config_path = result["config"].as<std::string>();
    if (result.count("set")) bench.overrides = result["set"].as<std::vector<std::string>>();
    bench.steps = result["steps"].as<int>();
    MOETRAIN_CHECK(bench.steps >= 1, ExitCode::kBadConfig, "moetrain-bench step needs --steps 1 or more");
    bench.op_times = result.count("op-times") > 0;
    bench.expert_window = result["expert-window"].as<int64_t>();
    MOETRAIN_CHECK(bench.expert_window >= 0, ExitCode::kBadConfig, "moetrain-bench step needs --expert-window 1 or more");
    return bench_step(runtime, bench);
  }
  if (mode == "ep") return bench_ep(runtime, result["mib"].as<int>(), result["reps"].as<int>());
  MOETRAIN_CHECK(mode == "ops", ExitCode::kBadConfig, "unknown mode " + mode + " (ops | step | ep)");
  OpsBenchOptions ops;
  ops.reps = result["reps"].as<int>();
  ops.heat_up_ms = result["heat-up-ms"].as<double>();
  ops.only = result["only"].as<std::string>();
  return bench_ops(ops);
}

}  // namespace
}  // namespace moetrain::bench

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::bench::run); }
