// RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// Backward: dx (=|+=) rstd * w * dy - (sum_j dy_j w_j x_j) * rstd^3 / dim * x,
//           dweight = sum_rows dy * x * rstd (overwritten).
//
// The row kernels take dim a multiple of 8, 16-byte aligned operands and the row operands (x, y;
// or dy, x, dx) of one dtype. A row is spread over `row_threads` threads; each keeps its chunks
// (8 elements, coalesced across the row's threads) as the raw 16-byte vectors it loaded: half the
// registers of F32 copies for BF16, so more rows are in flight per multiprocessor, which is what
// bounds a kernel that moves each byte once. Every load of a row is issued before its sum is
// reduced (warp shuffles, then shared memory when a row spans warps); the outputs are packed into
// the same registers and stored last. Each byte is read from device memory once: the row loads
// skip L1 (L1::no_allocate) so that the weight, read from L1 for every row, stays there.
// A thread writes only the chunks it read, after the row's reduction (which waits for every
// thread's loads), so y/dx aliasing x/dy is safe.
// The weight gradient is fused into the backward row kernel: each block sums dy * x * rstd per
// column over a fixed range of rows in registers (a thread owns the same columns on every row),
// combines its row groups in order through shared memory and writes one partial row; a second
// kernel adds the partial rows in a fixed tree. Deterministic, no atomics, dy and x read once.
// Other shapes (odd widths, mixed dtypes, rows too long for the registers) take the two-pass
// kernels: one block per row, the row read twice, and a separate partial kernel for dweight.
#include "kernels/cuda/norm/rmsnorm.h"

#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/common/raw_chunk.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

constexpr int kBlock = 256;  // threads per block of the row kernels; also the most per row
constexpr int kWarps = kBlock / 32;

// Sum over a row group's threads, every one of them getting the same total (xor butterflies add
// the same pairs on every lane; the warps' sums are added in warp order). row_threads is a power
// of two up to 32 (a segment of a warp) or a multiple of 32 up to the block. Across warps the
// sums go through slots[parity]; callers alternate parity, so one barrier per call suffices (a
// slot is rewritten only after the next call's barrier, which each thread reaches after reading
// it). Every thread of the block must call it.
__device__ __forceinline__ float group_sum(float value, int row_threads, float (*slots)[kWarps], int parity) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < row_threads) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (row_threads <= 32) return value;
  const int warp = static_cast<int>(threadIdx.x) >> 5, warps = row_threads >> 5;
  if ((threadIdx.x & 31) == 0) slots[parity][warp] = value;
  __syncthreads();
  const int first = warp / warps * warps;
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += slots[parity][first + w];
  return total;
}

// Where a thread works. A row takes `row_threads` threads: one segment of kSeg (4, 8 or 16) lanes
// for a short row, else whole warps. Segment i of a row owns chunks [i * kSeg * kPer, (i + 1) *
// kSeg * kPer); its lane l owns chunks l, l + kSeg, ... of those (coalesced, and a compile-time
// stride: one base address per thread, the rest immediate offsets). The block's `groups` row
// groups take rows begin + group, then + groups, ... up to `end`; every thread runs the same
// number of steps, so the collectives line up.
template <int kSeg, int kPer>
struct RowWalk {
  int64_t begin, end;
  int group, groups, first_chunk;
  __device__ __forceinline__ RowWalk(int64_t rows, int row_threads, int64_t rows_per_block) {
    begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
    end = min(rows, begin + rows_per_block);
    const int t = static_cast<int>(threadIdx.x);
    group = t / row_threads;
    groups = static_cast<int>(blockDim.x) / row_threads;
    const int lane = t % row_threads;
    first_chunk = lane / kSeg * kSeg * kPer + lane % kSeg;
  }
  __device__ __forceinline__ int chunk(int k) const { return first_chunk + k * kSeg; }
};

