// When the model's FSDP buckets (fsdp_bucket.h) are gathered and released over a step. One
// bucket per decoder layer and one for the outer weights (embed_tokens, the final norm, lm_head
// and the output depth mix), which are needed only at the two ends of a step:
//   forward   layer i gathered just before its compute, with `prefetch` layers ahead of it;
//             released after it (reshard_after_forward), except the last layer, whose backward
//             comes next; a forward-only pass always releases it
//   backward  the same in reverse, each layer released after its backward
// Without an FSDP group of several ranks there are no buckets and every call is a no-op.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/model/fsdp_bucket.h"

namespace moetrain {

struct FsdpScheduleOptions {
  int64_t prefetch = 1;                // layers gathered ahead of the one computing (0: just in time)
  bool reshard_after_forward = true;   // false: a layer's weights stay gathered from forward to backward
};

class FsdpSchedule {
 public:
  // `comm` null or of one rank: nothing is sharded.
  FsdpSchedule(Communicator* comm, kernels::Backend& backend, const FsdpScheduleOptions& options);

  bool sharded() const { return comm_ != nullptr; }
  const FsdpScheduleOptions& options() const { return options_; }
  int64_t ranks() const { return comm_ ? comm_->size() : 1; }
  size_t layer_buckets() const { return layers_.size(); }
  // The next layer's bucket and the outer one, at construction (the members' memory is freed:
  // each rank keeps its shard).
  void add_layer(size_t index, const std::vector<Tensor*>& members);
  void set_outer(const std::vector<Tensor*>& members);
  // The part of `weight` this rank stores, null when the weight is not sharded.
  const FsdpBucket::OwnedPart* owned_part(const Tensor* weight) const;

  // Layer `index` (made ready for compute), then `prefetch` more in the pass's direction.
  void gather_for_forward(size_t index) { gather_layers(index, +1); }
  void gather_for_backward(size_t index) { gather_layers(index, -1); }
  // After layer `index`'s forward (of `num_layers`): releases it unless its backward follows
  // with the weights kept (the last layer, or reshard_after_forward off).
  void forward_done(size_t index, size_t num_layers, bool backward_follows);
  void release_layer(size_t index);
  void gather_outer();
  void release_outer();
  void release_all();

  // Bytes of shards and gathered buffers this rank holds now.
  size_t resident_bytes() const;
  // The most buckets gathered at once so far.
  int64_t peak_gathered() const { return peak_gathered_; }

 private:
  void gather_layers(size_t index, int direction);
  void note_gathered();

  Communicator* comm_;
  kernels::Backend& backend_;
  FsdpScheduleOptions options_;
  std::vector<std::unique_ptr<FsdpBucket>> layers_;
  std::unique_ptr<FsdpBucket> outer_;
  int64_t peak_gathered_ = 0;
};

}  // namespace moetrain
