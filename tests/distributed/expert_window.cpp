// Expert windows (train.expert_window) under expert parallelism and FSDP: run under mpirun, every
// rank trains the tiny MLA + KDA + DSA model with router noise and the aux loss for 2 optimizer
// steps of grad_accum 3 and 4 micro-batches, once one micro-batch at a time and once in windows
// of 2 and 3 (a window's tokens cross to the experts' ranks in one exchange per direction, and
// each FSDP layer is gathered once per window). The first step's loss must be the same bit for
// bit, the second's and the first step's reduced adapter gradients the same to 1e-12 (a window
// sums a gradient over its rows in one reduction instead of one per micro-batch).
//
//   mpirun -np W distributed_expert_window FSDP EP [--recompute]
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "core/base/log.h"
#include "core/data/synthetic_data.h"
#include "core/model/model.h"
#include "core/train/optimizer.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "mpi_parallel_groups.h"
#include "parallel/mesh.h"
#include "parallel/runtime.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

constexpr int kSteps = 2;
constexpr double kTolerance = 1e-12;

Config test_config() {
  Config config = testing::tiny_model_config(/*q_lora=*/true);
  config.model.moe.num_experts = 8;
  config.model.moe.top_k = 2;
  config.model.moe.num_groups = 2;
  config.model.moe.router_noise = 0.3;
  config.model.moe.aux_loss_coef = 0.01;
  config.data.seq_len = 8;
  config.data.micro_batch = 1;
  return config;
}

struct Run {
  std::vector<double> losses;
  std::vector<Tensor> first_grads;  // host F64, after the first step's reduction, in parameters() order
};

Run train(const ModelSpec& spec, const Config& config, ParallelGroups& groups, int world, int rank, bool recompute,
          int64_t grad_accum, int64_t window) {
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = testing::all_lora_targets(true);
  options.recompute = recompute;
  options.aux_loss_weight = 1.0 / static_cast<double>(grad_accum * world);
  options.parallel = &groups;
  Model model(spec, *backend, options);
  model.init_random_weights();
  uint64_t seed = 100 + static_cast<uint64_t>(rank) * 1000;
  for (Parameter* p : model.parameters()) testing::fill_random(p->value, seed++, 0.05, 0.3);
  AdamW optimizer(model.parameter_groups(), AdamWOptions{}, *backend);
  SyntheticData data(config.data, spec.config.vocab_size, rank, world);
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<Batch> batches;
    double targets = 0;
    for (int64_t i = 0; i < grad_accum; ++i) {
      batches.push_back(data.next());
      targets += static_cast<double>(batches.back().num_targets());
    }
    targets = model.sum_over_data_ranks(targets);
    std::vector<PendingStep> pending;
    model.hold_parameters(true);
    for (size_t first = 0; first < batches.size(); first += static_cast<size_t>(window)) {
      std::vector<const Batch*> parts;
      for (size_t i = first; i < std::min(batches.size(), first + static_cast<size_t>(window)); ++i) {
        parts.push_back(&batches[i]);
      }
      pending.push_back(window == 1 ? model.forward_backward_async(*parts.front(), 1.0 / targets)
                                    : model.forward_backward_window_async(parts, 1.0 / targets));
    }
    model.hold_parameters(false);
    double loss_sum = 0.0;
    for (PendingStep& p : pending) {
      for (double part : p.get().micro_batch_loss_sums) loss_sum += part;
    }
    optimizer.reduce_gradients();
    run.losses.push_back(model.sum_over_data_ranks(loss_sum) / targets);
    if (step == 0) {
      optimizer.gather_gradients();
      for (Parameter* p : model.parameters()) {
        Tensor g(p->grad.shape(), DType::kF64);
        backend->copy(g, p->grad);
        run.first_grads.push_back(std::move(g));
      }
    }
    optimizer.clip_gradients(1.0);
    optimizer.step(1e-2);
  }
  return run;
}

int compare(const Run& windowed, const Run& sequential, const std::string& label) {
  int failures = 0;
  if (windowed.losses[0] != sequential.losses[0]) {
    ++failures;
    log::error(fmt::format("{}: step 1 loss {:.17g} vs sequential {:.17g}", label, windowed.losses[0],
                           sequential.losses[0]));
  }
  for (int s = 1; s < kSteps; ++s) {
    const double err = std::fabs(windowed.losses[s] - sequential.losses[s]) / std::fabs(sequential.losses[s]);
    if (!(err <= kTolerance)) {
      ++failures;
      log::error(fmt::format("{}: step {} loss relative error {:.2e}", label, s + 1, err));
    }
  }
  for (size_t i = 0; i < sequential.first_grads.size(); ++i) {
    const Tensor& a = windowed.first_grads[i];
    const Tensor& b = sequential.first_grads[i];
    double scale = 0.0, worst = 0.0;
    for (int64_t j = 0; j < b.numel(); ++j) {
      scale = std::max(scale, std::fabs(b.ptr<double>()[j]));
      worst = std::max(worst, std::fabs(a.ptr<double>()[j] - b.ptr<double>()[j]));
    }
    if (!(worst <= kTolerance * scale) || scale == 0.0) {
      ++failures;
      log::error(fmt::format("{}: gradient {} differs: max |diff| {:.3e} vs scale {:.3e}", label, i, worst, scale));
    }
  }
  return failures;
}

int run_test(Runtime& runtime, int argc, char** argv) {
  bool recompute = false;
  if (argc == 4 && std::string(argv[3]) == "--recompute") {
    recompute = true;
    --argc;
  }
  MOETRAIN_CHECK(argc == 3, ExitCode::kBadConfig, "usage: distributed_expert_window FSDP EP [--recompute]");
  MeshShape shape;
  shape.fsdp = std::stoi(argv[1]);
  shape.ep = std::stoi(argv[2]);
  const Config config = test_config();
  const ModelSpec spec = resolve_model_spec(config);
  const int world = runtime.world(), rank = runtime.rank();
  testing::MpiParallelGroups mpi{MeshLayout(world, shape, spec.config.moe.num_experts)};
  int failures = 0, cases = 0;
  for (int64_t grad_accum : {3, 4}) {
    const Run sequential = train(spec, config, mpi.groups, world, rank, recompute, grad_accum, 1);
    for (int64_t window : {2, 3}) {
      const Run windowed = train(spec, config, mpi.groups, world, rank, recompute, grad_accum, window);
      failures += compare(windowed, sequential, fmt::format("grad_accum {}, window {}", grad_accum, window));
      ++cases;
    }
  }
  double total_failures = static_cast<double>(failures);  // every rank's verdict
  mpi.data.all_reduce(&total_failures, 1);
  const int total = static_cast<int>(total_failures);
  if (runtime.is_root()) {
    std::printf("distributed_expert_window world %d fsdp %lld ep %lld%s: %d window cases: %s\n", world,
                static_cast<long long>(shape.fsdp), static_cast<long long>(shape.ep), recompute ? " recompute" : "",
                cases, total == 0 ? "EQUAL" : "DIFFERENT");
  }
  return total == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
