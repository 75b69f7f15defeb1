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
// the folds (cp products of [k_dim, k_dim] x [k_dim, v_dim] per head). The folds run on the host
// whatever the backend: M and the states (heads x k_dim x (k_dim + v_dim) values a rank) are
// staged there from the backend's memory and back, and exchanged where the communicator's buffers
// live.
#pragma once

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
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

// The short convolutions before KDA over a split sequence: the first width - 1 tokens of a shard
// read the tokens before them in their document, which sit on earlier ranks (a halo, reaching
// past one rank when shards are shorter than width - 1). The group all-gathers every shard's last
// width - 1 rows (a fixed size), each rank prepends its halo to its rows and runs the convolution
// over both, and keeps the outputs of its own rows. The backward runs the same extended
// convolution with no gradient arriving at the halo's outputs, and the halo rows' input gradient
// goes back to the ranks that own them the same way (an all-gather of width - 1 rows).
class ShortConvAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding shard r of `shards`. Neither is owned.
  ShortConvAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards, int64_t width);

  // args: this shard's rows, cu_seqlens its shards.local_cu() (this class extends both).
  void forward(const kernels::ShortConvArgs& args);
  // dx: this shard's rows' whole gradient, the later shards' halos included (dweight, when
  // given, this rank's part: summed over the group it is the gradient of the whole sequence).
  void backward(const kernels::ShortConvBackwardArgs& args);

 private:
  // This shard's rows after the halo of rows before it: x [halo + tokens, channels], cu the
  // shard's segments with the first one reaching back over the halo.
  struct Extended {
    Tensor x, cu;
    int64_t halo = 0;
  };
  Extended extend(const TensorView& x);
  int64_t halo_begin(int r) const;  // the window position of shard r's first halo token
  // Every shard's [width - 1, channels] rows `mine`, gathered: [ranks * (width - 1), channels].
  Tensor gather_rows(const TensorView& mine);

  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
  int64_t reach_;  // width - 1: how far back a token reads
};

}  // namespace moetrain
