// Aux-loss-free balancing under mpirun (expert parallelism, FSDP): every rank routes its own
// micro-batches, the bias update sums the step's rows over all ranks, and every rank must end
// with the same bias as a one-rank model that routed every rank's micro-batches itself and
// applied the rule to its own count, bit for bit.
//
//   mpirun -np W distributed_expert_bias FSDP EP
#include <fmt/format.h>

#include <cstdio>
#include <string>

#include "core/base/host_convert.h"
#include "core/base/log.h"
#include "core/data/synthetic_data.h"
#include "core/model/model.h"
#include "kernels/ops.h"
#include "mpi_parallel_groups.h"
#include "parallel/mesh.h"
#include "parallel/runtime.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

constexpr int64_t kGradAccum = 2;

Config test_config() {
  Config config = testing::tiny_model_config(/*q_lora=*/true);
  config.model.moe.num_experts = 8;
  config.model.moe.top_k = 2;
  config.model.moe.num_groups = 2;
  config.model.moe.bias_update_rate = 0.125;
  config.data.seq_len = 8;
  config.data.micro_batch = 1;
  return config;
}

ModelOptions options_for(ParallelGroups* groups) {
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = testing::all_lora_targets(true);
  options.parallel = groups;
  return options;
}

// Adds one pass's rows into `sum` (per layer, per expert).
void add_rows(std::vector<std::vector<int64_t>>& sum, const StepResult& result) {
  if (sum.empty()) sum.resize(result.expert_rows.size());
  for (size_t l = 0; l < sum.size(); ++l) {
    if (sum[l].empty()) sum[l].assign(result.expert_rows[l].size(), 0);
    for (size_t e = 0; e < sum[l].size(); ++e) sum[l][e] += result.expert_rows[l][e];
  }
}

std::vector<double> bias_values(Model& model) {
  std::vector<double> all;
  for (const TrainedBuffer& b : model.trained_buffers()) {
    Tensor host(b.value->shape(), DType::kF64);
    Tensor stored(b.value->shape(), b.value->dtype());
    model.backend().copy(stored, *b.value);
    convert_host(host.view(), stored.view());
    all.insert(all.end(), host.ptr<double>(), host.ptr<double>() + host.numel());
  }
  return all;
}

int run_test(Runtime& runtime, int argc, char** argv) {
  MOETRAIN_CHECK(argc == 3, ExitCode::kBadConfig, "usage: distributed_expert_bias FSDP EP");
  MeshShape shape;
  shape.fsdp = std::stoi(argv[1]);
  shape.ep = std::stoi(argv[2]);
  const Config config = test_config();
  const ModelSpec spec = resolve_model_spec(config);
  const int world = runtime.world(), rank = runtime.rank();
  testing::MpiParallelGroups mpi{MeshLayout(world, shape, spec.config.moe.num_experts)};

  auto backend = kernels::make_cpu_backend();
  Model model(spec, *backend, options_for(&mpi.groups));
  model.init_random_weights();
  SyntheticData data(config.data, spec.config.vocab_size, rank, world);
  std::vector<std::vector<int64_t>> rows;
  for (int64_t i = 0; i < kGradAccum; ++i) add_rows(rows, model.forward_backward(data.next(), 1.0));
  model.update_expert_bias(rows);

  // The reference: one rank, every rank's micro-batches, its own count.
  Model reference(spec, *backend, options_for(nullptr));
  reference.init_random_weights();
  std::vector<std::vector<int64_t>> all_rows;
  for (int r = 0; r < world; ++r) {
    SyntheticData source(config.data, spec.config.vocab_size, r, world);
    for (int64_t i = 0; i < kGradAccum; ++i) add_rows(all_rows, reference.forward_backward(source.next(), 1.0));
  }
  reference.update_expert_bias(all_rows);

  const std::vector<double> got = bias_values(model), expected = bias_values(reference);
  int failures = got == expected && !got.empty() ? 0 : 1;
  if (failures != 0) log::error(fmt::format("rank {}: the updated bias differs from the one-rank reference", rank));
  Model untouched(spec, *backend, options_for(nullptr));
  untouched.init_random_weights();
  if (expected == bias_values(untouched)) {
    ++failures;  // the update must have moved something
    log::error("the reference bias did not move");
  }
  double total_failures = static_cast<double>(failures);  // every rank's verdict
  mpi.data.all_reduce(&total_failures, 1);
  const int total = static_cast<int>(total_failures);
  if (runtime.is_root()) {
    std::printf("distributed_expert_bias world %d fsdp %lld ep %lld: %s\n", world, static_cast<long long>(shape.fsdp),
                static_cast<long long>(shape.ep), total == 0 ? "EQUAL" : "DIFFERENT");
  }
  return total == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
