// Causal depthwise short convolution within segments (KDA's q/k/v conv; kernels/ops.h,
// ShortConvArgs), with SiLU, forward and backward.
//
// A thread owns kChunk consecutive channels (8 with one 16-byte load per token when the rows allow
// it, else 1) and walks a tile of kTileTokens consecutive tokens (threads of a warp hold
// consecutive chunks, so every token's loads are coalesced), keeping the last kWindow inputs (and,
// backward, pre-activation gradients) in registers with the segment each came from. The tile's
// segment ids are looked up once per block into shared memory, not per thread and token. Loads run
// kPrefetch tokens ahead of the arithmetic (the compiler cannot hoist them past the stores, which
// may alias as far as it knows), so each warp keeps several loads in flight: the kernel is
// bandwidth-bound. Windows are aligned to their newest element, so loops are over the compile-time
// kWindow (4 for widths up to 4, Kimi's; else 8) with the taps past `width` zero. Backward, one walk
// gives dx (the gradient of token u needs dz of tokens u .. u + width - 1, so the walk runs
// kWindow - 1 tokens past the tile) and each tile's partial dweight; a second kernel adds the
// tiles' partials in order (deterministic).
#include "kernels/cuda/kda/short_conv.h"

#include <algorithm>
#include <initializer_list>

#include "kernels/cuda/attention/attention_segments.cuh"
#include "core/base/tensor.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kConvThreads = 64;
constexpr int kTileTokens = 64;
constexpr int kPrefetch = 4;

struct ConvShape {
  int64_t tokens;
  int64_t channels;
  int width;
  int segments;
  bool silu;
  int64_t first_tile = 0;  // the tile of blockIdx.y 0: launches cover at most kMaxTileRows tiles each
};

// gridDim.y's limit: longer inputs take several launches of up to this many tiles (4,194,240
// tokens) each.
constexpr int64_t kMaxTileRows = 65535;

__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + __expf(-z)); }

// Shared segment ids of tokens [first, first + count) (-1 outside [0, tokens)); the whole block
// must call it.
__device__ __forceinline__ void load_segments(int* seg, const int32_t* cu_seqlens, const ConvShape& s, int64_t first,
                                              int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t t = first + i;
    seg[i] = t < 0 || t >= s.tokens ? -1 : segment_index(cu_seqlens, s.segments, static_cast<int>(t));
  }
  __syncthreads();
}

// Taps in window order: tap[j][e] multiplies channel c0 + e's input j tokens back (weight column
// width - 1 - j).
template <int kWindow, int kChunk>
__device__ __forceinline__ void load_taps(float (&tap)[kWindow][kChunk], ConstOperand weight, int64_t c0,
                                          int width) {
#pragma unroll
  for (int j = 0; j < kWindow; ++j)
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      tap[j][e] = j < width ? load_one(weight, (c0 + e) * width + (width - 1 - j)) : 0.0f;
}

// Shifts a window left by one and puts (values, segment) at its newest slot.
template <int kWindow, int kChunk>
__device__ __forceinline__ void push(float (&value)[kWindow][kChunk], int (&seg)[kWindow], const float (&v)[kChunk],
                                     int s) {
#pragma unroll
  for (int j = 0; j + 1 < kWindow; ++j) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) value[j][e] = value[j + 1][e];
    seg[j] = seg[j + 1];
  }
#pragma unroll
  for (int e = 0; e < kChunk; ++e) value[kWindow - 1][e] = v[e];
  seg[kWindow - 1] = s;
}

// The pre-activations of the newest token of the x window (segment `s`).
template <int kWindow, int kChunk>
__device__ __forceinline__ void conv_newest(float (&z)[kChunk], const float (&x)[kWindow][kChunk],
                                            const int (&xs)[kWindow], const float (&tap)[kWindow][kChunk], int s) {
#pragma unroll
  for (int e = 0; e < kChunk; ++e) z[e] = 0.0f;
#pragma unroll
  for (int j = 0; j < kWindow; ++j) {
    const int slot = kWindow - 1 - j;
    if (xs[slot] == s)
#pragma unroll
      for (int e = 0; e < kChunk; ++e) z[e] = fmaf(tap[j][e], x[slot][e], z[e]);
  }
}

