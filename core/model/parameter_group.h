// Trainable parameters that sum their gradients over the same ranks, stored back to back in one
// flat value buffer and one flat grad buffer. The group owns both buffers; each Parameter's
// value and grad become borrowed views into them, so layers keep reading `param.value` and
// accumulating into `param.grad` as before.
//
// The flat length is padded to a multiple of the group's size and split evenly: rank r owns
// elements [r * shard_numel, (r + 1) * shard_numel). That split is what the optimizer shards
// (FSDP2 / ZeRO style): it reduce-scatters the flat gradients, keeps Adam moments for its shard
// only, updates its shard of the values and all-gathers them back (core/train/optimizer.h).
//
// Every parameter starts at a multiple of kAlignment elements (and so does every shard), so a
// view of any parameter or shard is aligned for vectorised kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/model/parameter.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

class ParameterGroup {
 public:
  static constexpr int64_t kAlignment = 64;

  // The part of one parameter that lies in this rank's shard.
  struct Segment {
    Parameter* param;
    int64_t param_offset;  // first element, in the parameter's flattened order
    int64_t shard_offset;  // the same element's position in the shard
    int64_t count;
  };

  // Moves the parameters' values into the flat buffer (grads start at zero). `comm` is the set
  // of ranks the gradients sum over; null or size 1 means one rank owns the whole group.
  // `blocks` is set for parameters of which each rank holds one block (routed-expert adapters
  // under expert parallelism): the ranks holding the other blocks, for global sums (grad norm).
  ParameterGroup(std::string name, std::vector<Parameter*> params, Communicator* comm, Communicator* blocks,
                 kernels::Backend& backend);
  ParameterGroup(const ParameterGroup&) = delete;
  ParameterGroup& operator=(const ParameterGroup&) = delete;

  // Gives every parameter its own copy of its value and grad again, for a group that is
  // destroyed before its parameters (AdamW over loose parameters): their views would dangle.
  void return_storage();

  const std::string& name() const { return name_; }
  const std::vector<Parameter*>& params() const { return params_; }
  Communicator* comm() const { return comm_; }
  Communicator* blocks() const { return blocks_; }
  bool sharded() const { return ranks_ > 1; }
  int ranks() const { return ranks_; }
  int rank() const { return rank_; }

  int64_t shard_numel() const { return shard_numel_; }
  const TensorView& values() const { return values_.view(); }  // [ranks * shard_numel]
  const TensorView& grads() const { return grads_.view(); }
  TensorView value_shard() const { return values_.view().slice_rows(rank_ * shard_numel_, (rank_ + 1) * shard_numel_); }
  TensorView grad_shard() const { return grads_.view().slice_rows(rank_ * shard_numel_, (rank_ + 1) * shard_numel_); }
  // Each parameter's first element in the flat buffers, in parameter order.
  const std::vector<int64_t>& offsets() const { return offsets_; }
  // The parameters' parts inside this rank's shard, in parameter order.
  const std::vector<Segment>& segments() const { return segments_; }

 private:
  std::string name_;
  kernels::Backend& backend_;
  std::vector<Parameter*> params_;
  Communicator* comm_;
  Communicator* blocks_;
  int ranks_ = 1;
  int rank_ = 0;
  int64_t shard_numel_ = 0;
  Tensor values_;
  Tensor grads_;
  std::vector<int64_t> offsets_;
  std::vector<Segment> segments_;
};

// A scalar summed over a group of ranks (identity for a null group), staged through the
// communicator's memory: the same order and result on every rank.
double sum_over(Communicator* comm, kernels::Backend& backend, double local);
// The same for many values at once, in place (one all-reduce).
void sum_over(Communicator* comm, kernels::Backend& backend, std::vector<double>& values);

}  // namespace moetrain
