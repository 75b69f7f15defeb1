// Causal attention over a sequence split across the ranks of a context-parallel group
// (docs/ARCHITECTURE.md §5): queries stay on their rank; every shard's keys and values are
// all-gathered (padded to the longest shard), each rank attends its queries against the keys of
// their documents up to its shard's end (ops.h AttentionArgs::cu_seqlens_k), and the gradients
// of the keys and values are reduce-scattered back to the ranks that own them. Memory per rank
// grows with the whole window's keys; a ring that overlaps the exchange with compute would not.
// DSA layers exchange their latent rows and indexer keys the same way (gather_visible_rows).
// The gathers and scatters are the backend's copies and the communicator's collectives, so they
// run where the tensors live (on CUDA, on the backend's stream; the attention with key segments
// then runs on the SIMT kernels, kernels/cuda/attention/attention.cu).
#pragma once

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

// The rows of a [tokens, ...] tensor that the queries of shard cp.rank() see: window tokens
// [document_start, end) of that shard, every shard's rows all-gathered (padded to the longest).
// Allocated from and copied by `backend`.
Tensor gather_visible_rows(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                           const TensorView& own);
// `visible`, this rank's gradient of those rows, summed over every rank that saw them into this
// rank's own rows `own` (overwritten): one reduce-scatter.
void return_visible_gradient(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                             const TensorView& visible, const TensorView& own);
// The visible rows' segments, paired with the shard's own (ContextShards::key_cu), as int32 on
// the backend's device.
Tensor visible_key_segments(kernels::Backend& backend, const ContextShards& shards, int rank);

class AttentionAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding shard r of `shards`. Neither is owned.
  AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards);

  // args: this shard's rows (q, k, v, out, lse; dq, dk, dv for its own keys), cu_seqlens its
  // shards.local_cu(), no cu_seqlens_k (this class sets it).
  void forward(const kernels::AttentionArgs& args);
  void backward(const kernels::AttentionBackwardArgs& args);

 private:
  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
};

}  // namespace moetrain
