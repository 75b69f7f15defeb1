// Packed segments (cu_seqlens) on the device, shared by the attention kernels (attention.cu,
// attention_sm80.cu): which segment holds token t, and where that segment starts and ends.
// Bounds are clamped so a malformed cu_seqlens gives wrong numbers, never an out-of-bounds access.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::kernels::cuda_ops {

// The segment holding token t (t < tokens): the last i with cu[i] <= t. Empty segments
// (cu[i] == cu[i + 1]) are skipped naturally.
__device__ __forceinline__ int segment_index(const int32_t* cu_seqlens, int num_segments, int t) {
  int lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ int segment_start(const int32_t* cu_seqlens, int num_segments, int t) {
  const int start = cu_seqlens[segment_index(cu_seqlens, num_segments, t)];
  return min(max(start, 0), t);
}

__device__ __forceinline__ int segment_end(const int32_t* cu_seqlens, int num_segments, int t, int tokens) {
  const int end = cu_seqlens[segment_index(cu_seqlens, num_segments, t) + 1];
  return min(max(end, t + 1), tokens);
}

}  // namespace moetrain::kernels::cuda_ops