template <bool kBf16, int kSeg, int kPer>
__global__ void __launch_bounds__(kBlock)
    rmsnorm_forward_rows_kernel(void* __restrict__ y, float* __restrict__ rstd, const void* x, ConstOperand weight,
                                int64_t rows, int dim, int row_threads, int64_t rows_per_block, float eps) {
  __shared__ float slots[2][kWarps];
  const RowWalk<kSeg, kPer> walk(rows, row_threads, rows_per_block);
  const int chunks = dim / 8;
  int parity = 0;
  for (int64_t first = walk.begin; first < walk.end; first += walk.groups, parity ^= 1) {
    const int64_t row = first + walk.group;
    const bool valid = row < walk.end;
    const int64_t base = row * dim;
    RawChunk<kBf16> c[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (valid && walk.chunk(k) < chunks) {
        load_raw(c[k], x, base + walk.chunk(k) * 8);
      } else {
        zero_raw(c[k]);
      }
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      float f[8];
      unpack(c[k], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum_sq += f[e] * f[e];
    }
    const float total = group_sum(sum_sq, row_threads, slots, parity);
    const float s = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
    if (!valid) continue;  // after the collective
    if (walk.first_chunk == 0) rstd[row] = s;
    // Outputs into the same registers first, stores last: the weight loads (L1) between them
    // would otherwise wait one by one behind the stores.
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (walk.chunk(k) >= chunks) break;
      float f[8], w[8];
      unpack(c[k], f);
      load_chunk<8>(w, weight, walk.chunk(k) * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = f[e] * s * w[e];
      pack(c[k], f);
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (walk.chunk(k) >= chunks) break;
      store_raw(y, base + walk.chunk(k) * 8, c[k]);
    }
  }
}

// dx for rows of the block; kDweight: also this block's partial dweight row (dynamic shared
// memory: dim floats). kAccumulate: dx +=.
template <bool kBf16, int kSeg, int kPer, bool kAccumulate, bool kDweight>
__global__ void __launch_bounds__(kBlock)
    rmsnorm_backward_rows_kernel(void* dx, const void* dy, const void* x, ConstOperand weight,
                                 const float* __restrict__ rstd, float* __restrict__ partial, int64_t rows, int dim,
                                 int row_threads, int64_t rows_per_block) {
  __shared__ float slots[2][kWarps];
  const RowWalk<kSeg, kPer> walk(rows, row_threads, rows_per_block);
  const int chunks = dim / 8;
  float dw[kDweight ? kPer : 1][8];
#pragma unroll
  for (int k = 0; k < (kDweight ? kPer : 1); ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) dw[k][e] = 0.0f;
  int parity = 0;
  for (int64_t first = walk.begin; first < walk.end; first += walk.groups, parity ^= 1) {
    const int64_t row = first + walk.group;
    const bool valid = row < walk.end;
    const int64_t base = row * dim;
    RawChunk<kBf16> g[kPer], v[kPer], a[kAccumulate ? kPer : 1];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (valid && walk.chunk(k) < chunks) {
        load_raw(g[k], dy, base + walk.chunk(k) * 8);
        load_raw(v[k], x, base + walk.chunk(k) * 8);
        if constexpr (kAccumulate) load_raw(a[k], dx, base + walk.chunk(k) * 8);
      } else {
        zero_raw(g[k]);
        zero_raw(v[k]);
        if constexpr (kAccumulate) zero_raw(a[k]);
      }
    }
    const float s = valid ? rstd[row] : 0.0f;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (walk.chunk(k) >= chunks) break;  // the same for every row
      float fg[8], fv[8], w[8];
      unpack(g[k], fg);
      unpack(v[k], fv);
      load_chunk<8>(w, weight, walk.chunk(k) * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dot += fg[e] * w[e] * fv[e];
        if constexpr (kDweight) dw[k][e] += fg[e] * fv[e] * s;  // zero on rows past the end
      }
    }
    const float total = group_sum(dot, row_threads, slots, parity);
    if (!valid) continue;  // after the collective
    const float coef = total * s * s * s / static_cast<float>(dim);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (walk.chunk(k) >= chunks) break;
      float fg[8], fv[8], w[8], out[8];
      unpack(g[k], fg);
      unpack(v[k], fv);
      load_chunk<8>(w, weight, walk.chunk(k) * 8);
      if constexpr (kAccumulate) {
        unpack(a[k], out);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] += s * w[e] * fg[e] - coef * fv[e];
      pack(g[k], out);
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (walk.chunk(k) >= chunks) break;
      store_raw(dx, base + walk.chunk(k) * 8, g[k]);
    }
  }
  if constexpr (kDweight) {
    // The row groups' sums in group order, then the block's partial row.
    extern __shared__ float combined[];  // [dim]
    for (int turn = 0; turn < walk.groups; ++turn) {
      if (walk.group == turn) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          if (walk.chunk(k) >= chunks) break;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float& slot = combined[walk.chunk(k) * 8 + e];
            slot = turn == 0 ? dw[k][e] : slot + dw[k][e];
          }
        }
      }
      __syncthreads();
    }
    float* out = partial + static_cast<int64_t>(blockIdx.x) * dim;
    for (int j = static_cast<int>(threadIdx.x); j < dim; j += static_cast<int>(blockDim.x)) out[j] = combined[j];
  }
}

