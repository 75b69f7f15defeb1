// Causal depthwise short convolution within segments (KDA's q/k/v conv; kernels/ops.h,
// ShortConvArgs), with SiLU, forward and backward.
//
// A thread owns one channel and walks a tile of kTileTokens consecutive tokens (threads of a warp
// hold consecutive channels, so every token's loads are coalesced), keeping the last kMaxWidth
// inputs (and, backward, pre-activation gradients) in registers with the segment each came from.
// Windows are aligned to their newest element, so loops are over compile-time kMaxWidth with the
// taps past `width` zero. Backward, one walk gives dx (the gradient of token u needs dz of tokens
// u .. u + width - 1, so the walk runs kMaxWidth - 1 tokens past the tile) and each tile's partial
// dweight; a second kernel adds the tiles' partials in order (deterministic).
#include "kernels/cuda/short_conv.h"

#include "kernels/cuda/attention_segments.cuh"
#include "core/base/tensor.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kConvThreads = 128;
constexpr int kTileTokens = 128;

struct ConvShape {
  int64_t tokens;
  int64_t channels;
  int width;
  int segments;
  bool silu;
};

__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + __expf(-z)); }

// The segment of token t (its index in cu_seqlens), -1 outside [0, tokens).
__device__ __forceinline__ int segment_of(const int32_t* cu_seqlens, const ConvShape& s, int64_t t) {
  if (t < 0 || t >= s.tokens) return -1;
  return segment_index(cu_seqlens, s.segments, static_cast<int>(t));
}

// Taps in window order: tap[j] multiplies the input j tokens back (weight column width - 1 - j).
__device__ __forceinline__ void load_taps(float (&tap)[kShortConvMaxWidth], ConstOperand weight, int64_t c,
                                          int width) {
#pragma unroll
  for (int j = 0; j < kShortConvMaxWidth; ++j)
    tap[j] = j < width ? load_one(weight, c * width + (width - 1 - j)) : 0.0f;
}

// Shifts a window left by one and puts (value, segment) at its newest slot.
__device__ __forceinline__ void push(float (&value)[kShortConvMaxWidth], int (&seg)[kShortConvMaxWidth], float v,
                                     int s) {
#pragma unroll
  for (int j = 0; j + 1 < kShortConvMaxWidth; ++j) {
    value[j] = value[j + 1];
    seg[j] = seg[j + 1];
  }
  value[kShortConvMaxWidth - 1] = v;
  seg[kShortConvMaxWidth - 1] = s;
}

// The pre-activation of the newest token of the x window (segment `s`).
__device__ __forceinline__ float conv_newest(const float (&x)[kShortConvMaxWidth], const int (&xs)[kShortConvMaxWidth],
                                             const float (&tap)[kShortConvMaxWidth], int s) {
  float z = 0.0f;
#pragma unroll
  for (int j = 0; j < kShortConvMaxWidth; ++j) {
    const int slot = kShortConvMaxWidth - 1 - j;
    if (xs[slot] == s) z = fmaf(tap[j], x[slot], z);
  }
  return z;
}

__global__ void __launch_bounds__(kConvThreads) short_conv_forward_kernel(MutOperand y, ConstOperand x,
                                                                          ConstOperand weight,
                                                                          const int32_t* cu_seqlens, ConvShape s) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= s.channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
  const int64_t t1 = min(t0 + kTileTokens, s.tokens);
  float tap[kShortConvMaxWidth];
  load_taps(tap, weight, c, s.width);
  float xw[kShortConvMaxWidth];
  int xs[kShortConvMaxWidth];
#pragma unroll
  for (int j = 0; j < kShortConvMaxWidth; ++j) {
    xw[j] = 0.0f;
    xs[j] = -1;
  }
  for (int64_t t = t0 - (kShortConvMaxWidth - 1); t < t1; ++t) {
    const int seg = segment_of(cu_seqlens, s, t);
    push(xw, xs, seg >= 0 ? load_one(x, t * s.channels + c) : 0.0f, seg);
    if (t < t0) continue;
    const float z = conv_newest(xw, xs, tap, seg);
    store_one(y, t * s.channels + c, s.silu ? z * sigmoidf(z) : z);
  }
}

// dx for the tile; partial[tile][c][j] = sum over the tile's tokens t of dz[t] x[t - j] (same segment).
__global__ void __launch_bounds__(kConvThreads) short_conv_backward_kernel(MutOperand dx, float* partial,
                                                                           ConstOperand dy, ConstOperand x,
                                                                           ConstOperand weight,
                                                                           const int32_t* cu_seqlens, ConvShape s) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= s.channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
  const int64_t t1 = min(t0 + kTileTokens, s.tokens);
  float tap[kShortConvMaxWidth];
  load_taps(tap, weight, c, s.width);
  float xw[kShortConvMaxWidth], dzw[kShortConvMaxWidth], dw[kShortConvMaxWidth];
  int xs[kShortConvMaxWidth], dzs[kShortConvMaxWidth];
