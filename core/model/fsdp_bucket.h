// One FSDP2-style flat bucket of frozen weights (docs/ARCHITECTURE.md §5): the member tensors' bytes,
// laid end to end (each aligned to its element size), padded to a multiple of the FSDP group size
// and split evenly; each rank keeps only its shard. Members may differ in dtype: FP8 weights
// (model.weight_format: fp8) travel as their U8 codes and F32 block scales beside BF16 norms, so a
// gather moves about half the bytes of the same layer in BF16. gather() all-gathers the bucket into one buffer and points every member at its offset
// there; release() frees that buffer and leaves the members as shape-only placeholders (no
// data), so a use of a released weight fails loudly instead of reading stale memory.
//
// On NCCL, gather() only queues the all-gather on the communicator's stream, after the compute
// queued so far (Communicator::wait_for), and returns at once; ready() makes the compute queued
// from then on wait for it (Communicator::release_to). The model calls ready() just before a
// layer's compute and gathers the next layers (prefetch) only after that, so their gathers run
// while this layer computes. release() waits for the backend's queued work before freeing.
// With MPI (the CPU backend) the all-gather completes before gather() returns.
#pragma once

#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace moetrain {

class FsdpBucket {
 public:
  // `members`: the bucket's tensors (shape and dtype; any memory they own is freed), identical
  // in order on every rank of `comm`. A shard's size is a multiple of the widest member element,
  // so a member's owned part is whole elements (a single-dtype bucket pads as an element array). This rank's shard starts zeroed: write it through
  // owned_part() (weights are loaded shard by shard, never whole). The members become
  // shape-only placeholders until gather().
  FsdpBucket(std::string name, const std::vector<Tensor*>& members, Communicator& comm, kernels::Backend& backend);
  FsdpBucket(const FsdpBucket&) = delete;
  FsdpBucket& operator=(const FsdpBucket&) = delete;

  // The elements [begin, end) of a member's flattened values that this rank stores, and the
  // shard memory holding them (dst has end - begin elements; empty when begin == end).
  struct OwnedPart {
    int64_t begin = 0;
    int64_t end = 0;
    TensorView dst;
  };
  // Null when `tensor` is not a member of this bucket.
  const OwnedPart* owned_part(const Tensor* tensor) const;

  void gather();   // queues the all-gather; no-op when already gathered
  void ready();    // compute queued from now on sees the gathered weights (after gather())
  void release();  // no-op when not gathered

  bool gathered() const { return gathered_.defined(); }
  const std::string& name() const { return name_; }
  int64_t full_bytes() const { return full_bytes_; }    // members' bytes and alignment, no padding
  int64_t shard_bytes() const { return shard_bytes_; }  // per rank, padding included
  size_t resident_bytes() const { return shard_.nbytes() + gathered_.nbytes(); }

 private:
  struct Member {
    Tensor* tensor;
    Shape shape;
    DType dtype;
    int64_t offset;  // bytes into the gathered buffer
    OwnedPart part;
  };
  void point_members(void* base);

  std::string name_;
  Communicator& comm_;
  kernels::Backend& backend_;
  std::vector<Member> members_;
  int64_t full_bytes_ = 0;
  int64_t shard_bytes_ = 0;
  Tensor shard_;     // U8 [shard_bytes], this rank's part
  Tensor gathered_;  // U8 [shard_bytes * group size] while gathered
  bool awaiting_ready_ = false;  // gathered, but compute has not been ordered after it yet
};

}  // namespace moetrain
