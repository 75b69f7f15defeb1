// FSDP loading from a Hugging Face directory (docs/ARCHITECTURE.md §5): under mpirun each rank reads only
// the rows holding its shards (and its experts), and the sharded model must compute the same
// logits as one process that loaded everything, on the golden fixture's batch (every rank runs
// the whole batch). Also checks that each rank keeps ~1/fsdp of the frozen non-expert bytes.
//
//   mpirun -np W distributed_hf_load FSDP EP MODEL_DIR
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "core/base/log.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "golden_files.h"
#include "kernels/ops.h"
#include "mpi_parallel_groups.h"
#include "parallel/mesh.h"
#include "parallel/runtime.h"

namespace moetrain {
namespace {

int run_test(Runtime& runtime, int argc, char** argv) {
  MOETRAIN_CHECK(argc == 4, ExitCode::kBadConfig, "usage: distributed_hf_load FSDP EP MODEL_DIR");
  MeshShape parallel;
  parallel.fsdp = std::stoi(argv[1]);
  parallel.ep = std::stoi(argv[2]);
  const std::string dir = argv[3];

  Config config;
  config.model.hf_dir = dir;
  config.data.seq_len = 16;
  ModelSpec spec = resolve_model_spec(config);
  testing::MpiParallelGroups mpi{MeshLayout(runtime.world(), parallel, spec.config.moe.num_experts)};
  ParallelGroups& groups = mpi.groups;
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora_targets = {"o_proj"};
  options.parallel = &groups;
  Model sharded(spec, *backend, options);
  HfCheckpoint sharded_files(dir);
  sharded.load_weights(sharded_files);
  const FrozenWeightBytes frozen = sharded.frozen_non_expert_bytes();
  Batch batch = testing::golden_batch(SafetensorsFile(dir + "/golden.safetensors"));
  Tensor ours = sharded.logits(batch);

  options.parallel = nullptr;
  Model whole(spec, *backend, options);
  HfCheckpoint whole_files(dir);
  whole.load_weights(whole_files);
  Tensor reference = whole.logits(batch);

  int failures = 0;
  double scale = 0.0, worst = 0.0;
  for (int64_t i = 0; i < reference.numel(); ++i) {
    scale = std::max(scale, std::fabs(reference.ptr<double>()[i]));
    worst = std::max(worst, std::fabs(ours.ptr<double>()[i] - reference.ptr<double>()[i]));
  }
  // Identical weights; only expert parallelism's combine order may differ in the last bits.
  if (!(worst <= 1e-12 * scale) || scale == 0.0) {
    ++failures;
    log::error(fmt::format("logits differ: max |diff| {:.3e} vs scale {:.3e}", worst, scale));
  }
  const double fraction = static_cast<double>(frozen.resident) / static_cast<double>(frozen.full);
  if (parallel.fsdp > 1 && !(sharded.fsdp_sharded() && fraction <= 1.0 / parallel.fsdp + 0.02)) {
    ++failures;
    log::error(fmt::format("holds {} of {} frozen non-expert bytes ({:.3f})", frozen.resident, frozen.full, fraction));
  }
  // Each rank reads only what it keeps: less than one process loading everything.
  if (!(sharded_files.bytes_read() < whole_files.bytes_read())) {
    ++failures;
    log::error(fmt::format("rank {} read {} bytes of base weights, the whole model is {}", runtime.rank(),
                           sharded_files.bytes_read(), whole_files.bytes_read()));
  }
  const int total = static_cast<int>(sharded.sum_over_data_ranks(failures));
  if (runtime.is_root()) {
    std::printf("distributed_hf_load world %d fsdp %lld ep %lld %s: %s (max |diff| %.3e of %.3e; frozen non-expert "
                "bytes per rank %zu of %zu; rank 0 read %llu of %llu checkpoint bytes)\n",
                runtime.world(), static_cast<long long>(parallel.fsdp), static_cast<long long>(parallel.ep),
                dir.c_str(), total == 0 ? "EQUAL" : "DIFFERENT", worst, scale, frozen.resident, frozen.full,
                static_cast<unsigned long long>(sharded_files.bytes_read()),
                static_cast<unsigned long long>(whole_files.bytes_read()));
  }
  return total == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
