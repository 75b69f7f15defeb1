// What a rank's training state is, in checkpoint terms: the trainable values, their AdamW
// moments (by parameter name), the step counters, the data cursor and the random stream.
//
// Keys are "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>" with the Parameter's name
// (its module path, e.g. "model.layers.1.mlp.experts.gate_proj.lora_A.weight" for the stacked
// routed-expert adapter [E, r, in]). Today every rank holds whole tensors (offset 0); when the
// distributed trainer shards a parameter along dimension 0 (FSDP shards, expert ranges under
// ep), its slice goes into ShardTensor::slice and restore_training_state reads exactly its rows.
#pragma once

#include <cstdint>
#include <vector>

#include "core/checkpoint/checkpoint_reader.h"
#include "core/checkpoint/checkpoint_writer.h"
#include "core/train/trainer.h"
#include "kernels/ops.h"

namespace moetrain {

// Where this rank's parameters sit in the global tensors: the row offset of parameter i along
// dimension 0 and its global shape. Empty: every parameter is whole (world 1, or replicated).
// `save` says which rank writes a tensor held by several (replicated LoRA factors: rank 0;
// an expert slice: the first of its expert replicas), so each global row is saved once.
struct ParameterLayout {
  std::vector<TensorSlice> slices;  // one per optimizer parameter, same order
  std::vector<bool> save;           // one per optimizer parameter; empty: save all
};

// The layout under expert parallelism: stacked routed-expert adapters ([local experts, ...],
// names "...mlp.experts.<proj>.lora_<A|B>.weight") are rows [first_expert, first_expert +
// local) of [num_experts, ...] and saved by the first replica of that expert block; every
// other parameter is whole and saved by rank 0.
ParameterLayout expert_parallel_layout(const std::vector<Parameter*>& params, int64_t num_experts,
                                       int64_t first_expert, int rank, bool first_expert_replica);

// Copies every parameter value and moment to the host (into `storage`, which must outlive the
// returned shard) and fills the progress fields.
RankShard collect_training_state(AdamW& optimizer, kernels::Backend& backend, const ParameterLayout& layout,
                                 std::vector<Tensor>* storage);

// Writes the checkpoint's values and moments into the optimizer's parameters (this rank's rows
// of each global tensor), and its step count. A parameter or moment missing from the
// checkpoint, of another global shape, or a checkpoint tensor the model has no parameter for,
// is Error(kBadCheckpoint) naming the key (usually: lora.targets or lora.rank changed); so is a
// NaN or Inf in any value it reads.
void restore_training_state(AdamW& optimizer, kernels::Backend& backend, const ParameterLayout& layout,
                            const CheckpointReader& checkpoint);

// The model's trained buffers (TrainableModel::trained_buffers: the selection biases of
// aux-loss-free balancing) as "buffer/<name>" tensors, copied to the host into `storage`. They are
// the same on every rank: only `save` (rank 0) lists them.
void collect_trained_buffers(TrainableModel& model, kernels::Backend& backend, bool save, RankShard& shard,
                             std::vector<Tensor>* storage);
// Writes them back from the checkpoint. A buffer the run trains that the checkpoint lacks, or of
// another shape, is Error(kBadCheckpoint) naming it; a saved buffer this run does not train
// (model.moe.bias_update_rate now 0) is returned, by key, for the caller to warn about.
std::vector<std::string> restore_trained_buffers(TrainableModel& model, kernels::Backend& backend,
                                                 const CheckpointReader& checkpoint);

// Error(kBadCheckpoint) naming the tensor and row when any tensor of the checkpoint holds a NaN
// or Inf (reads all of it: rank 0 checks a checkpoint this way before choosing it).
void check_checkpoint_finite(const CheckpointReader& checkpoint);

// The data cursor to continue from after resuming a checkpoint saved by manifest.world ranks,
// for `rank` of a job of `world` ranks. The cursor is job-wide (global samples the whole job has
// consumed, the same number on every rank: core/data/data_source.h), so it carries over to any
// world size unchanged; ranks that saved different cursors are Error(kBadCheckpoint).
uint64_t resumed_data_cursor(const Manifest& manifest, int rank, int world);

}  // namespace moetrain
