// The layer inputs a forward keeps for its backward (the activation checkpoints), optionally
// offloaded to page-locked host memory (parallel.offload): the forward hands each input over
// once its layer has run, a copy to the host starts on the backend's side queue, and the device
// buffer goes back to the allocator one layer later, after the ops' queue has been made to wait
// for that copy. The backward takes each input back; prefetch starts the copy of the next one
// down while the current layer runs, and take makes the ops' queue wait only for the copy it
// needs. The last input handed over is never freed: the backward takes it first.
//
// Without offload the class just holds the tensors. On the CPU backend the host copy is a plain
// copy and the device buffer is freed as on CUDA, so the CPU tests run the same sequence.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/base/tensor.h"
#include "core/model/layer_context.h"
#include "kernels/ops.h"

namespace moetrain {

class LayerCheckpoints {
 public:
  LayerCheckpoints(kernels::Backend& backend, bool offload) : backend_(backend), offload_(offload) {}

  // Starts a step of `layers` layers (what a previous step left is dropped).
  void begin(size_t layers);
  // Layer `index`'s input, no longer read on the device until the backward.
  void keep(size_t index, Tensor input);
  // The input of `index` is on the device by the time take(index) is called (a no-op when it is).
  void prefetch(const LayerContext& ctx, size_t index);
  // Layer `index`'s input on the device, the ops' queue ordered after its copy back.
  Tensor take(const LayerContext& ctx, size_t index);
  // Bytes of the layer inputs in page-locked host memory now (0 without offload).
  size_t host_bytes() const;

 private:
  struct Slot {
    Tensor device;                          // on the device: kept, in flight or prefetched
    Tensor host;                            // the pinned copy (kept across steps; offload only)
    std::unique_ptr<kernels::QueueEvent> copied;  // after the side queue's copy of this slot
    bool on_host = false;                   // the device buffer is gone: the data is in `host`
  };
  // Frees the device buffer of `index` once the ops' queue waits for its copy to the host.
  void drop_device(size_t index);

  kernels::Backend& backend_;
  bool offload_ = false;
  std::vector<Slot> slots_;
  size_t in_flight_ = static_cast<size_t>(-1);  // the last slot kept, its device buffer still held
};

}  // namespace moetrain
