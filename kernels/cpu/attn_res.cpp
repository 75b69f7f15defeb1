// Block Attention Residuals' depth mix, CPU reference (contract: kernels/ops.h, AttnResArgs).
// One row at a time: the m keys' scales and scores, their softmax, then the weighted sum; the
// backward recomputes the scales and scores from the values and the saved probabilities.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/rows.h"

namespace moetrain::kernels::cpu {
namespace {

// r_i and s_i of every value at row t (ops.h AttnResArgs), in T.
template <typename T>
void scales_and_scores(const std::vector<TensorView>& values, const T* w, int64_t t, int64_t dim, double eps,
                       std::vector<T>& r, std::vector<T>& s) {
  const size_t m = values.size();
  r.assign(m, T(0));
  s.assign(m, T(0));
  for (size_t i = 0; i < m; ++i) {
    const T* v = values[i].ptr<T>() + t * dim;
    T sum_squares = T(0), dot = T(0);
    for (int64_t d = 0; d < dim; ++d) {
      sum_squares += v[d] * v[d];
      dot += w[d] * v[d];
    }
    r[i] = T(1) / std::sqrt(sum_squares / T(dim) + T(eps));
    s[i] = r[i] * dot;
  }
}

// The combined pseudo-query norm_weight * query, [dim].
template <typename T>
std::vector<T> combined_query(const TensorView& norm_weight, const TensorView& query) {
  const int64_t dim = query.numel();
  std::vector<T> w(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) w[d] = norm_weight.ptr<T>()[d] * query.ptr<T>()[d];
  return w;
}

}  // namespace

template <typename T>
void attn_res_forward(const AttnResArgs& args) {
  const int64_t dim = args.out.size(-1);
  const int64_t rows = row_count(args.out, dim);
  const size_t m = args.values.size();
  const std::vector<T> w = combined_query<T>(args.norm_weight, args.query);
  std::vector<T> r, s;
  for (int64_t t = 0; t < rows; ++t) {
    scales_and_scores(args.values, w.data(), t, dim, args.eps, r, s);
    const T top = *std::max_element(s.begin(), s.end());
    T total = T(0);
    for (size_t i = 0; i < m; ++i) total += (s[i] = std::exp(s[i] - top));
    T* p = args.probs.ptr<T>() + t * static_cast<int64_t>(m);
    for (size_t i = 0; i < m; ++i) p[i] = s[i] / total;
    T* out = args.out.ptr<T>() + t * dim;
    for (int64_t d = 0; d < dim; ++d) {
      T sum = T(0);
      for (size_t i = 0; i < m; ++i) sum += p[i] * args.values[i].ptr<T>()[t * dim + d];
      out[d] = sum;
    }
  }
}

template <typename T>
void attn_res_backward(const AttnResBackwardArgs& args) {
  const int64_t dim = args.dout.size(-1);
  const int64_t rows = row_count(args.dout, dim);
  const size_t m = args.values.size();
  const std::vector<T> w = combined_query<T>(args.norm_weight, args.query);
  std::vector<T> r, s, g(m), ds(m);
  for (int64_t t = 0; t < rows; ++t) {
    scales_and_scores(args.values, w.data(), t, dim, args.eps, r, s);
    const T* p = args.probs.ptr<T>() + t * static_cast<int64_t>(m);
    const T* dout = args.dout.ptr<T>() + t * dim;
    T mean_g = T(0);
    for (size_t i = 0; i < m; ++i) {
      const T* v = args.values[i].ptr<T>() + t * dim;
      g[i] = T(0);
      for (int64_t d = 0; d < dim; ++d) g[i] += dout[d] * v[d];
      mean_g += p[i] * g[i];
    }
    for (size_t i = 0; i < m; ++i) ds[i] = p[i] * (g[i] - mean_g);
    for (size_t i = 0; i < m; ++i) {
      const T* v = args.values[i].ptr<T>() + t * dim;
      T* dv = args.dvalues[i].ptr<T>() + t * dim;
      for (int64_t d = 0; d < dim; ++d) {
        dv[d] += p[i] * dout[d] + ds[i] * r[i] * (w[d] - s[i] * r[i] * v[d] / T(dim));
      }
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(attn_res_forward, const AttnResArgs&)
MOETRAIN_CPU_INSTANTIATE(attn_res_backward, const AttnResBackwardArgs&)

}  // namespace moetrain::kernels::cpu
