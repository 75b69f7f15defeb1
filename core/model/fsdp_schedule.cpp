#include "core/model/fsdp_schedule.h"

#include <algorithm>

namespace moetrain {

FsdpSchedule::FsdpSchedule(Communicator* comm, kernels::Backend& backend, const FsdpScheduleOptions& options)
    : comm_(comm != nullptr && comm->size() > 1 ? comm : nullptr), backend_(backend), options_(options) {}

void FsdpSchedule::add_layer(size_t index, const std::vector<Tensor*>& members) {
  if (!sharded()) return;
  MOETRAIN_ASSERT(index == layers_.size(), "FSDP layer buckets are added in layer order");
  layers_.push_back(std::make_unique<FsdpBucket>("model.layers." + std::to_string(index), members, *comm_, backend_));
}

void FsdpSchedule::set_outer(const std::vector<Tensor*>& members) {
  if (!sharded()) return;
  outer_ = std::make_unique<FsdpBucket>("embed+norm+lm_head", members, *comm_, backend_);
}

const FsdpBucket::OwnedPart* FsdpSchedule::owned_part(const Tensor* weight) const {
  for (const auto& bucket : layers_)
    if (const FsdpBucket::OwnedPart* part = bucket->owned_part(weight)) return part;
  return outer_ ? outer_->owned_part(weight) : nullptr;
}

void FsdpSchedule::release_all() {
  for (auto& bucket : layers_) bucket->release();
  if (outer_) outer_->release();
}

void FsdpSchedule::gather_layers(size_t index, int direction) {
  if (layers_.empty()) return;
  // The layer about to compute first (gathered and made ready), then the prefetched ones: their
  // gathers are queued after it, so on NCCL they run while it computes (fsdp_bucket.h). On the
  // CPU backend every gather blocks.
  for (int64_t k = 0; k <= std::max<int64_t>(0, options_.prefetch); ++k) {
    int64_t layer = static_cast<int64_t>(index) + direction * k;
    if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) break;
    layers_[layer]->gather();
    if (k == 0) layers_[layer]->ready();
  }
  note_gathered();
}

void FsdpSchedule::forward_done(size_t index, size_t num_layers, bool backward_follows) {
  if (!backward_follows || (options_.reshard_after_forward && index + 1 < num_layers)) release_layer(index);
}

void FsdpSchedule::note_gathered() {
  int64_t gathered = outer_ && outer_->gathered() ? 1 : 0;
  for (const auto& bucket : layers_) gathered += bucket->gathered() ? 1 : 0;
  peak_gathered_ = std::max(peak_gathered_, gathered);
}

void FsdpSchedule::release_layer(size_t index) {
  if (index < layers_.size()) layers_[index]->release();
}

void FsdpSchedule::gather_outer() {
  if (outer_) {
    outer_->gather();
    outer_->ready();
  }
  note_gathered();
}

void FsdpSchedule::release_outer() {
  if (outer_) outer_->release();
}

size_t FsdpSchedule::resident_bytes() const {
  size_t bytes = 0;
  for (const auto& bucket : layers_) bytes += bucket->resident_bytes();
  if (outer_) bytes += outer_->resident_bytes();
  return bytes;
}

}  // namespace moetrain
