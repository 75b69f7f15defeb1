// MoE token dispatch on the CPU (see MoePermutationArgs, MoeCombineArgs and the moe_* methods of
// Backend in kernels/ops.h): the stable sort of (token, slot) pairs by expert, gathering tokens
// into expert order and its backward, and the weighted combine of expert outputs and its backward.
// Every sum runs in a fixed order (slot 0, 1, ... of a token), so results are deterministic.
// Token rows are copied or summed whole; the row width is everything after the first dimension.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <string>
#include <vector>

namespace moetrain::kernels::cpu {
namespace {

int64_t row_width(const TensorView& t) { return t.size(0) == 0 ? 0 : t.numel() / t.size(0); }

void expect(bool ok, const char* op, const std::string& what) {
  MOETRAIN_ASSERT(ok, std::string(op) + ": " + what);
}

// Checks an int32 index array of `count` entries, each in [0, limit).
void check_indices(const TensorView& index, int64_t count, int64_t limit, const char* op, const char* name) {
  expect(index.numel() == count, op, std::string(name) + " is " + index.shape.str() + ", expected " +
                                         std::to_string(count) + " entries");
  const int32_t* p = index.ptr<int32_t>();
  for (int64_t i = 0; i < count; ++i) {
    expect(p[i] >= 0 && p[i] < limit, op, std::string(name) + "[" + std::to_string(i) + "] = " +
                                              std::to_string(p[i]) + " is outside [0, " + std::to_string(limit) + ")");
  }
}

}  // namespace

// T is unused (all operands are int32); a template only so the backend dispatches uniformly.
// An expert index outside [0, num_experts) throws Error(kInternal) naming the token and slot.
template <typename T>
void moe_permutation(const MoePermutationArgs& args) {
  const TensorView& topk = args.topk_index;
  expect(topk.ndim() == 2, "moe_permutation", "topk_index must be [tokens, top_k], got " + topk.shape.str());
  const int64_t tokens = topk.size(0), top_k = topk.size(1), pairs = tokens * top_k;
  const int64_t experts = args.num_experts;
  expect(experts > 0, "moe_permutation", "num_experts is " + std::to_string(experts));
  expect(args.expert_offsets.numel() == experts + 1, "moe_permutation",
         "expert_offsets is " + args.expert_offsets.shape.str() + ", expected [" + std::to_string(experts + 1) + "]");
  expect(args.sorted_pair.numel() == pairs, "moe_permutation",
         "sorted_pair is " + args.sorted_pair.shape.str() + ", expected " + std::to_string(pairs) + " entries");
  expect(args.pair_row.numel() == pairs, "moe_permutation",
         "pair_row is " + args.pair_row.shape.str() + ", expected " + std::to_string(pairs) + " entries");
  const int32_t* expert_of = topk.ptr<int32_t>();
  int32_t* offsets = args.expert_offsets.ptr<int32_t>();
  int32_t* sorted_pair = args.sorted_pair.ptr<int32_t>();
  int32_t* pair_row = args.pair_row.ptr<int32_t>();

  // Counting sort: count, prefix-sum, then place pairs in pair order, which is token order
  // within each expert (stable).
  std::vector<int64_t> next(static_cast<size_t>(experts) + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t e = expert_of[p];
    MOETRAIN_CHECK(e >= 0 && e < experts, ExitCode::kInternal,
                   "moe_permutation: token " + std::to_string(p / top_k) + " slot " + std::to_string(p % top_k) +
                       " is routed to expert " + std::to_string(e) + ", outside [0, " + std::to_string(experts) +
                       ")");
    ++next[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= experts; ++e) offsets[e] = static_cast<int32_t>(next[e]);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = next[expert_of[p]]++;
    sorted_pair[row] = static_cast<int32_t>(p);
    pair_row[p] = static_cast<int32_t>(row);
  }
}

// out[p, :] = x[sorted_pair[p] / top_k, :]
template <typename T>
void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k) {
  expect(top_k >= 1, "moe_permute", "top_k is " + std::to_string(top_k));
  expect(out.ndim() >= 1 && x.ndim() >= 1 && row_width(out) == row_width(x), "moe_permute",
         "out " + out.shape.str() + " and x " + x.shape.str() + " rows differ in width");
  const int64_t rows = out.size(0), width = row_width(x);
  check_indices(sorted_pair, rows, x.size(0) * top_k, "moe_permute", "sorted_pair");
  const int32_t* pair = sorted_pair.ptr<int32_t>();
  const T* src = x.ptr<T>();
  T* dst = out.ptr<T>();
  for (int64_t p = 0; p < rows; ++p) {
    std::copy_n(src + (pair[p] / top_k) * width, width, dst + p * width);
  }
}

