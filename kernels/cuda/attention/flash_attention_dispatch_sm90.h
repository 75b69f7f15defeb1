// Host-side choices of the Hopper flash attention (flash_attention_forward_sm90.cu,
// flash_attention_backward_sm90.cu): which calls it takes (the checks both *_supported predicates
// share) and the head group of its launch order. No device code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/base/tensor.h"
#include "kernels/cuda/common/device.h"

namespace moetrain::kernels::cuda_ops::flash_sm90 {

// The checks both predicates share: the environment switch, the head dims, BF16 operands that TMA
// can address (16-byte aligned bases; rows of 64, 128 or 192 BF16 are whole 16 bytes).
inline bool flash_enabled_by_environment() {
  const char* value = std::getenv("MOETRAIN_ATTENTION");
  return value == nullptr || (std::strcmp(value, "mma") != 0 && std::strcmp(value, "simt") != 0);
}
inline bool flash_head_dims(const TensorView& q, const TensorView& v) {
  if (q.ndim() != 3 || v.ndim() != 3) return false;
  const int64_t qk = q.size(2), vd = v.size(2);
  return (qk == 64 && vd == 64) || (qk == 128 && vd == 128) || (qk == 192 && vd == 128);
}
inline bool flash_bf16_operand(const TensorView& t) {
  return t.dtype == DType::kBF16 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}
inline bool flash_shape_fits(const TensorView& q, double scale) {
  // Token coordinates are int32 in the kernels; the works ((blocks of 128 tokens) x heads) are
  // numbered as int, and WorkRing's counter runs past their count by up to the grid.
  if (q.ndim() != 3) return false;
  const int64_t tokens = q.size(0), heads = q.size(1);
  return tokens < (int64_t{1} << 30) && heads >= 1 && heads <= 65535 &&
         (tokens + 127) / 128 * heads < (int64_t{1} << 30) && std::isfinite(scale) && scale > 0.0;
}

// The head group of ordered_block for a pass of `blocks_per_head` blocks per head: at least 4 heads,
// and at least about two waves of the GPU's multiprocessors (at most all heads). On the H200
// (moetrain-bench, causal, 32 heads of 128) at T 8192 (64 blocks per head) groups of 2, 4 and 8
// heads ran the forward 3-5% and forward + backward 4-5% faster than one head at a time, 32 heads
// less; at T 32768 groups of 4 ran the forward as fast as one head at a time (14.9 ms).
inline int launch_order_group(int64_t blocks_per_head, int64_t heads) {
  const int64_t multiprocessors = ::moetrain::cuda::multiprocessor_count();
  const int64_t group = std::max<int64_t>(4, 2 * multiprocessors / blocks_per_head);
  return static_cast<int>(std::min(group, heads));
}

}  // namespace moetrain::kernels::cuda_ops::flash_sm90