template <int kChunk>
__device__ __forceinline__ void load_or_zero(float (&v)[kChunk], ConstOperand src, int64_t i, bool valid) {
  if (valid) {
    load_chunk<kChunk>(v, src, i);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = 0.0f;
  }
}

template <int kWindow, int kChunk>
__global__ void __launch_bounds__(kConvThreads) short_conv_forward_kernel(MutOperand y, ConstOperand x,
                                                                          ConstOperand weight,
                                                                          const int32_t* cu_seqlens, ConvShape s) {
  constexpr int kHalo = kWindow - 1;
  __shared__ int seg_of[kTileTokens + kHalo];
  const int64_t t0 = (s.first_tile + blockIdx.y) * kTileTokens;
  const int64_t t1 = min(t0 + kTileTokens, s.tokens);
  const int64_t first = t0 - kHalo;  // seg_of[i] is token first + i
  load_segments(seg_of, cu_seqlens, s, first, static_cast<int>(t1 - first));
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x) * kChunk;
  if (c0 >= s.channels) return;
  float tap[kWindow][kChunk];
  load_taps(tap, weight, c0, s.width);
  float xw[kWindow][kChunk] = {};
  int xs[kWindow];
#pragma unroll
  for (int j = 0; j < kWindow; ++j) xs[j] = -1;
  for (int64_t tb = first; tb < t1; tb += kPrefetch) {
    float v[kPrefetch][kChunk];
    int vs[kPrefetch];
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      const int64_t t = tb + p;
      vs[p] = t < t1 ? seg_of[t - first] : -1;
      load_or_zero(v[p], x, t * s.channels + c0, vs[p] >= 0);
    }
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      const int64_t t = tb + p;
      if (t >= t1) break;
      push(xw, xs, v[p], vs[p]);
      if (t < t0) continue;
      float z[kChunk];
      conv_newest(z, xw, xs, tap, vs[p]);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) z[e] = s.silu ? z[e] * sigmoidf(z[e]) : z[e];
      store_chunk<kChunk>(y, t * s.channels + c0, z);
    }
  }
}

// dx for the tile; partial[tile][c][j] = sum over the tile's tokens t of dz[t] x[t - j] (same segment).
template <int kWindow, int kChunk>
__global__ void __launch_bounds__(kConvThreads) short_conv_backward_kernel(MutOperand dx, float* partial,
                                                                           ConstOperand dy, ConstOperand x,
                                                                           ConstOperand weight,
                                                                           const int32_t* cu_seqlens, ConvShape s) {
  constexpr int kHalo = kWindow - 1;
  __shared__ int seg_of[kTileTokens + 2 * kHalo];
  const int64_t t0 = (s.first_tile + blockIdx.y) * kTileTokens;
  const int64_t t1 = min(t0 + kTileTokens, s.tokens);
  // dz is needed from t0 to kHalo past the tile; x from kHalo before t0 (the window of t0's
  // pre-activation).
  const int64_t first = t0 - kHalo, last = t1 + kHalo;  // seg_of[i] is token first + i
  load_segments(seg_of, cu_seqlens, s, first, static_cast<int>(last - first));
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x) * kChunk;
  if (c0 >= s.channels) return;
  float tap[kWindow][kChunk];
  load_taps(tap, weight, c0, s.width);
  float xw[kWindow][kChunk] = {}, dzw[kWindow][kChunk] = {}, dw[kWindow][kChunk] = {};
  int xs[kWindow], dzs[kWindow];
