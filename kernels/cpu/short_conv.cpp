// The causal depthwise short convolution of KDA, CPU reference (contract: kernels/ops.h,
// ShortConvArgs). Per channel c and token t of a segment starting at s:
//   z[t, c] = sum_{i < W} w[c, i] * x[t - W + 1 + i, c]   (x before s read as zero)
//   y = silu(z) (or z without `silu`)
// Backward, with dz = dy * silu'(z), silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))):
//   dx[u, c] = sum_i w[c, i] * dz[u + W - 1 - i, c]   (only outputs of u's segment)
//   dw[c, i] = sum_t dz[t, c] * x[t - W + 1 + i, c]
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/sigmoid.h"

namespace moetrain::kernels::cpu {
namespace {

struct ConvDims {
  int64_t tokens = 0;
  int64_t channels = 0;
  int64_t width = 0;
};

ConvDims conv_dims(const TensorView& x, const TensorView& weight) {
  return {x.size(0), x.size(1), weight.size(1)};
}

// The pre-activation z[t, c] of a token t in the segment starting at `start`.
template <typename T>
T conv_at(const T* x, const T* w, const ConvDims& d, int64_t start, int64_t t, int64_t c) {
  T z = 0;
  for (int64_t i = 0; i < d.width; ++i) {
    const int64_t src = t - d.width + 1 + i;
    if (src >= start) z += w[c * d.width + i] * x[src * d.channels + c];
  }
  return z;
}

}  // namespace

template <typename T>
void short_conv_forward(const ShortConvArgs& args) {
  const ConvDims d = conv_dims(args.x, args.weight);
  const T* x = args.x.ptr<T>();
  const T* w = args.weight.ptr<T>();
  T* y = args.y.ptr<T>();
  const int32_t* cu = args.cu_seqlens.ptr<int32_t>();
  for (int64_t seg = 0; seg + 1 < args.cu_seqlens.numel(); ++seg) {
    for (int64_t t = cu[seg]; t < cu[seg + 1]; ++t) {
      for (int64_t c = 0; c < d.channels; ++c) {
        const T z = conv_at(x, w, d, cu[seg], t, c);
        y[t * d.channels + c] = args.silu ? z * sigmoid(z) : z;
      }
    }
  }
}

// dx overwritten; dweight (when given) overwritten with this call's sum over tokens.
template <typename T>
void short_conv_backward(const ShortConvBackwardArgs& args) {
  const ConvDims d = conv_dims(args.x, args.weight);
  const T* x = args.x.ptr<T>();
  const T* w = args.weight.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  T* dx = args.dx.ptr<T>();
  const bool want_dweight = args.dweight.data != nullptr;
  T* dw = want_dweight ? args.dweight.ptr<T>() : nullptr;
  if (want_dweight) std::fill(dw, dw + d.channels * d.width, T(0));
  const int32_t* cu = args.cu_seqlens.ptr<int32_t>();
  std::vector<T> dz(static_cast<size_t>(d.tokens * d.channels));
  for (int64_t seg = 0; seg + 1 < args.cu_seqlens.numel(); ++seg) {
    const int64_t start = cu[seg], end = cu[seg + 1];
    for (int64_t t = start; t < end; ++t) {
      for (int64_t c = 0; c < d.channels; ++c) {
        T g = dy[t * d.channels + c];
        if (args.silu) {
          const T z = conv_at(x, w, d, start, t, c), s = sigmoid(z);
          g *= s * (T(1) + z * (T(1) - s));
        }
        dz[t * d.channels + c] = g;
      }
    }
    for (int64_t u = start; u < end; ++u) {
      for (int64_t c = 0; c < d.channels; ++c) {
        T sum = 0;
        for (int64_t i = 0; i < d.width; ++i) {
          const int64_t t = u + d.width - 1 - i;
          if (t < end) sum += w[c * d.width + i] * dz[t * d.channels + c];
        }
        dx[u * d.channels + c] = sum;
      }
    }
    if (want_dweight) {
      for (int64_t t = start; t < end; ++t) {
        for (int64_t c = 0; c < d.channels; ++c) {
          for (int64_t i = 0; i < d.width; ++i) {
            const int64_t src = t - d.width + 1 + i;
            if (src >= start) dw[c * d.width + i] += dz[t * d.channels + c] * x[src * d.channels + c];
          }
        }
      }
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(short_conv_forward, const ShortConvArgs&)
MOETRAIN_CPU_INSTANTIATE(short_conv_backward, const ShortConvBackwardArgs&)

}  // namespace moetrain::kernels::cpu
