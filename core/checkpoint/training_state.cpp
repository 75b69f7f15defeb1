#include "core/checkpoint/training_state.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

#include "core/base/error.h"

namespace moetrain {
namespace {

TensorSlice slice_of(const ParameterLayout& layout, size_t index, const Shape& local_shape) {
  if (layout.slices.empty()) return TensorSlice{local_shape, 0};
  MOETRAIN_ASSERT(index < layout.slices.size(), "parameter layout shorter than the parameter list");
  return layout.slices[index];
}

ShardTensor host_copy(const std::string& key, const TensorView& device_value, const TensorSlice& slice,
                      kernels::Backend& backend, std::vector<Tensor>* storage) {
  storage->emplace_back(device_value.shape, device_value.dtype);
  backend.copy(storage->back(), device_value);
  return ShardTensor{key, storage->back().view(), slice};
}

// A NaN or Inf in a saved value or moment would train on as NaN (every update skipped) and be
// checkpointed again over the good ones: refuse it by name.
void check_finite(const Tensor& host, const std::string& checkpoint_dir, const std::string& key, int64_t first_row) {
  const int64_t n = host.numel();
  const int64_t row = host.shape().ndim() > 0 && host.size(0) > 0 ? n / host.size(0) : 1;
  auto report = [&](int64_t i, double v) {
    throw Error(ExitCode::kBadCheckpoint,
                fmt::format("{}: tensor \"{}\" holds a non-finite value ({} at row {}, element {}): the run that "
                            "saved it had already diverged; resume an earlier checkpoint (by path, or --resume auto, "
                            "which passes over checkpoints like this one)",
                            checkpoint_dir, key, v, first_row + i / row, i % row));
  };
  if (host.dtype() == DType::kF32) {
    const float* v = host.ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(v[i])) report(i, v[i]);
    }
  } else if (host.dtype() == DType::kF64) {
    const double* v = host.ptr<double>();
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(v[i])) report(i, v[i]);
    }
  }
}

void restore_one(const CheckpointReader& checkpoint, const std::string& key, const TensorView& dst,
                 const TensorSlice& slice, kernels::Backend& backend) {
  MOETRAIN_CHECK(checkpoint.has(key), ExitCode::kBadCheckpoint,
                 fmt::format("{}: no tensor \"{}\", which this run trains (lora.targets, lora.rank or the model "
                             "differ from the run that saved it; resume with the same settings)",
                             checkpoint.path(), key));
  const Shape& global = checkpoint.global_shape(key);
  MOETRAIN_CHECK(global == slice.global_shape, ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" has shape {} but this run's is {} (lora.rank or the model's "
                             "dimensions differ from the run that saved it)",
                             checkpoint.path(), key, global.str(), slice.global_shape.str()));
  Tensor host = checkpoint.read_rows(key, slice.offset, slice.offset + dst.shape[0], dst.dtype);
  check_finite(host, checkpoint.path(), key, slice.offset);
  backend.copy(dst, host);
}

}  // namespace

RankShard collect_training_state(AdamW& optimizer, kernels::Backend& backend, const ParameterLayout& layout,
                                 std::vector<Tensor>* storage) {
  RankShard shard;
  const std::vector<Parameter*>& params = optimizer.parameters();
  std::vector<AdamWStateView> moments = optimizer.gather_state();  // whole, whatever the sharding
  MOETRAIN_ASSERT(moments.size() == params.size(), "optimizer state and parameters disagree");
  // Reserve so the views into `storage` stay valid while it grows.
  storage->reserve(storage->size() + 3 * params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = *params[i];
    MOETRAIN_ASSERT(moments[i].name == p.name, "optimizer state order differs from the parameters'");
    if (!layout.save.empty() && !layout.save[i]) continue;
    TensorSlice slice = slice_of(layout, i, p.value.shape());
    shard.tensors.push_back(host_copy(kParamKind + p.name, p.value, slice, backend, storage));
    shard.tensors.push_back(host_copy(kExpAvgKind + p.name, moments[i].exp_avg, slice, backend, storage));
    shard.tensors.push_back(host_copy(kExpAvgSqKind + p.name, moments[i].exp_avg_sq, slice, backend, storage));
  }
  optimizer.release_state();
  return shard;
}