// How rows are spread over threads for the row kernels. per_thread == 0: no plan (the row needs
// more than kBlock threads); use the two-pass kernels.
struct RowPlan {
  int seg = 0;          // 4, 8, 16 (one segment per row, per_thread 1) or 32 (whole warps)
  int per_thread = 0;   // chunks per thread: 1, 2, 4, 8 or 16
  int row_threads = 0;  // seg, or a multiple of 32 up to kBlock
  int block = 0;        // threads per block: a multiple of row_threads
  int64_t groups = 0;   // rows a block works on at once: block / row_threads
};

int64_t pow2_ceil(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// max_per_thread (a power of two) bounds the registers a thread's row data takes. A row of up to
// 32 chunks takes one segment of lanes (at least 4: 64-byte contiguous pieces), a longer one
// warps of up to max_per_thread chunks per lane.
RowPlan plan_rows(int64_t chunks, int max_per_thread) {
  RowPlan plan;
  if (chunks <= 32) {
    plan.seg = static_cast<int>(pow2_ceil(chunks) < 4 ? 4 : pow2_ceil(chunks));
    plan.per_thread = 1;
    plan.row_threads = plan.seg;
  } else {
    int64_t per = pow2_ceil((chunks + 31) / 32);
    if (per > max_per_thread) per = max_per_thread;
    const int64_t warps = (chunks + 32 * per - 1) / (32 * per);
    if (32 * warps > kBlock) return plan;
    plan.seg = 32;
    plan.per_thread = static_cast<int>(per);
    plan.row_threads = static_cast<int>(32 * warps);
  }
  plan.groups = kBlock / plan.row_threads;
  plan.block = static_cast<int>(plan.groups) * plan.row_threads;
  return plan;
}

// Chunks per thread for one row operand: 16 forward for BF16 (64 registers), 4 backward, where
// two or three operands are held (and dweight's sums); half that for F32.
int forward_max_per_thread(bool bf16) { return bf16 ? 16 : 8; }
int backward_max_per_thread(bool bf16) { return bf16 ? 4 : 2; }

// Calls f(seg, per) as std::integral_constants for the plan's (seg, per_thread): (4|8|16, 1) or
// (32, 1|2|4|8|16 up to kMax). False when the plan has no such pair.
template <int kMax, typename F>
bool with_shape(const RowPlan& plan, F&& f) {
  using std::integral_constant;
  if (plan.per_thread == 1) {
    switch (plan.seg) {
      case 4:
        f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
        return true;
      case 8:
        f(integral_constant<int, 8>{}, integral_constant<int, 1>{});
        return true;
      case 16:
        f(integral_constant<int, 16>{}, integral_constant<int, 1>{});
        return true;
      case 32:
        f(integral_constant<int, 32>{}, integral_constant<int, 1>{});
        return true;
      default:
        return false;
    }
  }
  if (plan.seg != 32) return false;
  switch (plan.per_thread) {
    case 2:
      f(integral_constant<int, 32>{}, integral_constant<int, 2>{});
      return true;
    case 4:
      if constexpr (kMax >= 4) {
        f(integral_constant<int, 32>{}, integral_constant<int, 4>{});
        return true;
      }
      return false;
    case 8:
      if constexpr (kMax >= 8) {
        f(integral_constant<int, 32>{}, integral_constant<int, 8>{});
        return true;
      }
      return false;
    case 16:
      if constexpr (kMax >= 16) {
        f(integral_constant<int, 32>{}, integral_constant<int, 16>{});
        return true;
      }
      return false;
    default:
      return false;
  }
}

unsigned int blocks_for(int64_t rows, int64_t rows_per_block) {
  return static_cast<unsigned int>((rows + rows_per_block - 1) / rows_per_block);
}

template <bool kBf16>
bool launch_forward_rows(void* y, float* rstd, const void* x, ConstOperand w, int64_t rows, int dim, float eps,
                         const RowPlan& plan, cudaStream_t stream) {
  return with_shape<kBf16 ? 16 : 8>(plan, [&](auto seg, auto per) {
    rmsnorm_forward_rows_kernel<kBf16, decltype(seg)::value, decltype(per)::value>
        <<<blocks_for(rows, plan.groups), plan.block, 0, stream>>>(y, rstd, x, w, rows, dim, plan.row_threads,
                                                                   plan.groups, eps);
  });
}

// The dweight partial rows: at most kMaxParts, each of a whole number of the plan's row groups;
// the split depends on rows and the plan only, so the sums' order is reproducible.
constexpr int64_t kMaxParts = 512;
int64_t dweight_rows_per_block(int64_t rows, const RowPlan& plan) {
  const int64_t at_least = (rows + kMaxParts - 1) / kMaxParts;
  return (at_least + plan.groups - 1) / plan.groups * plan.groups;
}

// Backward row kernel; partial != nullptr: with the dweight partial rows (rows_per_block from
// dweight_rows_per_block).
template <bool kBf16, int kMax = kBf16 ? 4 : 2>
bool launch_backward_rows(void* dx, const void* dy, const void* x, ConstOperand w, const float* rstd, float* partial,
                          int64_t rows, int dim, bool accumulate, const RowPlan& plan, int64_t rows_per_block,
                          cudaStream_t stream) {
  const unsigned int blocks = blocks_for(rows, rows_per_block);
  return with_shape<kMax>(plan, [&](auto seg, auto per) {
    constexpr int kSeg = decltype(seg)::value, kPer = decltype(per)::value;
    if (partial != nullptr) {
      const size_t shared = sizeof(float) * static_cast<size_t>(dim);
      auto kernel = accumulate ? rmsnorm_backward_rows_kernel<kBf16, kSeg, kPer, true, true>
                               : rmsnorm_backward_rows_kernel<kBf16, kSeg, kPer, false, true>;
      kernel<<<blocks, plan.block, shared, stream>>>(dx, dy, x, w, rstd, partial, rows, dim, plan.row_threads,
                                                     rows_per_block);
    } else {
      auto kernel = accumulate ? rmsnorm_backward_rows_kernel<kBf16, kSeg, kPer, true, false>
                               : rmsnorm_backward_rows_kernel<kBf16, kSeg, kPer, false, false>;
      kernel<<<blocks, plan.block, 0, stream>>>(dx, dy, x, w, rstd, nullptr, rows, dim, plan.row_threads,
                                                rows_per_block);
    }
  });
}

// The two-pass kernels, for the other shapes: one block per row, a sum pass, then the output
// pass (the block barrier in between makes y/dx aliasing x/dy safe).
template <int kChunk>
__global__ void rmsnorm_forward_kernel(MutOperand y, float* __restrict__ rstd, ConstOperand x, ConstOperand weight,
                                       int64_t dim, float eps) {
  __shared__ float reduce[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t chunks = dim / kChunk;
  float sum_sq = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk];
    load_chunk<kChunk>(v, x, base + c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) sum_sq += v[e] * v[e];
  }
  const float total = block_sum(sum_sq, reduce);
  const float s = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = s;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk], w[kChunk];
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = v[e] * s * w[e];
    store_chunk<kChunk>(y, base + c * kChunk, v);
  }
}

