// KDA over a sequence split across the ranks of a context-parallel group (docs/ARCHITECTURE.md §5).
//
// Each rank holds a contiguous shard of a packed window; a document may span several shards. The
// gated delta rule is affine in its state, so a shard acts on the state entering it as
//   S_out = M S_in + S_local
// with M [k_dim, k_dim] per head (the product of the shard's (I - beta k k^T) Diag(exp(g)); zero
// when the shard holds a document start, which cuts the chain) and S_local the shard's final
// state from zero. Forward, each rank computes (M, S_local) from its own tokens, the group
// all-gathers them (a fixed number of bytes per rank, whatever the sequence length), each rank
// folds in the shards before it, S_in(r) = M_{r-1} S_in(r-1) + S_local_{r-1} (zero where its shard
// starts a document), and runs its shard from S_in(r). The backward mirrors it: the gradient of a
// shard's entering state is affine in the gradient of its leaving state,
//   dS_in = M^T dS_out + D_local
// so each rank computes D_local (its own outputs' pull on S_in), the group all-gathers (M, D_local),
// each rank folds in the shards after it, and runs its backward with dS_out(r) = dS_in(r + 1).
//
// Cost: three KDA forward passes per shard (S_local, M, the outputs) and two backward passes, plus
// the folds (cp products of [k_dim, k_dim] x [k_dim, v_dim] per head). The folds run on the host:
// the CPU backend only for now (the CUDA KDA takes no states yet).
#pragma once

#include "core/base/tensor.h"
#include "core/model/context_shards.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

// What the forward keeps for the backward: the state this shard started from and its M.
struct KdaShardState {
  Tensor entering;    // S_in [heads, k_dim, v_dim]
  Tensor transition;  // M [heads, k_dim, k_dim] (zero unless the shard is within one document)
};

class KdaAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding shard r of `shards`. Neither is owned.
  KdaAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards);

  // args: this shard's rows, cu_seqlens its shards.local_cu(), no states (this class sets them).
  void forward(const kernels::KdaArgs& args, KdaShardState* saved);
  void backward(const kernels::KdaBackwardArgs& args, const KdaShardState& saved);

 private:
  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
};

}  // namespace moetrain