#pragma unroll
  for (int j = 0; j < kWindow; ++j) xs[j] = dzs[j] = -1;
  for (int64_t tb = first; tb < last; tb += kPrefetch) {
    float xv[kPrefetch][kChunk], dyv[kPrefetch][kChunk];
    int vs[kPrefetch];
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      const int64_t t = tb + p;
      vs[p] = t < last ? seg_of[t - first] : -1;
      load_or_zero(xv[p], x, t * s.channels + c0, vs[p] >= 0);
      load_or_zero(dyv[p], dy, t * s.channels + c0, vs[p] >= 0 && t >= t0);
    }
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      const int64_t t = tb + p;
      if (t >= last) break;
      const int seg = vs[p];
      push(xw, xs, xv[p], seg);
      if (t < t0) continue;
      float dz[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) dz[e] = dyv[p][e];
      if (seg >= 0) {
        if (s.silu) {
          float z[kChunk];
          conv_newest(z, xw, xs, tap, seg);
#pragma unroll
          for (int e = 0; e < kChunk; ++e) {
            const float sg = sigmoidf(z[e]);
            dz[e] *= sg * (1.0f + z[e] * (1.0f - sg));
          }
        }
        if (t < t1) {
#pragma unroll
          for (int j = 0; j < kWindow; ++j) {
            const int slot = kWindow - 1 - j;
            if (xs[slot] == seg)
#pragma unroll
              for (int e = 0; e < kChunk; ++e) dw[j][e] = fmaf(dz[e], xw[slot][e], dw[j][e]);
          }
        }
      }
      push(dzw, dzs, dz, seg);
      // Token u = t - kHalo now has every dz it needs: dx[u] = sum_j tap[j] dz[u + j].
      const int64_t u = t - kHalo;
      if (u >= t0 && u < t1) {
        float sum[kChunk] = {};
#pragma unroll
        for (int j = 0; j < kWindow; ++j)
          if (dzs[j] == dzs[0])
#pragma unroll
            for (int e = 0; e < kChunk; ++e) sum[e] = fmaf(tap[j][e], dzw[j][e], sum[e]);
        store_chunk<kChunk>(dx, u * s.channels + c0, sum);
      }
    }
  }
  if (partial != nullptr) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      float* out = partial + ((s.first_tile + blockIdx.y) * s.channels + c0 + e) * kShortConvMaxWidth;
#pragma unroll
      for (int j = 0; j < kWindow; ++j) out[j] = dw[j][e];
    }
  }
}

// dweight[c][width - 1 - j] = sum over tiles (in order) of partial[tile][c][j].
__global__ void short_conv_dweight_kernel(float* dweight, const float* partial, int64_t tiles, ConvShape s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.channels * s.width) return;
  const int64_t c = i / s.width;
  const int j = s.width - 1 - static_cast<int>(i - c * s.width);
  float sum = 0.0f;
  for (int64_t tile = 0; tile < tiles; ++tile) sum += partial[(tile * s.channels + c) * kShortConvMaxWidth + j];
  dweight[i] = sum;
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

ConvShape shape_of(const TensorView& x, const TensorView& weight, const TensorView& cu_seqlens, bool silu) {
  return {x.size(0), x.size(1), static_cast<int>(weight.size(1)), static_cast<int>(cu_seqlens.numel() - 1), silu};
}

// The kernel's compile-time window and channel chunk for a shape: windows of 4 for Kimi's width
// 4 (8 above), 8-channel chunks when every row starts 16-byte aligned (and only with the short
// window, whose registers leave room for them).
struct Variant {
  int window;
  int chunk;
};

Variant variant_of(const ConvShape& s, std::initializer_list<const void*> pointers) {
  bool aligned = s.channels % 8 == 0;
  for (const void* p : pointers) aligned = aligned && aligned16(p);
  const int window = s.width <= 4 ? 4 : kShortConvMaxWidth;
  return {window, window == 4 && aligned ? 8 : 1};
}

int64_t tiles_of(const ConvShape& s) { return (s.tokens + kTileTokens - 1) / kTileTokens; }