template <int kChunk>
__global__ void rmsnorm_backward_dx_kernel(MutOperand dx, ConstOperand dy, ConstOperand x, ConstOperand weight,
                                           const float* __restrict__ rstd, int64_t dim, bool accumulate) {
  __shared__ float reduce[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t chunks = dim / kChunk;
  const float s = rstd[blockIdx.x];
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float g[kChunk], v[kChunk], w[kChunk];
    load_chunk<kChunk>(g, dy, base + c * kChunk);
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) dot += g[e] * w[e] * v[e];
  }
  const float coef = block_sum(dot, reduce) * s * s * s / static_cast<float>(dim);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float g[kChunk], v[kChunk], w[kChunk], out[kChunk];
    load_chunk<kChunk>(g, dy, base + c * kChunk);
    load_chunk<kChunk>(v, x, base + c * kChunk);
    load_chunk<kChunk>(w, weight, c * kChunk);
    if (accumulate) {
      load_chunk<kChunk>(out, dx, base + c * kChunk);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) out[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kChunk; ++e) out[e] += s * w[e] * g[e] - coef * v[e];
    store_chunk<kChunk>(dx, base + c * kChunk, out);
  }
}

// The two-pass path's dweight partial rows: partial[part, j] = sum over rows [part *
// rows_per_part, ...) of dy * x * rstd. One thread per column: row reads are coalesced.
__global__ void rmsnorm_dweight_partial_kernel(float* __restrict__ partial, ConstOperand dy, ConstOperand x,
                                               const float* __restrict__ rstd, int64_t rows, int64_t dim,
                                               int64_t rows_per_part) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t row_end = min(rows, row_begin + rows_per_part);
  float acc = 0.0f;
  for (int64_t r = row_begin; r < row_end; ++r) acc += load_one(dy, r * dim + j) * load_one(x, r * dim + j) * rstd[r];
  partial[static_cast<int64_t>(blockIdx.y) * dim + j] = acc;
}

