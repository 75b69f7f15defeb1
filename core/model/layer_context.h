// What every layer's forward and backward sees: the backend, the compute dtype, the
// micro-batch's index tensors on the backend's device, and, when the micro-batch is split across
// a context-parallel group, the cut and the group.
#pragma once

#include <optional>
#include <vector>

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

// The batch's integer tensors, on the backend's device (int32).
struct BatchTensors {
  Tensor input_ids;   // [tokens]
  Tensor labels;      // [tokens], -1: not a target
  Tensor positions;   // [tokens], position within the token's segment
  Tensor cu_seqlens;  // [segments + 1]
  std::vector<int32_t> host_cu_seqlens;  // the same offsets on the host (KDA's time segments cut them)
  int64_t num_tokens = 0;
  int64_t seq_len = 0;  // window length (segments never span windows)
  // Images (Batch::image_patches, model.vision): the patches in the compute dtype, the grids on
  // the host, and two int32 row maps: image_rows [image tokens], the rows of the placeholders in
  // order; merge_index [tokens], each row's source in [text embeddings | image tokens].
  Tensor image_patches;
  std::vector<int32_t> image_grids;
  Tensor image_rows;
  Tensor merge_index;
  // Where the pass's micro-batches start and end in its rows ([micro-batches + 1] prefix sums):
  // {0, num_tokens} for one micro-batch, more for an expert window (Model, train.expert_window),
  // whose per-micro-batch parts (router noise, aux loss, loss sums) follow these bounds.
  std::vector<int64_t> micro_batch_rows;
  // Context parallelism (Batch::context): this rank holds shard context_group->rank() of the
  // micro-batch cut as `context`; cu_seqlens are its own segments, positions the micro-batch's.
  std::optional<ContextShards> context;
};

struct LayerContext {
  kernels::Backend& backend;
  DType dtype;                  // activations and frozen weights (F32/F64 on CPU, BF16 on CUDA)
  const BatchTensors& batch;
  // The context-parallel group (parallel.cp > 1), when batch.context is set: the mixers exchange
  // what crosses the cut (core/model/*_context_parallel.h); everything position-wise runs as is.
  Communicator* context_group = nullptr;
  // parallel.cp_key_chunk: the MLA layers attend the keys other ranks hold in chunks of at most
  // this many rows (core/model/mla_context_parallel.h); 0: the longest shard. On one rank, the
  // keys a query block sees (0: in chunks of the block's length).
  int64_t context_key_chunk = 0;
  // parallel.attention_query_block: on one rank, the MLA layers run in query blocks of this many
  // rows, each against key chunks of context_key_chunk rows (core/model/mla_blocked.h); 0 with
  // context_key_chunk 0: the whole sequence at once.
  int64_t attention_query_block = 0;

  bool context_parallel() const { return batch.context.has_value(); }

  // The "accumulation" dtype of kernels/ops.h: LoRA parameters and gradients, statistics,
  // router logits/scores/weights, losses. F64 when computing in F64, else F32.
  DType accum() const { return dtype == DType::kF64 ? DType::kF64 : DType::kF32; }

  Tensor alloc(Shape shape) const { return Tensor(shape, dtype, backend.allocator()); }
  Tensor alloc(Shape shape, DType type) const { return Tensor(shape, type, backend.allocator()); }
  Tensor alloc_accum(Shape shape) const { return alloc(shape, accum()); }
};

}  // namespace moetrain
