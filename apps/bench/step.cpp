// `step`: forward + backward of a model config on one GPU (tokens/s, MFU, memory, host waits, the
// experts' balance); --op-times: one more step timed op by op. With train.expert_window (or
// --expert-window) w a step is one pass over w micro-batches.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "core/base/log.h"
#include "core/config/config.h"
#include "core/data/synthetic_data.h"
#include "core/model/model.h"
#include "core/plan/memory_plan.h"
#include "core/plan/model_flops.h"
#include "core/train/metrics.h"
#include "kernels/timing_backend.h"

namespace moetrain::bench {

namespace {

// One timed step: `window` micro-batches (train.expert_window) as one pass, the adapters held as
// the trainer holds them over an optimizer step's micro-batches.
struct StepBatches {
  std::vector<Batch> batches;
  int64_t targets = 0;
};

StepBatches next_batches(SyntheticData& data, int64_t window) {
  StepBatches step;
  for (int64_t i = 0; i < window; ++i) {
    step.batches.push_back(data.next());
    step.targets += step.batches.back().num_targets();
  }
  return step;
}

PendingStep queue_pass(Model& model, const StepBatches& step) {
  const double grad_scale = 1.0 / static_cast<double>(std::max<int64_t>(1, step.targets));
  if (step.batches.size() == 1) return model.forward_backward_async(step.batches.front(), grad_scale);
  std::vector<const Batch*> parts;
  for (const Batch& batch : step.batches) parts.push_back(&batch);
  return model.forward_backward_window_async(parts, grad_scale);
}

// Each MoE layer's rows per expert per grouped GEMM call of the step (what the experts' weights
// are streamed for), as the trainer writes them into metrics.jsonl.
void print_balance(const StepResult& result) {
  if (result.expert_rows.empty() || result.expert_gemm_calls <= 0) return;
  std::printf("balance: rows per expert per grouped GEMM call (%lld call(s) per MoE layer), min / median / max, "
              "max/mean:\n",
              static_cast<long long>(result.expert_gemm_calls));
  for (size_t layer = 0; layer < result.expert_rows.size(); ++layer) {
    const ExpertRowHistogram h = expert_row_histogram(result.expert_rows[layer], result.expert_gemm_calls);
    std::printf("  MoE layer %zu: %.0f / %.1f / %.0f rows (mean %.1f), max/mean %.2f\n", layer, h.min, h.median,
                h.max, h.mean, h.max_over_mean());
  }
}

// Where one step's time goes, op by op: one extra step after the timed ones, each op (and each
// allocation between ops) timed with a synchronize after it, so the timed steps stay unprofiled.
void print_op_times(kernels::TimingBackend& timing, Model& model, SyntheticData& data, int64_t window,
                    double median_seconds) {
  const StepBatches step = next_batches(data, window);
  timing.reset();
  timing.enable();
  auto start = std::chrono::steady_clock::now();
  model.hold_parameters(true);
  PendingStep pending = queue_pass(model, step);
  model.hold_parameters(false);
  timing.synchronize();
  pending.get();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  timing.disable();
  std::printf("\nop times of one more step (a synchronize after every op: %.1f ms in all, against the median "
              "%.1f ms unsynchronized):\n%s",
              seconds * 1e3, median_seconds * 1e3, kernels::format_op_times(timing.times(), 1, seconds).c_str());
}

}  // namespace

int bench_step(Runtime& runtime, const StepBenchOptions& bench) {
  const int steps = bench.steps;
  Config config = load_config(bench.config_path, bench.overrides);
  if (bench.expert_window > 0) {  // --expert-window: the window, with a step holding as many micro-batches
    config.train.expert_window = bench.expert_window;
    config.data.grad_accum = std::max(config.data.grad_accum, bench.expert_window);
  }
  validate_for_world(config, 1);
  ModelSpec spec = resolve_model_spec(config);
  auto cuda_backend = kernels::make_cuda_backend();
  // Declared before the model, which allocates through it: it must outlive the model's tensors.
  kernels::TimingBackend timing(*cuda_backend);
  timing.disable();
  Backend* backend = bench.op_times ? static_cast<Backend*>(&timing) : cuda_backend.get();
  ModelOptions options = model_options_for(config);
  options.dtype = DType::kBF16;
  // The feed-forward token chunk as the trainer chooses it for this GPU and window (run_training.cpp).
  PlanOptions plan_options;
  plan_options.gpu_bytes = static_cast<double>(cuda_backend->stats().device_total_bytes);
  const MemoryPlan plan = make_memory_plan(config, plan_options);
  options.ffn_chunk_tokens = plan.ffn_chunk_tokens;
  options.mixer_segment_tokens = plan.mixer_segment_tokens;
  const int64_t window = plan.expert_window;  // train.expert_window 0: the plan's choice
  if (plan.expert_window_auto) log::info(fmt::format("expert windows of {} (the plan's choice)", window));
  log::info(options.ffn_chunk_tokens > 0
                ? fmt::format("feed-forwards in token chunks of {}", options.ffn_chunk_tokens)
                : std::string("feed-forwards over the whole micro-batch"));
  if (options.mixer_segment_tokens > 0) log::info(fmt::format("KDA in time segments of {}", options.mixer_segment_tokens));
  auto build_start = std::chrono::steady_clock::now();
  Model model(spec, *backend, options);
  model.init_random_weights();
  backend->synchronize();
  log::info(fmt::format("model built and initialised in {:.1f} s", std::chrono::duration<double>(
                                                                       std::chrono::steady_clock::now() - build_start)
                                                                       .count()));
  SyntheticData data(config.data, spec.config.vocab_size, 0, 1);
  StepBatches last_step;
  StepResult last_result;
  std::vector<double> times;
  double loss = 0;
  kernels::BackendStats before;  // at the first timed step: what the timed steps cost is the difference
  int64_t bench_waits = 0;       // the timing's own synchronize, one per timed step
  for (int s = 0; s < steps + 2; ++s) {
    StepBatches step = next_batches(data, window);
    if (s == 2) before = backend->stats();
    auto start = std::chrono::steady_clock::now();
    // As the trainer runs a micro-batch (or an expert window): the adapters held (packed once per
    // optimizer step; here every step is one), the result read after the work is queued.
    model.hold_parameters(true);
    PendingStep pending = queue_pass(model, step);
    model.hold_parameters(false);
    backend->synchronize();
    if (s >= 2) {
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      ++bench_waits;
    }
    last_result = pending.get();  // done by now: no wait
    loss = last_result.loss_sum / std::max<int64_t>(1, last_result.targets);
    last_step = std::move(step);
  }
  std::sort(times.begin(), times.end());
  const double seconds = times[times.size() / 2];
  const int64_t tokens = window * config.data.micro_batch * config.data.seq_len;
  // Model FLOPs as docs/PERF.md defines them (core/plan/model_flops.h), as the trainer's `mfu`.
  double flops = 0;
  for (const Batch& batch : last_step.batches) {
    flops += ModelFlops(spec, config.lora).step(batch.num_tokens(), batch.cu_seqlens).total();
  }
  const int64_t rerun = config.parallel.recompute_layers;
  const std::string recompute = !config.parallel.recompute ? "off"
                                : rerun < 0 || rerun >= spec.config.num_layers
                                    ? "on"
                                    : fmt::format("on, first {} of {} layers", rerun, spec.config.num_layers);
  const std::string windows =
      window > 1 ? fmt::format(", an expert window of {} micro-batches in one pass", window) : std::string();
  std::printf("\nstep: %lld layers, hidden %lld, %lld experts top-%lld, %lld tokens (seq %lld)%s, recompute %s\n",
              static_cast<long long>(spec.config.num_layers), static_cast<long long>(spec.config.hidden_size),
              static_cast<long long>(spec.config.moe.num_experts), static_cast<long long>(spec.config.moe.top_k),
              static_cast<long long>(tokens), static_cast<long long>(config.data.seq_len), windows.c_str(),
              recompute.c_str());
  std::printf("step: median %.1f ms, %.0f tokens/s, %.1f model TFLOP/s, MFU %.1f%% of %.0f (%.1f%% of the measured "
              "771), last loss %.4f\n",
              seconds * 1e3, tokens / seconds, flops / seconds / 1e12, 100.0 * flops / seconds / 1e12 / kDatasheetBf16Tflops,
              kDatasheetBf16Tflops, 100.0 * flops / seconds / 1e12 / kMatrixCeilingTflops, loss);
  if (window > 1) {
    std::printf("step: %.1f ms per micro-batch of %lld tokens\n", seconds * 1e3 / static_cast<double>(window),
                static_cast<long long>(config.data.micro_batch * config.data.seq_len));
  }
  print_balance(last_result);
  const kernels::BackendStats after = backend->stats();
  const char* allocator = std::getenv("MOETRAIN_CUDA_ALLOCATOR");
  // Host waits inside the step: every wait of the timed steps but the timing's own synchronize
  // after each (counted apart); the step's result is read after that, when it is done. Any wait
  // left stops the host from running ahead of the device.
  // The bench builds no optimizer: a training run on one rank also holds AdamW's two moments per
  // adapter parameter (core/train/optimizer.h), which `moetrain plan` counts.
  int64_t adapter_parameters = 0;
  for (const Parameter* p : model.parameters()) adapter_parameters += p->value.numel();
  std::printf("memory: peak %.2f GB in tensors (training adds %.2f GB of Adam moments); per timed step: %.1f "
              "cudaMalloc calls, %.1f host waits inside the step (+ 1 the timing's synchronize) "
              "(MOETRAIN_CUDA_ALLOCATOR=%s)\n",
              static_cast<double>(after.peak_bytes) / 1e9, 2.0 * 4 * static_cast<double>(adapter_parameters) / 1e9,
              static_cast<double>(after.device_allocations - before.device_allocations) / static_cast<double>(steps),
              static_cast<double>(after.host_waits - before.host_waits - bench_waits) / static_cast<double>(steps),
              allocator ? allocator : "caching");
  if (bench.op_times) print_op_times(timing, model, data, window, seconds);
  (void)runtime;
  return 0;
}

}  // namespace moetrain::bench