// dweight[j] = the sum of partial[p, j] over the parts p, in a fixed tree: thread (tx, ty) of a
// 32 x 32 block adds parts ty, ty + 32, ... of column blockIdx.x * 32 + tx, then the 32 sums are
// added in ty order. (A thread per column alone would leave the device nearly idle: few columns,
// each a long chain of loads.)
constexpr int kTotalSide = 32;
__global__ void __launch_bounds__(kTotalSide* kTotalSide)
    rmsnorm_dweight_total_kernel(float* __restrict__ dweight, const float* __restrict__ partial, int64_t parts,
                                 int64_t dim) {
  __shared__ float sums[kTotalSide][kTotalSide + 1];
  const int tx = static_cast<int>(threadIdx.x) % kTotalSide, ty = static_cast<int>(threadIdx.x) / kTotalSide;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTotalSide + tx;
  float acc = 0.0f;
  if (j < dim) {
#pragma unroll 4
    for (int64_t p = ty; p < parts; p += kTotalSide) acc += partial[p * dim + j];
  }
  sums[ty][tx] = acc;
  __syncthreads();
  if (ty != 0 || j >= dim) return;
  float total = 0.0f;
  for (int r = 0; r < kTotalSide; ++r) total += sums[r][tx];
  dweight[j] = total;
}

// Two-pass kernels, threads per row block: enough for the row's chunks, a multiple of 32, at most 512.
int two_pass_threads(int64_t chunks) {
  int64_t threads = (chunks + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  if (threads > 512) threads = 512;
  return static_cast<int>(threads);
}

}  // namespace

