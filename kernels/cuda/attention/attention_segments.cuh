// Packed segments (cu_seqlens) on the device, shared by the attention kernels (attention.cu,
// attention_sm80.cu): which segment holds token t, and where that segment starts and ends; with
// key segments of their own (AttentionArgs::cu_seqlens_k), which keys a query sees and which
// queries see a key.
// Bounds are clamped so a malformed cu_seqlens gives wrong numbers, never an out-of-bounds access.
#pragma once

#include <cuda_runtime.h>

#include <climits>
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

// A key shift that is not given (ops.h kShiftFromSegments): each segment pair's own k_end - q_end.
constexpr int kSegmentShift = INT_MIN;

// The shift of segment pair i: `key_shift` when given (ops.h AttentionArgs::key_shift), else
// k_end - q_end.
__device__ __forceinline__ int pair_shift(const int32_t* cu_seqlens, const int32_t* cu_seqlens_k, int i,
                                          int key_shift) {
  return key_shift != kSegmentShift ? key_shift : cu_seqlens_k[i + 1] - cu_seqlens[i + 1];
}

// Keys query t sees: [first, last] of its segment's keys, the query segment being the last rows of
// the key segment (ops.h AttentionArgs::cu_seqlens_k): last = t + k_end - q_end, or t + key_shift.
// cu_seqlens_k == cu_seqlens gives [segment_start(t), t]. last is clamped below the segment's and
// the keys' end; last < first: the query sees no key.
struct KeyRange {
  int first;
  int last;
};
__device__ __forceinline__ KeyRange visible_keys(const int32_t* cu_seqlens, const int32_t* cu_seqlens_k,
                                                 int num_segments, int t, int key_tokens,
                                                 int key_shift = kSegmentShift) {
  const int i = segment_index(cu_seqlens, num_segments, t);
  KeyRange range;
  range.first = max(cu_seqlens_k[i], 0);
  range.last = min(min(t + pair_shift(cu_seqlens, cu_seqlens_k, i, key_shift), cu_seqlens_k[i + 1] - 1),
                   key_tokens - 1);
  return range;
}

// Queries that see key `key` or a later key of its segment start at or after this one (the query
// whose last visible key is `key`, or the segment's first query).
__device__ __forceinline__ int first_query_seeing(const int32_t* cu_seqlens, const int32_t* cu_seqlens_k,
                                                  int num_segments, int key, int key_shift = kSegmentShift) {
  const int j = segment_index(cu_seqlens_k, num_segments, key);
  return max(max(cu_seqlens[j], key - pair_shift(cu_seqlens, cu_seqlens_k, j, key_shift)), 0);
}

// One past the last query that sees key `key`: the end of its segment's queries, below tokens.
__device__ __forceinline__ int query_end_seeing(const int32_t* cu_seqlens, const int32_t* cu_seqlens_k,
                                                int num_segments, int key, int tokens) {
  const int j = segment_index(cu_seqlens_k, num_segments, key);
  return min(max(cu_seqlens[j + 1], 0), tokens);
}

}  // namespace moetrain::kernels::cuda_ops
