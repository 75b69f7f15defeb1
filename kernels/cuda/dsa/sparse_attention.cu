// Sparse attention in MQA form over each query's selected rows (kernels/ops.h SparseAttentionArgs;
// kernels/cpu/dsa.cpp is the spec). SIMT kernels, F32 math; a query's heads share its gathered
// rows, so one CTA serves a query and a group of its heads. The forward hands BF16 at the latent
// dims 576 / 512 to the Hopper kernel (sparse_attention_forward_sm90.cu) where it runs, and the backward its
// step 1 (sparse_attention_backward_sm90.cu; step 2 below is shared).
//
// Forward: one CTA per (query, head group) walks the query's topk_index in blocks of 32 entries:
// it gathers those kv rows into shared memory, computes the group's logits (a warp per head, a
// lane per entry), keeps an online softmax per head (running max and sum) and accumulates
// out[h, c] += p v[c] in registers (a thread per value column, every head of the group).
//
// Backward, deterministic without atomics:
//   1. per query (one CTA, head groups in turn): delta = dout . out, then per block of entries
//      P = exp(scale q.kv - lse), dS = P (dout . kv[:v_dim] - delta) scale; dq[h] = sum dS kv is
//      accumulated in registers, and the query's contribution to each selected row,
//        contrib[t, i] = sum_h dS[h, i] q[h] + P[h, i] dout[h] (value columns),
//      is written to scratch (a later head group adds to what the earlier ones wrote: the same
//      thread owns the same elements).
//   2. per key s: dkv[s] = sum of contrib over every (t, i) that selected s, in ascending t. The
//      (t, i) of each key come from an inverse index built once per call: a stable radix sort of
//      the flat positions t * top_k + i by key (cub), so each key's positions are ascending.
// Queries go in chunks whose contributions fit in scratch (sparse_attention.h); chunks run in order and each
// adds to an F32 dkv accumulator, so the order of every sum is fixed.
//
// topk_index stays on the device: an entry outside [0, t + key_offset] is skipped (the CPU backend
// rejects such indices; valid ones are rows <= t + key_offset, ascending, then -1s). kv has
// key_offset + tokens rows (a context-parallel shard's queries read the earlier shards' rows too).
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/base/error.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/dsa/sparse_attention.h"