void rmsnorm_forward(const RmsNormArgs& args, cudaStream_t stream) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = dim == 0 ? 0 : args.x.numel() / dim;
  if (rows == 0) return;
  const MutOperand y{args.y.data, kind_of(args.y.dtype)};
  const ConstOperand x{args.x.data, kind_of(args.x.dtype)}, w{args.weight.data, kind_of(args.weight.dtype)};
  auto* rstd = static_cast<float*>(args.rstd.data);
  const float eps = static_cast<float>(args.eps);
  const bool vector = dim % 8 == 0 && aligned16(y.data) && aligned16(x.data) && aligned16(w.data);
  const bool bf16 = x.kind == ElemKind::kBF16;
  const RowPlan plan = plan_rows(dim / 8, forward_max_per_thread(bf16));
  if (vector && y.kind == x.kind && plan.per_thread > 0) {
    const bool launched =
        bf16 ? launch_forward_rows<true>(y.data, rstd, x.data, w, rows, static_cast<int>(dim), eps, plan, stream)
             : launch_forward_rows<false>(y.data, rstd, x.data, w, rows, static_cast<int>(dim), eps, plan, stream);
    CUDA_CHECK_LAUNCH();
    if (!launched) throw Error(ExitCode::kInternal, "rmsnorm_forward: no row kernel for the plan");
    return;
  }
  if (vector) {
    rmsnorm_forward_kernel<8><<<static_cast<unsigned int>(rows), two_pass_threads(dim / 8), 0, stream>>>(y, rstd, x, w,
                                                                                                         dim, eps);
  } else {
    rmsnorm_forward_kernel<1><<<static_cast<unsigned int>(rows), two_pass_threads(dim), 0, stream>>>(y, rstd, x, w, dim,
                                                                                                     eps);
  }
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(const RmsNormBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = dim == 0 ? 0 : args.x.numel() / dim;
  const MutOperand dx{args.dx.data, kind_of(args.dx.dtype)};
  const ConstOperand dy{args.dy.data, kind_of(args.dy.dtype)}, x{args.x.data, kind_of(args.x.dtype)},
      w{args.weight.data, kind_of(args.weight.dtype)};
  const auto* rstd = static_cast<const float*>(args.rstd.data);
  auto* dweight = static_cast<float*>(args.dweight.data);
  if (dim == 0) return;
  if (rows == 0) {
    if (dweight != nullptr) CUDA_CHECK(cudaMemsetAsync(dweight, 0, sizeof(float) * dim, stream));
    return;
  }
  const bool vector =
      dim % 8 == 0 && aligned16(dx.data) && aligned16(dy.data) && aligned16(x.data) && aligned16(w.data);
  const bool bf16 = x.kind == ElemKind::kBF16;
  const RowPlan plan = plan_rows(dim / 8, backward_max_per_thread(bf16));
  const bool rows_kernel = vector && dy.kind == x.kind && dx.kind == x.kind && plan.per_thread > 0;
  // dweight: partial rows, then their fixed-order total.
  int64_t parts = 0, rows_per_part = 0;
  float* partial = nullptr;
  if (dweight != nullptr) {
    rows_per_part = rows_kernel ? dweight_rows_per_block(rows, plan) : (rows + kMaxParts - 1) / kMaxParts;
    parts = (rows + rows_per_part - 1) / rows_per_part;
    partial = static_cast<float*>(scratch.reserve(sizeof(float) * static_cast<size_t>(parts * dim)));
  }
  if (rows_kernel) {
    const int64_t rows_per_block = partial != nullptr ? rows_per_part : plan.groups;
    const bool launched =
        bf16 ? launch_backward_rows<true>(dx.data, dy.data, x.data, w, rstd, partial, rows, static_cast<int>(dim), args.accumulate, plan,
                                          rows_per_block, stream)
             : launch_backward_rows<false>(dx.data, dy.data, x.data, w, rstd, partial, rows, static_cast<int>(dim), args.accumulate, plan,
                                           rows_per_block, stream);
    CUDA_CHECK_LAUNCH();
    if (!launched) throw Error(ExitCode::kInternal, "rmsnorm_backward: no row kernel for the plan");
  } else {
    if (vector) {
      rmsnorm_backward_dx_kernel<8><<<static_cast<unsigned int>(rows), two_pass_threads(dim / 8), 0, stream>>>(
          dx, dy, x, w, rstd, dim, args.accumulate);
    } else {
      rmsnorm_backward_dx_kernel<1><<<static_cast<unsigned int>(rows), two_pass_threads(dim), 0, stream>>>(
          dx, dy, x, w, rstd, dim, args.accumulate);
    }
    CUDA_CHECK_LAUNCH();
    if (partial != nullptr) {
      const int threads = 256;
      const unsigned int column_blocks = static_cast<unsigned int>((dim + threads - 1) / threads);
      rmsnorm_dweight_partial_kernel<<<dim3(column_blocks, static_cast<unsigned int>(parts)), threads, 0, stream>>>(
          partial, dy, x, rstd, rows, dim, rows_per_part);
      CUDA_CHECK_LAUNCH();
    }
  }
  if (partial == nullptr) return;
  rmsnorm_dweight_total_kernel<<<static_cast<unsigned int>((dim + kTotalSide - 1) / kTotalSide),
                                 kTotalSide * kTotalSide, 0, stream>>>(dweight, partial, parts, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
