// MoE routing on CUDA (see RouterArgs, RouterBackwardArgs and AuxLossArgs in kernels/ops.h;
// kernels/cpu/router.* is the spec): scores, group-limited top-k with the correction bias,
// normalised and scaled weights, their backward, and the auxiliary load-balancing loss.
//
// Operands: logits, scores, topk_weight, dtopk_weight, dscores_extra, dlogits, dscores and loss
// are F32 (the accumulation class of the dtype policy); bias and noise BF16 or F32; topk_index
// int32. Outputs are overwritten. Expert indices read back (router_backward, aux_loss) are not
// validated on the device: an index outside [0, experts) is skipped, never written through.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

void router_forward(const RouterArgs& args, cudaStream_t stream);
void router_backward(const RouterBackwardArgs& args, cudaStream_t stream);
void aux_loss(const AuxLossArgs& args, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
