#include "core/model/layer_checkpoints.h"

#include <utility>

#include "core/base/error.h"

namespace moetrain {

namespace {
constexpr size_t kNone = static_cast<size_t>(-1);
}  // namespace

void LayerCheckpoints::begin(size_t layers) {
  if (slots_.size() < layers) slots_.resize(layers);
  for (Slot& slot : slots_) {
    slot.device.reset();
    slot.copied.reset();
    slot.on_host = false;
  }
  in_flight_ = kNone;
}

void LayerCheckpoints::keep(size_t index, Tensor input) {
  MOETRAIN_ASSERT(index < slots_.size(), "layer checkpoint " + std::to_string(index) + " out of range");
  Slot& slot = slots_[index];
  slot.device = std::move(input);
  if (!offload_) return;
  // The host buffer persists across steps (page-locked allocations are slow, and freeing one waits
  // for the device); a step with another shape makes a new one. The side queue's previous copy out
  // of it was ordered before this one on the same queue.
  if (!slot.host.defined() || slot.host.shape() != slot.device.shape() || slot.host.dtype() != slot.device.dtype()) {
    slot.host = Tensor(slot.device.shape(), slot.device.dtype(), backend_.pinned_allocator());
  }
  backend_.side_wait(*backend_.record_event());  // the copy reads what the ops wrote
  backend_.side_copy_async(slot.host, slot.device);
  slot.copied = backend_.record_side_event();
  if (in_flight_ != kNone) drop_device(in_flight_);
  in_flight_ = index;
}

void LayerCheckpoints::drop_device(size_t index) {
  Slot& slot = slots_[index];
  // Ops queued after this wait may reuse the buffer: the copy out of it is done by then. Copy i
  // has run alongside layer i + 1's forward, so the wait rarely stalls the ops.
  backend_.ops_wait(*slot.copied);
  slot.device.reset();
  slot.on_host = true;
}

void LayerCheckpoints::prefetch(const LayerContext& ctx, size_t index) {
  if (index >= slots_.size()) return;
  Slot& slot = slots_[index];
  if (!slot.on_host) return;
  slot.device = ctx.alloc(slot.host.shape(), slot.host.dtype());
  // The buffer may be one the ops' queue has just freed: the copy waits for what was queued on it.
  backend_.side_wait(*backend_.record_event());
  backend_.side_copy_async(slot.device, slot.host);
  slot.copied = backend_.record_side_event();
  slot.on_host = false;
}

Tensor LayerCheckpoints::take(const LayerContext& ctx, size_t index) {
  MOETRAIN_ASSERT(index < slots_.size(), "layer checkpoint " + std::to_string(index) + " out of range");
  Slot& slot = slots_[index];
  prefetch(ctx, index);
  MOETRAIN_ASSERT(slot.device.defined(), "layer checkpoint " + std::to_string(index) + " was never kept");
  // The copy back, or for the slot still in flight its copy out, which must end before the ops
  // free the buffer after the layer's backward.
  if (slot.copied) backend_.ops_wait(*slot.copied);
  if (index == in_flight_) in_flight_ = kNone;
  slot.copied.reset();
  return std::move(slot.device);
}

size_t LayerCheckpoints::host_bytes() const {
  size_t bytes = 0;
  for (const Slot& slot : slots_) {
    if (slot.host.defined()) bytes += slot.host.nbytes();
  }
  return bytes;
}

}  // namespace moetrain
