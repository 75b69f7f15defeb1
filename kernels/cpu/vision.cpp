// The vision tower's own ops, CPU reference (contracts: kernels/vision_ops.h).
//   GELU exact:  y = x Phi(x),                     dy/dx = Phi(x) + x phi(x)
//   GELU tanh:   y = x/2 (1 + tanh u),  u = k (x + 0.044715 x^3),  k = sqrt(2/pi)
//                dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) k (1 + 3 * 0.044715 x^2)
//   bilinear resize (align_corners false): output row i of n from an input of m rows reads the
//     source coordinate s = max(0, (i + 0.5) m / n - 0.5) between rows floor(s) and
//     min(floor(s) + 1, m - 1) with weights 1 - (s - floor(s)) and s - floor(s); columns alike.
//   patch merge: the mean over frames, then each neighbourhood's rows side by side.
// Every function overwrites its outputs except vision_pos_embed, which adds into x.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace moetrain::kernels::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;

template <typename T>
T gelu_value(T x, GeluApproximation approximation) {
  if (approximation == GeluApproximation::kTanh) {
    const T u = T(kSqrt2OverPi) * (x + T(kTanhCubic) * x * x * x);
    return T(0.5) * x * (T(1) + std::tanh(u));
  }
  return T(0.5) * x * (T(1) + std::erf(x / std::sqrt(T(2))));
}

template <typename T>
T gelu_derivative(T x, GeluApproximation approximation) {
  if (approximation == GeluApproximation::kTanh) {
    const T th = std::tanh(T(kSqrt2OverPi) * (x + T(kTanhCubic) * x * x * x));
    return T(0.5) * (T(1) + th) +
           T(0.5) * x * (T(1) - th * th) * T(kSqrt2OverPi) * (T(1) + T(3 * kTanhCubic) * x * x);
  }
  const T cdf = T(0.5) * (T(1) + std::erf(x / std::sqrt(T(2))));
  const T pdf = std::exp(T(-0.5) * x * x) / std::sqrt(T(2) * T(M_PI));
  return cdf + x * pdf;
}

// One axis of the bilinear resize: output index i of `out` reads rows lo and hi of `in`.
struct LinearTap {
  int64_t lo = 0, hi = 0;
  double w_lo = 1.0, w_hi = 0.0;
};

std::vector<LinearTap> linear_taps(int64_t in, int64_t out) {
  std::vector<LinearTap> taps(static_cast<size_t>(out));
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  for (int64_t i = 0; i < out; ++i) {
    const double src = std::max(0.0, (static_cast<double>(i) + 0.5) * scale - 0.5);
    LinearTap& tap = taps[static_cast<size_t>(i)];
    tap.lo = std::min(static_cast<int64_t>(src), in - 1);
    tap.hi = std::min(tap.lo + 1, in - 1);
    tap.w_hi = src - static_cast<double>(tap.lo);
    tap.w_lo = 1.0 - tap.w_hi;
  }
  return taps;
}

}  // namespace

template <typename T>
void gelu_forward(const GeluArgs& args) {
  const T* x = args.x.ptr<T>();
  T* y = args.y.ptr<T>();
  for (int64_t i = 0; i < args.x.numel(); ++i) y[i] = gelu_value(x[i], args.approximation);
}

template <typename T>
void gelu_backward(const GeluBackwardArgs& args) {
  const T* x = args.x.ptr<T>();
  const T* dy = args.dy.ptr<T>();
  T* dx = args.dx.ptr<T>();
  for (int64_t i = 0; i < args.x.numel(); ++i) dx[i] = dy[i] * gelu_derivative(x[i], args.approximation);
}

template <typename T>
void vision_pos_embed(const VisionPosEmbedArgs& args) {
  const int64_t dim = args.x.size(1);
  const int64_t table_h = args.table.size(0), table_w = args.table.size(1);
  const std::vector<LinearTap> rows = linear_taps(table_h, args.height);
  const std::vector<LinearTap> cols = linear_taps(table_w, args.width);
  const T* table = args.table.ptr<T>();
  T* x = args.x.ptr<T>();
  std::vector<double> grid(static_cast<size_t>(args.height * args.width * dim));
  for (int64_t r = 0; r < args.height; ++r) {
    const LinearTap& tr = rows[static_cast<size_t>(r)];
    for (int64_t c = 0; c < args.width; ++c) {
      const LinearTap& tc = cols[static_cast<size_t>(c)];
      const T* p00 = table + (tr.lo * table_w + tc.lo) * dim;
      const T* p01 = table + (tr.lo * table_w + tc.hi) * dim;
      const T* p10 = table + (tr.hi * table_w + tc.lo) * dim;
      const T* p11 = table + (tr.hi * table_w + tc.hi) * dim;
      double* g = grid.data() + (r * args.width + c) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        g[d] = tr.w_lo * (tc.w_lo * double(p00[d]) + tc.w_hi * double(p01[d])) +
               tr.w_hi * (tc.w_lo * double(p10[d]) + tc.w_hi * double(p11[d]));
      }
    }
  }
  const int64_t patches = args.height * args.width;
  const T* time = args.frames > 1 ? args.time.ptr<T>() : nullptr;
  for (int64_t f = 0; f < args.frames; ++f) {
    for (int64_t p = 0; p < patches; ++p) {
      T* xr = x + (f * patches + p) * dim;
      const double* g = grid.data() + p * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const double t = time != nullptr ? double(time[f * dim + d]) : 0.0;
        xr[d] += static_cast<T>(g[d] + t);
      }
    }
  }
}

template <typename T>
void patch_merge(const PatchMergeArgs& args) {
  const int64_t dim = args.x.size(1);
  const int64_t mh = args.merge_height, mw = args.merge_width;
  const int64_t out_w = args.width / mw, patches = args.height * args.width;
  const T* x = args.x.ptr<T>();
  T* out = args.out.ptr<T>();
  const double inv_frames = 1.0 / static_cast<double>(args.frames);
  for (int64_t i = 0; i < args.height / mh; ++i) {
    for (int64_t j = 0; j < out_w; ++j) {
      T* o = out + (i * out_w + j) * mh * mw * dim;
      for (int64_t a = 0; a < mh; ++a) {
        for (int64_t b = 0; b < mw; ++b) {
          const int64_t patch = (i * mh + a) * args.width + j * mw + b;
          T* od = o + (a * mw + b) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            double sum = 0.0;
            for (int64_t f = 0; f < args.frames; ++f) sum += double(x[(f * patches + patch) * dim + d]);
            od[d] = static_cast<T>(sum * inv_frames);
          }
        }
      }
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(gelu_forward, const GeluArgs&)
MOETRAIN_CPU_INSTANTIATE(gelu_backward, const GeluBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(vision_pos_embed, const VisionPosEmbedArgs&)
MOETRAIN_CPU_INSTANTIATE(patch_merge, const PatchMergeArgs&)

}  // namespace moetrain::kernels::cpu