// dx[t, :] (+)= sum_j drows[pair_row[t * top_k + j], :]
template <typename T>
void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                       bool accumulate) {
  expect(top_k >= 1, "moe_unpermute_sum", "top_k is " + std::to_string(top_k));
  expect(dx.ndim() >= 1 && drows.ndim() >= 1 && row_width(dx) == row_width(drows), "moe_unpermute_sum",
         "dx " + dx.shape.str() + " and drows " + drows.shape.str() + " rows differ in width");
  const int64_t tokens = dx.size(0), width = row_width(dx);
  check_indices(pair_row, tokens * top_k, drows.size(0), "moe_unpermute_sum", "pair_row");
  const int32_t* row_of = pair_row.ptr<int32_t>();
  const T* src = drows.ptr<T>();
  T* dst = dx.ptr<T>();
  std::vector<double> sum(static_cast<size_t>(width));
  for (int64_t t = 0; t < tokens; ++t) {
    T* d = dst + t * width;
    for (int64_t c = 0; c < width; ++c) sum[c] = accumulate ? static_cast<double>(d[c]) : 0.0;
    for (int64_t j = 0; j < top_k; ++j) {
      const T* r = src + row_of[t * top_k + j] * width;
      for (int64_t c = 0; c < width; ++c) sum[c] += static_cast<double>(r[c]);
    }
    for (int64_t c = 0; c < width; ++c) d[c] = static_cast<T>(sum[c]);
  }
}

// out[t, :] = sum_j weight[t, j] * rows[pair_row[t * top_k + j], :]   (out overwritten)
template <typename T>
void moe_combine(const MoeCombineArgs& args) {
  expect(args.weight.ndim() == 2, "moe_combine", "weight must be [tokens, top_k], got " + args.weight.shape.str());
  const int64_t tokens = args.weight.size(0), top_k = args.weight.size(1);
  expect(args.out.ndim() >= 1 && args.out.size(0) == tokens && args.rows.ndim() >= 1 &&
             row_width(args.out) == row_width(args.rows),
         "moe_combine", "out " + args.out.shape.str() + ", rows " + args.rows.shape.str() + ", weight " +
                            args.weight.shape.str() + " do not fit together");
  const int64_t width = row_width(args.out);
  check_indices(args.pair_row, tokens * top_k, args.rows.size(0), "moe_combine", "pair_row");
  const int32_t* row_of = args.pair_row.ptr<int32_t>();
  const T* rows = args.rows.ptr<T>();
  const T* weight = args.weight.ptr<T>();
  T* out = args.out.ptr<T>();
  std::vector<double> sum(static_cast<size_t>(width));
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t j = 0; j < top_k; ++j) {
      const double w = static_cast<double>(weight[t * top_k + j]);
      const T* r = rows + row_of[t * top_k + j] * width;
      for (int64_t c = 0; c < width; ++c) sum[c] += w * static_cast<double>(r[c]);
    }
    for (int64_t c = 0; c < width; ++c) out[t * width + c] = static_cast<T>(sum[c]);
  }
}

// drows[pair_row[t * top_k + j], :] = weight[t, j] * dout[t, :];  dweight[t, j] = dout[t, :] . rows[...]
// (both overwritten; rows no pair maps to are zeroed).
template <typename T>
void moe_combine_backward(const MoeCombineBackwardArgs& args) {
  expect(args.weight.ndim() == 2, "moe_combine_backward",
         "weight must be [tokens, top_k], got " + args.weight.shape.str());
  const int64_t tokens = args.weight.size(0), top_k = args.weight.size(1);
  expect(args.dout.ndim() >= 1 && args.dout.size(0) == tokens && args.rows.ndim() >= 1 &&
             row_width(args.dout) == row_width(args.rows) && args.drows.shape == args.rows.shape &&
             args.dweight.shape == args.weight.shape,
         "moe_combine_backward", "dout " + args.dout.shape.str() + ", rows " + args.rows.shape.str() + ", drows " +
                                     args.drows.shape.str() + ", weight " + args.weight.shape.str() + ", dweight " +
                                     args.dweight.shape.str() + " do not fit together");
  const int64_t width = row_width(args.dout);
  check_indices(args.pair_row, tokens * top_k, args.rows.size(0), "moe_combine_backward", "pair_row");
  const int32_t* row_of = args.pair_row.ptr<int32_t>();
  const T* rows = args.rows.ptr<T>();
  const T* weight = args.weight.ptr<T>();
  const T* dout = args.dout.ptr<T>();
  T* drows = args.drows.ptr<T>();
  T* dweight = args.dweight.ptr<T>();
  // Rows that no pair maps to get no gradient; zero them so `drows` is fully overwritten.
  std::fill_n(drows, args.drows.numel(), T(0));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = dout + t * width;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = row_of[t * top_k + j];
      const double w = static_cast<double>(weight[t * top_k + j]);
      const T* r = rows + row * width;
      T* dr = drows + row * width;
      double dw = 0.0;
      for (int64_t c = 0; c < width; ++c) {
        dw += static_cast<double>(g[c]) * static_cast<double>(r[c]);
        dr[c] = static_cast<T>(w * static_cast<double>(g[c]));
      }
      dweight[t * top_k + j] = static_cast<T>(dw);
    }
  }
}

#define MOETRAIN_INSTANTIATE_MOE(T)                                                                          \
  template void moe_permutation<T>(const MoePermutationArgs&);                                               \
  template void moe_permute<T>(const TensorView&, const TensorView&, const TensorView&, int64_t);            \
  template void moe_unpermute_sum<T>(const TensorView&, const TensorView&, const TensorView&, int64_t, bool); \
  template void moe_combine<T>(const MoeCombineArgs&);                                                       \
  template void moe_combine_backward<T>(const MoeCombineBackwardArgs&);
MOETRAIN_INSTANTIATE_MOE(float)
MOETRAIN_INSTANTIATE_MOE(double)
#undef MOETRAIN_INSTANTIATE_MOE

}  // namespace moetrain::kernels::cpu
