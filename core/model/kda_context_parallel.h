// KDA over a sequence split across the ranks of a context-parallel group (docs/PARALLEL.md,
// "Context parallelism").
//
// Each rank holds spans of consecutive tokens of a packed window (one, or with
// parallel.cp_layout balanced two per window: chunks r and 2 cp - 1 - r); a document may run
// through several spans. The gated delta rule is affine in its state, so a span acts on the state
// entering it as
//   S_out = M S_in + S_local
// with M [k_dim, k_dim] per head (the product of the span's (I - beta k k^T) Diag(exp(g)); zero
// when the span holds a document start, which cuts the chain) and S_local the span's final state
// from zero. Forward, each rank computes (M, S_local) for each of its spans, the group all-gathers
// them (a fixed number of bytes per rank, whatever the sequence length), each rank folds in the
// spans before each of its own in window order, S_in(j) = M_{j-1} S_in(j-1) + S_local_{j-1} (zero
// where span j starts a document; a rank's second span folds in its first like any other), and
// runs each span from its S_in. The backward mirrors it: the gradient of a span's entering state
// is affine in the gradient of its leaving state,
//   dS_in = M^T dS_out + D_local
// so each rank computes D_local per span (its own outputs' pull on S_in), the group all-gathers
// (M, D_local), each rank folds in the spans after each of its own, and runs its backward with
// dS_out(j) = dS_in(j + 1).
//
// Cost: three KDA forward passes per span (S_local, M, the outputs) and two backward passes, plus
// the folds (a product of [k_dim, k_dim] x [k_dim, v_dim] per head and span before). The folds
// run on the host whatever the backend: M and the states (heads x k_dim x (k_dim + v_dim) values a
// span) are staged there from the backend's memory and back, and exchanged where the
// communicator's buffers live.
#pragma once

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

// What the forward keeps for the backward: per span of this rank (ContextShards::spans_of, padded
// to most_spans), the state it started from and its M.
struct KdaShardState {
  Tensor entering;    // S_in [spans, heads, k_dim, v_dim]
  Tensor transition;  // M [spans, heads, k_dim, k_dim] (zero unless the span is within one document)
};

class KdaAcrossRanks {
 public:
  // `cp`: the context-parallel group, its rank r holding the spans of rank r of `shards`. Neither
  // is owned.
  KdaAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards);

  // args: this shard's rows, cu_seqlens its shards.local_cu(), no states (this class sets them).
  void forward(const kernels::KdaArgs& args, KdaShardState* saved);
  void backward(const kernels::KdaBackwardArgs& args, const KdaShardState& saved);

 private:
  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
};

// The short convolutions before KDA over a split sequence: the first width - 1 tokens of a span
// read the tokens before them in their document, which sit in the spans before it in window order
// (a halo from the globally previous span, wherever it lives: for balanced chunk 2 cp - 1 - r,
// chunk 2 cp - 2 - r on rank r + 1, or rank r's own first chunk for r = cp - 1; reaching past one
// span when spans are shorter than width - 1). The group all-gathers every span's last width - 1
// rows (a fixed size), each rank prepends its halo to each of its spans and runs the convolution
// over all of them at once, and keeps the outputs of its own rows. The backward runs the same extended
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
  // This rank's spans, each after the halo of rows before it: x [sum of (halo + tokens), channels],
  // span i's halo at rows [at[i], at[i] + halo[i]) and its own rows after; cu the spans'
  // segments with each span's first one reaching back over its halo.
  struct Extended {
    Tensor x, cu;
    std::vector<int64_t> halo, at;
  };
  Extended extend(const TensorView& x);
  int64_t halo_begin(int s) const;  // the window position of span s's first halo token
  // Every rank's [spans * (width - 1), channels] rows `mine`, gathered.
  Tensor gather_rows(const TensorView& mine);

  kernels::Backend& backend_;
  Communicator& cp_;
  const ContextShards& shards_;
  int64_t reach_;  // width - 1: how far back a token reads
};

}  // namespace moetrain