#pragma unroll
  for (int j = 0; j < kShortConvMaxWidth; ++j) {
    xw[j] = dzw[j] = dw[j] = 0.0f;
    xs[j] = dzs[j] = -1;
  }
  // dz is needed from t0 on; x from kMaxWidth - 1 before it (the window of t0's pre-activation).
  for (int64_t t = t0 - (kShortConvMaxWidth - 1); t < t1 + (kShortConvMaxWidth - 1); ++t) {
    const int seg = segment_of(cu_seqlens, s, t);
    push(xw, xs, seg >= 0 ? load_one(x, t * s.channels + c) : 0.0f, seg);
    if (t < t0) continue;
    float dz = 0.0f;
    if (seg >= 0) {
      dz = load_one(dy, t * s.channels + c);
      if (s.silu) {
        const float z = conv_newest(xw, xs, tap, seg), sg = sigmoidf(z);
        dz *= sg * (1.0f + z * (1.0f - sg));
      }
      if (t < t1) {
#pragma unroll
        for (int j = 0; j < kShortConvMaxWidth; ++j) {
          const int slot = kShortConvMaxWidth - 1 - j;
          if (xs[slot] == seg) dw[j] = fmaf(dz, xw[slot], dw[j]);
        }
      }
    }
    push(dzw, dzs, dz, seg);
    // Token u = t - (kMaxWidth - 1) now has every dz it needs: dx[u] = sum_j tap[j] dz[u + j].
    const int64_t u = t - (kShortConvMaxWidth - 1);
    if (u >= t0 && u < t1) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kShortConvMaxWidth; ++j)
        if (dzs[j] == dzs[0]) sum = fmaf(tap[j], dzw[j], sum);
      store_one(dx, u * s.channels + c, sum);
    }
  }
  if (partial != nullptr) {
    float* out = partial + (static_cast<int64_t>(blockIdx.y) * s.channels + c) * kShortConvMaxWidth;
#pragma unroll
    for (int j = 0; j < kShortConvMaxWidth; ++j) out[j] = dw[j];
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

dim3 grid_of(const ConvShape& s) {
  return dim3(static_cast<unsigned>((s.channels + kConvThreads - 1) / kConvThreads),
              static_cast<unsigned>((s.tokens + kTileTokens - 1) / kTileTokens));
}

}  // namespace

void short_conv_forward(const ShortConvArgs& args, cudaStream_t stream) {
  const ConvShape s = shape_of(args.x, args.weight, args.cu_seqlens, args.silu);
  if (s.tokens == 0 || s.channels == 0 || s.segments <= 0) return;
  short_conv_forward_kernel<<<grid_of(s), kConvThreads, 0, stream>>>(
      {args.y.data, kind_of(args.y.dtype)}, {args.x.data, kind_of(args.x.dtype)},
      {args.weight.data, kind_of(args.weight.dtype)}, static_cast<const int32_t*>(args.cu_seqlens.data), s);
  CUDA_CHECK_LAUNCH();
}

void short_conv_backward(const ShortConvBackwardArgs& args, cudaStream_t stream) {
  const ConvShape s = shape_of(args.x, args.weight, args.cu_seqlens, args.silu);
  const bool want_dweight = args.dweight.data != nullptr;
  if (s.tokens == 0 || s.channels == 0 || s.segments <= 0) {
    // No token contributes: dweight is all zeros (dx has no elements or no segment covers it).
    if (want_dweight) CUDA_CHECK(cudaMemsetAsync(args.dweight.data, 0, args.dweight.nbytes(), stream));
    return;
  }
  const dim3 grid = grid_of(s);
  // Per-tile partial sums: a temporary like any other (the backend's one stream orders its use).
  Tensor partials;
  if (want_dweight) {
    partials = Tensor(Shape{static_cast<int64_t>(grid.y) * s.channels * kShortConvMaxWidth}, DType::kF32,
                      cuda::device_allocator());
  }
  float* partial = want_dweight ? partials.ptr<float>() : nullptr;
  short_conv_backward_kernel<<<grid, kConvThreads, 0, stream>>>(
      {args.dx.data, kind_of(args.dx.dtype)}, partial, {args.dy.data, kind_of(args.dy.dtype)},
      {args.x.data, kind_of(args.x.dtype)}, {args.weight.data, kind_of(args.weight.dtype)},
      static_cast<const int32_t*>(args.cu_seqlens.data), s);
  CUDA_CHECK_LAUNCH();
  if (want_dweight) {
    const int64_t n = s.channels * s.width;
    short_conv_dweight_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
        static_cast<float*>(args.dweight.data), partial, grid.y, s);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moetrain::kernels::cuda_ops