// Launches body(grid, shape) over the tiles, kMaxTileRows at a time (the shape's first_tile set).
template <typename Body>
void for_tile_launches(const ConvShape& s, int chunk, Body&& body) {
  const int64_t threads = (s.channels + chunk - 1) / chunk;
  const auto column_blocks = static_cast<unsigned>((threads + kConvThreads - 1) / kConvThreads);
  const int64_t tiles = tiles_of(s);
  for (int64_t first = 0; first < tiles; first += kMaxTileRows) {
    ConvShape part = s;
    part.first_tile = first;
    body(dim3(column_blocks, static_cast<unsigned>(std::min(kMaxTileRows, tiles - first))), part);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void short_conv_forward(const ShortConvArgs& args, cudaStream_t stream) {
  const ConvShape s = shape_of(args.x, args.weight, args.cu_seqlens, args.silu);
  if (s.tokens == 0 || s.channels == 0 || s.segments <= 0) return;
  const Variant v = variant_of(s, {args.x.data, args.y.data});
  const MutOperand y{args.y.data, kind_of(args.y.dtype)};
  const ConstOperand x{args.x.data, kind_of(args.x.dtype)}, weight{args.weight.data, kind_of(args.weight.dtype)};
  const auto* cu = static_cast<const int32_t*>(args.cu_seqlens.data);
  for_tile_launches(s, v.chunk, [&](dim3 grid, const ConvShape& part) {
    if (v.window == 4 && v.chunk == 8) {
      short_conv_forward_kernel<4, 8><<<grid, kConvThreads, 0, stream>>>(y, x, weight, cu, part);
    } else if (v.window == 4) {
      short_conv_forward_kernel<4, 1><<<grid, kConvThreads, 0, stream>>>(y, x, weight, cu, part);
    } else {
      short_conv_forward_kernel<kShortConvMaxWidth, 1><<<grid, kConvThreads, 0, stream>>>(y, x, weight, cu, part);
    }
  });
}

void short_conv_backward(const ShortConvBackwardArgs& args, cudaStream_t stream) {
  const ConvShape s = shape_of(args.x, args.weight, args.cu_seqlens, args.silu);
  const bool want_dweight = args.dweight.data != nullptr;
  if (s.tokens == 0 || s.channels == 0 || s.segments <= 0) {
    // No token contributes: dweight is all zeros (dx has no elements or no segment covers it).
    if (want_dweight) CUDA_CHECK(cudaMemsetAsync(args.dweight.data, 0, args.dweight.nbytes(), stream));
    return;
  }
  const Variant v = variant_of(s, {args.x.data, args.dx.data, args.dy.data});
  const int64_t tiles = tiles_of(s);
  // Per-tile partial sums: a temporary like any other (the backend's one stream orders its use).
  Tensor partials;
  if (want_dweight) {
    partials = Tensor(Shape{tiles * s.channels * kShortConvMaxWidth}, DType::kF32, cuda::device_allocator());
  }
  float* partial = want_dweight ? partials.ptr<float>() : nullptr;
  const MutOperand dx{args.dx.data, kind_of(args.dx.dtype)};
  const ConstOperand dy{args.dy.data, kind_of(args.dy.dtype)}, x{args.x.data, kind_of(args.x.dtype)},
      weight{args.weight.data, kind_of(args.weight.dtype)};
  const auto* cu = static_cast<const int32_t*>(args.cu_seqlens.data);
  for_tile_launches(s, v.chunk, [&](dim3 grid, const ConvShape& part) {
    if (v.window == 4 && v.chunk == 8) {
      short_conv_backward_kernel<4, 8><<<grid, kConvThreads, 0, stream>>>(dx, partial, dy, x, weight, cu, part);
    } else if (v.window == 4) {
      short_conv_backward_kernel<4, 1><<<grid, kConvThreads, 0, stream>>>(dx, partial, dy, x, weight, cu, part);
    } else {
      short_conv_backward_kernel<kShortConvMaxWidth, 1><<<grid, kConvThreads, 0, stream>>>(dx, partial, dy, x, weight,
                                                                                          cu, part);
    }
  });
  if (want_dweight) {
    const int64_t n = s.channels * s.width;
    short_conv_dweight_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
        static_cast<float*>(args.dweight.data), partial, tiles, s);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moetrain::kernels::cuda_ops