namespace moetrain::kernels::cuda_ops {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlockEntries = 32;        // topk entries per step: a lane each
constexpr int kMaxForwardHeads = 32;     // heads per forward CTA (registers: heads x value columns per thread)
constexpr int kMaxBackwardHeads = 16;    // heads per backward CTA
// dkv contributions of one chunk of queries in scratch; each query of a chunk is one CTA, so the
// chunk should hold a few hundred (at DeepSeek-V3.2's top-2048 x 576, 512 MiB is 113 queries).
constexpr int64_t kContribBudgetBytes = int64_t{512} << 20;
// The Hopper step 1 runs a chunk as one launch of a CTA per query: 512 MiB would be less than one
// wave at these dims, 2 GiB is 3 waves of 132 SMs.
constexpr int64_t kTensorCoreContribBudgetBytes = int64_t{2048} << 20;

// ---------------------------------------------------------------------------------------------
// Shared-memory rows: F32, or BF16 when every operand read into them is BF16 (exact). Row strides
// keep a warp's lanes (one row each) on distinct banks: an odd number of 4-byte words.

__device__ __forceinline__ float load_value(const void* p, bool is_bf16, int64_t i) {
  return is_bf16 ? __bfloat162float(static_cast<const bf16*>(p)[i]) : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void store_value(void* p, bool is_bf16, int64_t i, float v) {
  if (is_bf16) {
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

template <typename S>
__device__ __forceinline__ S to_storage(float x);
template <>
__device__ __forceinline__ float to_storage<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 to_storage<bf16>(float x) {
  return __float2bfloat16_rn(x);
}
__device__ __forceinline__ float from_storage(float x) { return x; }
__device__ __forceinline__ float from_storage(bf16 x) { return __bfloat162float(x); }

// Columns a row holds in shared memory (BF16 rows are read in pairs: an even count, the extra
// column zero) and its stride.
template <typename S>
__host__ __device__ constexpr int stored_cols(int cols) {
  return sizeof(S) == 2 ? (cols + 1) / 2 * 2 : cols;
}
template <typename S>
__host__ __device__ constexpr int row_stride(int cols) {
  return sizeof(S) == 2 ? (stored_cols<S>(cols) / 2 % 2 == 1 ? stored_cols<S>(cols) : stored_cols<S>(cols) + 2)
                        : (cols % 2 == 1 ? cols : cols + 1);
}

// a . b over `cols` stored columns (both rows zero past the real ones).
__device__ __forceinline__ float dot_rows(const float* a, const float* b, int cols) {
  float sum = 0.0f;
  for (int d = 0; d < cols; ++d) sum += a[d] * b[d];
  return sum;
}
__device__ __forceinline__ float dot_rows(const bf16* a, const bf16* b, int cols) {
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(a);
  const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(b);
  float sum = 0.0f;
  for (int d = 0; d < cols / 2; ++d) {
    const float2 x = __bfloat1622float2(a2[d]), y = __bfloat1622float2(b2[d]);
    sum += x.x * y.x;
    sum += x.y * y.y;
  }
  return sum;
}

// rows x stored_cols(cols) values into a shared tile: row r from src_row(r) (< 0: zeros).
template <typename S, typename RowOffset>
__device__ __forceinline__ void load_rows(S* tile, int rows, int cols, const void* src, bool src_bf16,
                                          RowOffset src_row) {
  const int width = stored_cols<S>(cols), stride = row_stride<S>(cols);
  for (int e = threadIdx.x; e < rows * width; e += blockDim.x) {
    const int r = e / width, c = e % width;
    const int64_t offset = src_row(r);
    tile[r * stride + c] = to_storage<S>(offset >= 0 && c < cols ? load_value(src, src_bf16, offset + c) : 0.0f);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The next block of query t's entries into `slots` (kBlockEntries, -1 where invalid); true when
// any is valid. Every thread calls it (it synchronises the block).
__device__ __forceinline__ bool load_entries(int* slots, const int32_t* index, int top_k, int t, int key_offset,
                                             int block0) {
  bool valid = false;
  if (threadIdx.x < kBlockEntries) {
    const int e = block0 + threadIdx.x;
    const int s = e < top_k ? index[static_cast<int64_t>(t) * top_k + e] : -1;
    valid = s >= 0 && s <= t + key_offset;
    slots[threadIdx.x] = valid ? s : -1;
  }
  return __syncthreads_or(valid) != 0;
}

// ---------------------------------------------------------------------------------------------
// Forward

struct ForwardParams {
  const void* q = nullptr;   // [tokens, heads, qk]
  const void* kv = nullptr;  // [key_offset + tokens, qk]
  bool q_bf16 = false, kv_bf16 = false;
  const int32_t* index = nullptr;  // [tokens, top_k]
  void* out = nullptr;             // [tokens, heads, v]
  bool out_bf16 = false;
  float* lse = nullptr;  // [tokens, heads]
  int tokens = 0, heads = 0, qk = 0, v = 0, top_k = 0;
  int key_offset = 0;  // query t's own key is kv row t + key_offset
  int group_heads = 1;
  float scale = 1.0f;
};

template <typename S>
size_t forward_smem_bytes(int group_heads, int qk) {
  return sizeof(float) * (static_cast<size_t>(group_heads) * kBlockEntries + 3 * group_heads) +
         sizeof(int) * kBlockEntries +
         sizeof(S) * static_cast<size_t>(group_heads + kBlockEntries) * row_stride<S>(qk);
}

template <typename S, int kValueCols>
__global__ void __launch_bounds__(kThreads) sparse_attention_forward_kernel(ForwardParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = p.group_heads;
  float* probs = reinterpret_cast<float*>(smem);  // [group][kBlockEntries]
  float* row_max = probs + group * kBlockEntries;
  float* row_sum = row_max + group;
  float* rescale = row_sum + group;
  int* slots = reinterpret_cast<int*>(rescale + group);
  S* q_st = reinterpret_cast<S*>(slots + kBlockEntries);  // [group][stride]
  const int stride = row_stride<S>(p.qk);
  S* kv_st = q_st + group * stride;  // [kBlockEntries][stride]

  const int t = blockIdx.x, h_begin = blockIdx.y * group;
  const int heads_here = min(group, p.heads - h_begin);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_rows<S>(q_st, heads_here, p.qk, p.q, p.q_bf16,
               [&](int r) { return (static_cast<int64_t>(t) * p.heads + h_begin + r) * p.qk; });
  for (int h = threadIdx.x; h < heads_here; h += blockDim.x) {
    row_max[h] = -INFINITY;
    row_sum[h] = 0.0f;
  }
  float acc[kMaxForwardHeads][kValueCols];
#pragma unroll
  for (int h = 0; h < kMaxForwardHeads; ++h)
#pragma unroll
    for (int j = 0; j < kValueCols; ++j) acc[h][j] = 0.0f;

  for (int block0 = 0; block0 < p.top_k; block0 += kBlockEntries) {
    __syncthreads();  // the previous block's rows and probabilities are consumed
    if (!load_entries(slots, p.index, p.top_k, t, p.key_offset, block0)) continue;
    load_rows<S>(kv_st, kBlockEntries, p.qk, p.kv, p.kv_bf16, [&](int r) {
      return slots[r] >= 0 ? static_cast<int64_t>(slots[r]) * p.qk : int64_t{-1};
    });
    __syncthreads();
    const bool valid = slots[lane] >= 0;
    for (int h = warp; h < heads_here; h += kWarps) {
      const float logit =
          valid ? p.scale * dot_rows(q_st + h * stride, kv_st + lane * stride, stored_cols<S>(p.qk)) : -INFINITY;
      const float old_max = row_max[h];
      const float new_max = fmaxf(old_max, warp_max(logit));
      float prob = 0.0f, factor = 1.0f;
      if (new_max != -INFINITY) {
        prob = valid ? expf(logit - new_max) : 0.0f;
        factor = expf(old_max - new_max);
      }
      const float block_sum = warp_sum(prob);
      probs[h * kBlockEntries + lane] = prob;
      if (lane == 0) {
        row_sum[h] = row_sum[h] * factor + block_sum;
        row_max[h] = new_max;
        rescale[h] = factor;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kValueCols; ++j) {
      const int c = threadIdx.x + j * kThreads;
      if (c >= p.v) continue;
#pragma unroll
      for (int h = 0; h < kMaxForwardHeads; ++h)
        if (h < heads_here) acc[h][j] *= rescale[h];
      for (int i = 0; i < kBlockEntries; ++i) {
        const float value = from_storage(kv_st[i * stride + c]);
#pragma unroll
        for (int h = 0; h < kMaxForwardHeads; ++h)
          if (h < heads_here) acc[h][j] += probs[h * kBlockEntries + i] * value;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kMaxForwardHeads; ++h) {
    if (h >= heads_here) break;
    const float sum = row_sum[h];
    const int64_t row = static_cast<int64_t>(t) * p.heads + h_begin + h;
#pragma unroll
    for (int j = 0; j < kValueCols; ++j) {
      const int c = threadIdx.x + j * kThreads;
      if (c < p.v) store_value(p.out, p.out_bf16, row * p.v + c, sum > 0.0f ? acc[h][j] / sum : 0.0f);
    }
    if (threadIdx.x == 0) p.lse[row] = sum > 0.0f ? row_max[h] + logf(sum) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 1: per query

struct BackwardParams {
  const void* q = nullptr;
  const void* kv = nullptr;
  const void* dout = nullptr;  // [tokens, heads, v]
  const void* out = nullptr;
  bool q_bf16 = false, kv_bf16 = false, dout_bf16 = false, out_bf16 = false;
  const float* lse = nullptr;
  const int32_t* index = nullptr;
  void* dq = nullptr;
  bool dq_bf16 = false;
  float* contrib = nullptr;  // [chunk rows, top_k, qk]
  int tokens = 0, heads = 0, qk = 0, v = 0, top_k = 0;
  int key_offset = 0;  // as ForwardParams
  int group_heads = 1;
  int chunk_begin = 0;
  float scale = 1.0f;
};

template <typename S>
size_t backward_smem_bytes(int group_heads, int qk, int v) {
  return sizeof(float) * (2 * static_cast<size_t>(group_heads) * kBlockEntries + 2 * group_heads) +
         sizeof(int) * kBlockEntries +
         sizeof(S) * (static_cast<size_t>(group_heads + kBlockEntries) * row_stride<S>(qk) +
                      static_cast<size_t>(group_heads) * row_stride<S>(v));
}

template <typename S, int kQkCols>
__global__ void __launch_bounds__(kThreads) sparse_attention_backward_query_kernel(BackwardParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = p.group_heads;
  float* probs = reinterpret_cast<float*>(smem);  // [group][kBlockEntries]
  float* dscores = probs + group * kBlockEntries;
  float* delta = dscores + group * kBlockEntries;
  float* row_lse = delta + group;
  int* slots = reinterpret_cast<int*>(row_lse + group);
  S* q_st = reinterpret_cast<S*>(slots + kBlockEntries);
  const int q_stride = row_stride<S>(p.qk), v_stride = row_stride<S>(p.v);
  S* do_st = q_st + group * q_stride;
  S* kv_st = do_st + group * v_stride;

  const int t = p.chunk_begin + blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* contrib = p.contrib + static_cast<int64_t>(blockIdx.x) * p.top_k * p.qk;

  for (int h_begin = 0; h_begin < p.heads; h_begin += group) {
    const int heads_here = min(group, p.heads - h_begin);
    const int64_t row0 = static_cast<int64_t>(t) * p.heads + h_begin;
    __syncthreads();  // the previous group's rows are consumed
    load_rows<S>(q_st, heads_here, p.qk, p.q, p.q_bf16, [&](int r) { return (row0 + r) * p.qk; });
    load_rows<S>(do_st, heads_here, p.v, p.dout, p.dout_bf16, [&](int r) { return (row0 + r) * p.v; });
    for (int h = warp; h < heads_here; h += kWarps) {
      float d = 0.0f;
      for (int c = lane; c < p.v; c += 32)
        d += load_value(p.dout, p.dout_bf16, (row0 + h) * p.v + c) * load_value(p.out, p.out_bf16, (row0 + h) * p.v + c);
      d = warp_sum(d);
      if (lane == 0) {
        delta[h] = d;
        row_lse[h] = p.lse[row0 + h];
      }
    }
    float dq[kMaxBackwardHeads][kQkCols];
#pragma unroll
    for (int h = 0; h < kMaxBackwardHeads; ++h)
#pragma unroll
      for (int j = 0; j < kQkCols; ++j) dq[h][j] = 0.0f;

    for (int block0 = 0; block0 < p.top_k; block0 += kBlockEntries) {
      __syncthreads();
      if (!load_entries(slots, p.index, p.top_k, t, p.key_offset, block0)) continue;
      load_rows<S>(kv_st, kBlockEntries, p.qk, p.kv, p.kv_bf16, [&](int r) {
        return slots[r] >= 0 ? static_cast<int64_t>(slots[r]) * p.qk : int64_t{-1};
      });
      __syncthreads();
      const bool valid = slots[lane] >= 0;
      for (int h = warp; h < heads_here; h += kWarps) {
        float prob = 0.0f, dscore = 0.0f;
        if (valid) {
          const S* kv_row = kv_st + lane * q_stride;
          prob = expf(p.scale * dot_rows(q_st + h * q_stride, kv_row, stored_cols<S>(p.qk)) - row_lse[h]);
          const float dprob = dot_rows(do_st + h * v_stride, kv_row, stored_cols<S>(p.v));
          dscore = prob * (dprob - delta[h]) * p.scale;
        }
        probs[h * kBlockEntries + lane] = prob;
        dscores[h * kBlockEntries + lane] = dscore;
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kQkCols; ++j) {
        const int c = threadIdx.x + j * kThreads;
        if (c >= p.qk) continue;
        for (int i = 0; i < kBlockEntries; ++i) {
          const float value = from_storage(kv_st[i * q_stride + c]);
#pragma unroll
          for (int h = 0; h < kMaxBackwardHeads; ++h)
            if (h < heads_here) dq[h][j] += dscores[h * kBlockEntries + i] * value;
        }
        for (int i = 0; i < kBlockEntries; ++i) {
          if (slots[i] < 0) continue;
          float sum = 0.0f;
          for (int h = 0; h < heads_here; ++h) {
            sum += dscores[h * kBlockEntries + i] * from_storage(q_st[h * q_stride + c]);
            if (c < p.v) sum += probs[h * kBlockEntries + i] * from_storage(do_st[h * v_stride + c]);
          }
          float* slot = contrib + static_cast<int64_t>(block0 + i) * p.qk + c;
          *slot = h_begin == 0 ? sum : *slot + sum;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxBackwardHeads; ++h) {
      if (h >= heads_here) break;
#pragma unroll
      for (int j = 0; j < kQkCols; ++j) {
        const int c = threadIdx.x + j * kThreads;
        if (c < p.qk) store_value(p.dq, p.dq_bf16, (row0 + h) * p.qk + c, dq[h][j]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 2: the inverse index and the per-key sums

// Sort input: each flat position's key (entries outside [0, t + key_offset]: `keys_total`, the kv
// rows, sorted last and unused).
__global__ void inverse_index_input_kernel(const int32_t* __restrict__ index, int64_t entries, int top_k,
                                           int key_offset, int keys_total, uint32_t* __restrict__ keys,
                                           int32_t* __restrict__ positions) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < entries;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(e / top_k);
    const int s = index[e];
    keys[e] = static_cast<uint32_t>(s >= 0 && s <= t + key_offset ? s : keys_total);
    positions[e] = static_cast<int32_t>(e);
  }
}

// offsets[s] = the first sorted entry with key >= s, for s in [0, tokens] (tokens: the kv rows;
// offsets[tokens]: the end of the valid entries). Entry j fills the keys after its predecessor's up to its own.
__global__ void inverse_index_offsets_kernel(const uint32_t* __restrict__ sorted_keys, int64_t entries, int tokens,
                                             int32_t* __restrict__ offsets) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j <= entries;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int key = j < entries ? static_cast<int>(sorted_keys[j]) : tokens;
    const int previous = j > 0 ? static_cast<int>(sorted_keys[j - 1]) : -1;
    for (int s = previous + 1; s <= min(key, tokens); ++s) offsets[s] = static_cast<int32_t>(j);
  }
}

// First position in sorted[lo, hi) that is >= value (sorted ascending).
__device__ __forceinline__ int lower_bound(const int32_t* sorted, int lo, int hi, int64_t value) {
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (sorted[mid] < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// dkv_acc[s] += the contributions of this chunk's entries [position_begin, position_end) that
// selected s, in ascending position. One CTA per key.
__global__ void __launch_bounds__(kThreads)
    sparse_attention_backward_key_kernel(const int32_t* __restrict__ sorted_positions,
                                         const int32_t* __restrict__ offsets, const float* __restrict__ contrib,
                                         int64_t position_begin, int64_t position_end, int qk,
                                         float* __restrict__ dkv_acc) {
  const int s = blockIdx.x;
  const int lo = offsets[s], hi = offsets[s + 1];
  const int first = lower_bound(sorted_positions, lo, hi, position_begin);
  const int last = lower_bound(sorted_positions, first, hi, position_end);
  if (first == last) return;
  for (int c = threadIdx.x; c < qk; c += blockDim.x) {
    float sum = dkv_acc[static_cast<int64_t>(s) * qk + c];
    for (int e = first; e < last; ++e) sum += contrib[(sorted_positions[e] - position_begin) * qk + c];
    dkv_acc[static_cast<int64_t>(s) * qk + c] = sum;
  }
}

__global__ void f32_to_bf16_kernel(bf16* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

unsigned int grid_blocks(int64_t work) {
  return static_cast<unsigned int>(std::min<int64_t>(std::max<int64_t>((work + kThreads - 1) / kThreads, 1), 65536));
}

int smem_optin() {
  int device = 0, bytes = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// The largest head group (up to `max_heads`) whose shared memory fits.
template <typename Bytes>
int fit_group(int heads, int max_heads, Bytes bytes_for) {
  const size_t limit = static_cast<size_t>(smem_optin());
  int group = std::min(heads, max_heads);
  while (group > 1 && bytes_for(group) > limit) --group;
  if (bytes_for(group) > limit)
    throw Error(ExitCode::kInternal, "sparse attention: head dims too large for shared memory (" +
                                         std::to_string(bytes_for(group)) + " bytes for one head)");
  return group;
}

template <typename S, int kQkCols>
void launch_backward_queries(const BackwardParams& p, int rows, cudaStream_t stream) {
  const size_t smem = backward_smem_bytes<S>(p.group_heads, p.qk, p.v);
  auto kernel = sparse_attention_backward_query_kernel<S, kQkCols>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<rows, kThreads, smem, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

template <typename S>
void launch_backward_queries_cols(const BackwardParams& p, int rows, cudaStream_t stream) {
  const int cols = (p.qk + kThreads - 1) / kThreads;
  if (cols == 1) {
    launch_backward_queries<S, 1>(p, rows, stream);
  } else if (cols == 2) {
    launch_backward_queries<S, 2>(p, rows, stream);
  } else if (cols == 3) {
    launch_backward_queries<S, 3>(p, rows, stream);
  } else {
    launch_backward_queries<S, 4>(p, rows, stream);
  }
}

}  // namespace

void sparse_attention_forward(const SparseAttentionArgs& args, cudaStream_t stream) {
  if (sparse_attention_forward_sm90_supported(args)) {
    sparse_attention_forward_sm90(args, stream);
    return;
  }
  ForwardParams p;
  p.tokens = static_cast<int>(args.q.size(0));
  p.heads = static_cast<int>(args.q.size(1));
  p.qk = static_cast<int>(args.q.size(2));
  p.v = static_cast<int>(args.out.size(2));
  p.top_k = static_cast<int>(args.topk_index.size(1));
  p.key_offset = static_cast<int>(args.key_offset);
  if (p.tokens == 0 || p.heads == 0) return;
  p.q = args.q.data;
  p.kv = args.kv.data;
  p.q_bf16 = args.q.dtype == DType::kBF16;
  p.kv_bf16 = args.kv.dtype == DType::kBF16;
  p.index = static_cast<const int32_t*>(args.topk_index.data);
  p.out = args.out.data;
  p.out_bf16 = args.out.dtype == DType::kBF16;
  p.lse = static_cast<float*>(args.lse.data);
  p.scale = static_cast<float>(args.scale);
  const bool bf16_rows = p.q_bf16 && p.kv_bf16;
  const bool narrow = p.v <= kThreads;
  ForwardParams params = p;
  auto launch = [&](auto kernel, size_t smem) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const dim3 grid(static_cast<unsigned int>(params.tokens),
                    static_cast<unsigned int>((params.heads + params.group_heads - 1) / params.group_heads));
    kernel<<<grid, kThreads, smem, stream>>>(params);
    CUDA_CHECK_LAUNCH();
  };
  if (bf16_rows) {
    params.group_heads = fit_group(p.heads, kMaxForwardHeads, [&](int g) { return forward_smem_bytes<bf16>(g, p.qk); });
    const size_t smem = forward_smem_bytes<bf16>(params.group_heads, p.qk);
    if (narrow) {
      launch(sparse_attention_forward_kernel<bf16, 1>, smem);
    } else {
      launch(sparse_attention_forward_kernel<bf16, 2>, smem);
    }
  } else {
    params.group_heads = fit_group(p.heads, kMaxForwardHeads, [&](int g) { return forward_smem_bytes<float>(g, p.qk); });
    const size_t smem = forward_smem_bytes<float>(params.group_heads, p.qk);
    if (narrow) {
      launch(sparse_attention_forward_kernel<float, 1>, smem);
    } else {
      launch(sparse_attention_forward_kernel<float, 2>, smem);
    }
  }
}

void sparse_attention_backward(const SparseAttentionBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream,
                               int64_t chunk_rows) {
  BackwardParams p;
  p.tokens = static_cast<int>(args.q.size(0));
  p.heads = static_cast<int>(args.q.size(1));
  p.qk = static_cast<int>(args.q.size(2));
  p.v = static_cast<int>(args.out.size(2));
  p.top_k = static_cast<int>(args.topk_index.size(1));
  p.key_offset = static_cast<int>(args.key_offset);
  const int64_t tokens = p.tokens, top_k = p.top_k, qk = p.qk;
  const int64_t keys = args.kv.size(0);  // key_offset + tokens
  if (tokens == 0) {
    if (keys > 0) CUDA_CHECK(cudaMemsetAsync(args.dkv.data, 0, args.dkv.nbytes(), stream));  // no query reads kv
    return;
  }
  const int64_t entries = tokens * top_k;
  p.q = args.q.data;
  p.kv = args.kv.data;
  p.dout = args.dout.data;
  p.out = args.out.data;
  p.q_bf16 = args.q.dtype == DType::kBF16;
  p.kv_bf16 = args.kv.dtype == DType::kBF16;
  p.dout_bf16 = args.dout.dtype == DType::kBF16;
  p.out_bf16 = args.out.dtype == DType::kBF16;
  p.lse = static_cast<const float*>(args.lse.data);
  p.index = static_cast<const int32_t*>(args.topk_index.data);
  p.dq = args.dq.data;
  p.dq_bf16 = args.dq.dtype == DType::kBF16;
  p.scale = static_cast<float>(args.scale);
  const bool dkv_f32 = args.dkv.dtype == DType::kF32;

  const bool tensor_cores = sparse_attention_backward_sm90_supported(args);
  if (chunk_rows <= 0) {
    const int64_t budget = tensor_cores ? kTensorCoreContribBudgetBytes : kContribBudgetBytes;
    chunk_rows = std::max<int64_t>(1, budget / (top_k * qk * int64_t{4}));
    if (tensor_cores) {
      const int64_t sms = ::moetrain::cuda::multiprocessor_count();
      if (chunk_rows > sms) chunk_rows = chunk_rows / sms * sms;
    }
  }
  chunk_rows = std::min(chunk_rows, tokens);

  // The stable radix sort's temporary storage, then everything carved from one scratch block.
  int end_bit = 1;
  while ((int64_t{1} << end_bit) <= keys) ++end_bit;
  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(entries), 0, end_bit,
                                             stream));
  const size_t index_bytes = DeviceScratch::round_up(static_cast<size_t>(entries) * sizeof(int32_t));
  const size_t offsets_bytes = DeviceScratch::round_up(static_cast<size_t>(keys + 1) * sizeof(int32_t));
  const size_t acc_bytes = dkv_f32 ? 0 : DeviceScratch::round_up(static_cast<size_t>(keys * qk) * sizeof(float));
  const size_t contrib_bytes = DeviceScratch::round_up(static_cast<size_t>(chunk_rows * top_k * qk) * sizeof(float));
  sort_bytes = DeviceScratch::round_up(std::max<size_t>(sort_bytes, 1));
  char* base = static_cast<char*>(scratch.reserve(4 * index_bytes + offsets_bytes + acc_bytes + contrib_bytes + sort_bytes));
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + index_bytes);
  auto* positions_in = reinterpret_cast<int32_t*>(base + 2 * index_bytes);
  auto* positions_out = reinterpret_cast<int32_t*>(base + 3 * index_bytes);
  auto* offsets = reinterpret_cast<int32_t*>(base + 4 * index_bytes);
  float* dkv_acc = dkv_f32 ? static_cast<float*>(args.dkv.data)
                           : reinterpret_cast<float*>(base + 4 * index_bytes + offsets_bytes);
  p.contrib = reinterpret_cast<float*>(base + 4 * index_bytes + offsets_bytes + acc_bytes);
  void* sort_storage = base + 4 * index_bytes + offsets_bytes + acc_bytes + contrib_bytes;

  inverse_index_input_kernel<<<grid_blocks(entries), kThreads, 0, stream>>>(
      p.index, entries, p.top_k, p.key_offset, static_cast<int>(keys), keys_in, positions_in);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys_in, keys_out, positions_in, positions_out,
                                             static_cast<int>(entries), 0, end_bit, stream));
  inverse_index_offsets_kernel<<<grid_blocks(entries + 1), kThreads, 0, stream>>>(keys_out, entries,
                                                                                  static_cast<int>(keys), offsets);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemsetAsync(dkv_acc, 0, static_cast<size_t>(keys * qk) * sizeof(float), stream));

  const bool bf16_rows = p.q_bf16 && p.kv_bf16 && p.dout_bf16;
  p.group_heads = p.heads == 0 || tensor_cores ? 1
                  : bf16_rows ? fit_group(p.heads, kMaxBackwardHeads,
                                        [&](int g) { return backward_smem_bytes<bf16>(g, p.qk, p.v); })
                            : fit_group(p.heads, kMaxBackwardHeads,
                                        [&](int g) { return backward_smem_bytes<float>(g, p.qk, p.v); });
  // Without heads nothing flows back: dkv stays zero.
  for (int64_t begin = 0; begin < tokens && p.heads > 0; begin += chunk_rows) {
    const int64_t end = std::min(tokens, begin + chunk_rows);
    p.chunk_begin = static_cast<int>(begin);
    if (tensor_cores) {
      sparse_attention_backward_sm90_queries(args, p.contrib, begin, end - begin, stream);
    } else if (bf16_rows) {
      launch_backward_queries_cols<bf16>(p, static_cast<int>(end - begin), stream);
    } else {
      launch_backward_queries_cols<float>(p, static_cast<int>(end - begin), stream);
    }
    // Only keys < end + key_offset can have been selected by this chunk's queries.
    sparse_attention_backward_key_kernel<<<static_cast<unsigned int>(end + p.key_offset), kThreads, 0, stream>>>(
        positions_out, offsets, p.contrib, begin * top_k, end * top_k, p.qk, dkv_acc);
    CUDA_CHECK_LAUNCH();
  }
  if (!dkv_f32) {
    f32_to_bf16_kernel<<<grid_blocks(keys * qk), kThreads, 0, stream>>>(static_cast<bf16*>(args.dkv.data), dkv_acc,
                                                                         keys * qk);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moetrain::kernels::cuda_ops
