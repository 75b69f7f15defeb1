// Expert parallelism's token exchange (the "dispatch" and "combine" stages of the MoE layer).
//
// Each rank of an EP group of P ranks holds E / P contiguous experts. After routing, a rank's
// routed rows are sorted by global expert, so the rows for EP rank p (experts [p E/P, (p+1) E/P))
// are one contiguous block. plan() exchanges the per-expert row counts (an all-to-all of counts,
// so every rank knows what it will receive before any rows move: zero is a normal count);
// to_experts() sends the rows with one all-to-all-v and regroups what arrives (source-major)
// into expert-major order for the grouped GEMM; from_experts() undoes both. The backward pass
// uses the same two movements for the gradients (dispatch of gradients = from_experts' layout
// reversed, and vice versa), so the plan is made once per forward.
#pragma once

#include <vector>

#include "core/model/layer_context.h"
#include "parallel/comm.h"

namespace moetrain {

class ExpertDispatch {
 public:
  ExpertDispatch(Communicator& ep, int64_t num_experts, int64_t local_experts)
      : ep_(ep), num_experts_(num_experts), local_experts_(local_experts) {}

  // From this rank's routed-row offsets per global expert (host, [E + 1]): exchanges counts and
  // fixes the layouts. Returns the local experts' row offsets ([local + 1], on the device).
  Tensor plan(const LayerContext& ctx, const int32_t* expert_offsets_host);
  int64_t local_rows() const { return local_rows_; }
  const std::vector<int32_t>& local_offsets() const { return local_offsets_; }  // plan()'s, on the host

  // local [local_rows, D] (expert-major) <- routed [routed rows, D] of every rank.
  void to_experts(const LayerContext& ctx, const TensorView& local, const TensorView& routed) const;
  // routed [routed rows, D] <- local [local_rows, D]: each row back to the rank it came from.
  void from_experts(const LayerContext& ctx, const TensorView& routed, const TensorView& local) const;

 private:
  Communicator& ep_;
  int64_t num_experts_;
  int64_t local_experts_;
  std::vector<int64_t> send_rows_, recv_rows_;  // per EP rank
  int64_t local_rows_ = 0;
  std::vector<int32_t> local_offsets_;
  Tensor regroup_;    // int32 [local_rows]: expert-major row <- received (source-major) row
  Tensor ungroup_;    // int32 [local_rows]: its inverse
};

}  // namespace moetrain