void restore_training_state(AdamW& optimizer, kernels::Backend& backend, const ParameterLayout& layout,
                            const CheckpointReader& checkpoint) {
  const std::vector<Parameter*>& params = optimizer.parameters();
  std::vector<AdamWStateView> moments = optimizer.gather_state();
  std::set<std::string> used;
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter& p = *params[i];
    TensorSlice slice = slice_of(layout, i, p.value.shape());
    for (const auto& [kind, dst] : {std::pair<const char*, TensorView>{kParamKind, p.value.view()},
                                    {kExpAvgKind, moments[i].exp_avg},
                                    {kExpAvgSqKind, moments[i].exp_avg_sq}}) {
      std::string key = kind + p.name;
      restore_one(checkpoint, key, dst, slice, backend);
      used.insert(key);
    }
  }
  optimizer.scatter_state();  // each rank keeps its shard of the moments
  for (const std::string& key : checkpoint.keys()) {
    if (key.rfind(kBufferKind, 0) == 0) continue;  // buffers are restored by their owners
    MOETRAIN_CHECK(used.count(key), ExitCode::kBadCheckpoint,
                   fmt::format("{}: tensor \"{}\" matches no trainable parameter of this run (lora.targets or the "
                               "model differ from the run that saved it)",
                               checkpoint.path(), key));
  }
  optimizer.set_step_count(checkpoint.manifest().optimizer_steps);
}

void collect_trained_buffers(TrainableModel& model, kernels::Backend& backend, bool save, RankShard& shard,
                             std::vector<Tensor>* storage) {
  const std::vector<TrainedBuffer> buffers = model.trained_buffers();
  if (!save) return;
  storage->reserve(storage->size() + buffers.size());  // the views into `storage` stay valid
  for (const TrainedBuffer& b : buffers) {
    const Shape& shape = b.value->shape();
    shard.tensors.push_back(host_copy(kBufferKind + b.name, b.value->view(), TensorSlice{shape, 0}, backend, storage));
  }
}

std::vector<std::string> restore_trained_buffers(TrainableModel& model, kernels::Backend& backend,
                                                 const CheckpointReader& checkpoint) {
  std::set<std::string> used;
  for (const TrainedBuffer& b : model.trained_buffers()) {
    const std::string key = kBufferKind + b.name;
    MOETRAIN_CHECK(checkpoint.has(key), ExitCode::kBadCheckpoint,
                   fmt::format("{}: no tensor \"{}\": the run that saved it did not update the experts' selection bias "
                               "(model.moe.bias_update_rate was 0); resume with the same rate, or start a new run",
                               checkpoint.path(), key));
    restore_one(checkpoint, key, b.value->view(), TensorSlice{b.value->shape(), 0}, backend);
    used.insert(key);
  }
  std::vector<std::string> unused;
  for (const std::string& key : checkpoint.keys()) {
    if (key.rfind(kBufferKind, 0) == 0 && !used.count(key)) unused.push_back(key);
  }
  return unused;
}

void check_checkpoint_finite(const CheckpointReader& checkpoint) {
  for (const std::string& key : checkpoint.keys()) {
    check_finite(checkpoint.read(key, DType::kF32), checkpoint.path(), key, 0);
  }
}

ParameterLayout expert_parallel_layout(const std::vector<Parameter*>& params, int64_t num_experts,
                                       int64_t first_expert, int rank, bool first_expert_replica) {
  ParameterLayout layout;
  for (const Parameter* p : params) {
    const Shape& shape = p->value.shape();
    bool expert_slice = shape.ndim() == 3 && p->name.find(".mlp.experts.") != std::string::npos;
    Shape global = shape;
    if (expert_slice) global[0] = num_experts;
    layout.slices.push_back(TensorSlice{global, expert_slice ? first_expert : 0});
    layout.save.push_back(expert_slice ? first_expert_replica : rank == 0);
  }
  return layout;
}

uint64_t resumed_data_cursor(const Manifest& manifest, int rank, int world) {
  MOETRAIN_ASSERT(rank >= 0 && rank < world, "rank outside the world");
  MOETRAIN_CHECK(!manifest.ranks.empty(), ExitCode::kBadCheckpoint, "manifest.json lists no ranks");
  // Job-wide: every saving rank recorded the same count (summing them, as if they were per-rank
  // counts, would jump ahead by the saved world size when resharding).
  const uint64_t cursor = manifest.ranks.front().data_cursor;
  for (size_t r = 1; r < manifest.ranks.size(); ++r) {
    MOETRAIN_CHECK(manifest.ranks[r].data_cursor == cursor, ExitCode::kBadCheckpoint,
                   fmt::format("manifest.json: rank {} saved data cursor {} but rank 0 saved {}; the data cursor "
                               "counts the samples of the whole job and must be the same on every rank (was the "
                               "checkpoint written by an older moetrain?)",
                               r, manifest.ranks[r].data_cursor, cursor));
  }
  return cursor;
}

}  // namespace moetrain
