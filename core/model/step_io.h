// A step's traffic between the host and the device, without a host wait on the device:
//   BatchStaging    a micro-batch's index vectors in, through pinned staging buffers
//   ResultReadback  its per-token losses and every MoE layer's statistics out, in one copy into
//                   pinned memory behind an event, read when the PendingStep is asked
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "core/data/batch.h"
#include "core/model/layer_context.h"
#include "core/model/trainable_model.h"

namespace moetrain {

class MoeFfn;

// Checks on the host, before any id can index anything on a device: the batch's sizes, its token
// ids and labels within the vocabulary, its positions below max_position (Error kBadData).
void check_batch(const Batch& batch, int64_t vocab, int64_t max_position);

// Batch uploads go through pinned host buffers, two in turn: the host fills one while the device
// may still copy from the other; the event after a buffer's copies guards its refill (in a steady
// run long done, so no wait).
class BatchStaging {
 public:
  explicit BatchStaging(kernels::Backend& backend) : backend_(backend) {}
  // The batch's tensors on the device (check_batch first).
  BatchTensors upload(const Batch& batch);

 private:
  struct Buffer {
    Tensor host;  // int32, pinned
    std::unique_ptr<kernels::QueueEvent> copied;
  };
  kernels::Backend& backend_;
  std::array<Buffer, 2> buffers_;
  size_t turn_ = 0;
};

class ResultReadback {
 public:
  explicit ResultReadback(kernels::Backend& backend) : backend_(backend) {}
  // The micro-batch's StepResult: the sum of `losses` (per token, on the device) in token order
  // and the statistics of `moe_layers` (in layer order), queued for the host now.
  PendingStep queue(const LayerContext& ctx, const Tensor& losses, const std::vector<MoeFfn*>& moe_layers,
                    int64_t targets);

 private:
  kernels::Backend& backend_;
  // Pinned buffers that results come back into (U8); one a PendingStep still holds is busy.
  std::vector<std::shared_ptr<Tensor>> buffers_;
};

}  // namespace moetrain
