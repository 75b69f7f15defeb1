// Softmax attention within cu_seqlens segments, causal or not, forward and backward (see
// AttentionArgs in kernels/ops.h), CPU reference: the one every other attention kernel is tested against.
// Loops run query row by query row inside each (segment, head), never a [T, T] matrix; sums are
// taken in double in a fixed order, so results do not depend on anything but the inputs.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/rows.h"

namespace moetrain::kernels::cpu {
namespace {

void expect_shape(const TensorView& t, const Shape& shape, const char* name) {
  MOETRAIN_ASSERT(t.shape == shape, std::string("attention: ") + name + " is " + t.shape.str() + ", expected " +
                                        shape.str());
}

struct AttentionDims {
  int64_t tokens = 0;  // queries
  int64_t heads = 0;
  int64_t qk_dim = 0;
  int64_t v_dim = 0;
  int64_t key_tokens = 0;
};

AttentionDims attention_dims(const TensorView& q, const TensorView& k, const TensorView& v) {
  MOETRAIN_ASSERT(q.ndim() == 3, "attention: q must be [tokens, heads, qk_dim], got " + q.shape.str());
  MOETRAIN_ASSERT(v.ndim() == 3, "attention: v must be [tokens, heads, v_dim], got " + v.shape.str());
  MOETRAIN_ASSERT(k.ndim() == 3, "attention: k must be [tokens, heads, qk_dim], got " + k.shape.str());
  AttentionDims d{q.size(0), q.size(1), q.size(2), v.size(2), k.size(0)};
  expect_shape(k, Shape({d.key_tokens, d.heads, d.qk_dim}), "k");
  expect_shape(v, Shape({d.key_tokens, d.heads, d.v_dim}), "v");
  return d;
}

// lse is [tokens, heads]; any shape with that many elements is read the same way.
void expect_lse(const TensorView& lse, const AttentionDims& d) {
  MOETRAIN_ASSERT(lse.numel() == d.tokens * d.heads, "attention: lse is " + lse.shape.str() + ", expected [" +
                                                         std::to_string(d.tokens) + ", " + std::to_string(d.heads) + "]");
}

// The segment boundaries, checked: starts at 0, never decreases, ends at `tokens`.
std::vector<int64_t> segment_bounds(const TensorView& cu_seqlens, int64_t tokens) {
  MOETRAIN_ASSERT(cu_seqlens.ndim() == 1 && cu_seqlens.numel() >= 1,
                  "attention: cu_seqlens must be [num_seqs + 1], got " + cu_seqlens.shape.str());
  const int32_t* cu = cu_seqlens.ptr<int32_t>();
  std::vector<int64_t> bounds(cu, cu + cu_seqlens.numel());
  MOETRAIN_ASSERT(bounds.front() == 0, "attention: cu_seqlens[0] is " + std::to_string(bounds.front()));
  for (size_t i = 1; i < bounds.size(); ++i) {
    MOETRAIN_ASSERT(bounds[i] >= bounds[i - 1], "attention: cu_seqlens decreases at index " + std::to_string(i));
  }
  MOETRAIN_ASSERT(bounds.back() == tokens, "attention: cu_seqlens ends at " + std::to_string(bounds.back()) +
                                               " but there are " + std::to_string(tokens) + " tokens");
  return bounds;
}

// Each query segment and the keys it sees: query t of [q_begin, q_end) attends keys
// [k_begin, last_key(t)] (ops.h AttentionArgs: without key segments of their own, the keys are
// the queries' own tokens and last_key(t) = t; with key_shift, t + key_shift; not causal, the
// segment's last key). last_key(t) may fall before k_begin (the query sees none of these keys),
// never past k_end - 1.
struct SegmentPair {
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0, shift = 0;
  bool causal = true;
  int64_t last_key(int64_t t) const { return causal ? std::min(t + shift, k_end - 1) : k_end - 1; }
};

std::vector<SegmentPair> segment_pairs(const TensorView& cu_seqlens, const TensorView& cu_seqlens_k,
                                       int64_t key_shift, const AttentionDims& d, bool causal) {
  const std::vector<int64_t> q = segment_bounds(cu_seqlens, d.tokens);
  const std::vector<int64_t> k = cu_seqlens_k.data == nullptr ? q : segment_bounds(cu_seqlens_k, d.key_tokens);
  MOETRAIN_ASSERT(k.size() == q.size(), "attention: cu_seqlens_k has " + std::to_string(k.size() - 1) +
                                            " segments, cu_seqlens " + std::to_string(q.size() - 1));
  const bool shifted = key_shift != kShiftFromSegments;
  MOETRAIN_ASSERT(!shifted || cu_seqlens_k.data != nullptr, "attention: key_shift needs cu_seqlens_k");
  std::vector<SegmentPair> pairs;
  for (size_t s = 0; s + 1 < q.size(); ++s) {
    pairs.push_back({q[s], q[s + 1], k[s], k[s + 1], shifted ? key_shift : k[s + 1] - q[s + 1], causal});
    MOETRAIN_ASSERT(shifted || q[s + 1] - q[s] <= k[s + 1] - k[s], "attention: segment " + std::to_string(s) +
                                                                        " has more queries than keys");
  }
  return pairs;
}

}  // namespace

// out and lse are overwritten. lse[t, h] = log sum_s exp(scale * q[t, h] . k[s, h]) over the
// keys t attends to (natural log, the scale included), in T (the accumulation dtype on the CPU).
template <typename T>
void attention_forward(const AttentionArgs& args) {
  const AttentionDims d = attention_dims(args.q, args.k, args.v);
  expect_shape(args.out, Shape({d.tokens, d.heads, d.v_dim}), "out");
  expect_lse(args.lse, d);
  const std::vector<SegmentPair> segments =
      segment_pairs(args.cu_seqlens, args.cu_seqlens_k, args.key_shift, d, args.causal);
  const T* q = args.q.ptr<T>();
  const T* k = args.k.ptr<T>();
  const T* v = args.v.ptr<T>();
  T* out = args.out.ptr<T>();
  T* lse = args.lse.ptr<T>();
  const int64_t q_row = d.heads * d.qk_dim, v_row = d.heads * d.v_dim;

  std::vector<double> logits;
  std::vector<double> acc(static_cast<size_t>(d.v_dim));
  for (const SegmentPair& seg : segments) {
    const int64_t begin = seg.k_begin;
    for (int64_t t = seg.q_begin; t < seg.q_end; ++t) {
      const int64_t last = seg.last_key(t);
      for (int64_t h = 0; h < d.heads; ++h) {
        const T* qt = q + t * q_row + h * d.qk_dim;
        // Keys begin..last inclusive: causal within the segment, or the whole segment.
        logits.resize(static_cast<size_t>(std::max<int64_t>(last - begin + 1, 0)));
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int64_t s = begin; s <= last; ++s) {
          const double l = args.scale * dot_double(qt, k + s * q_row + h * d.qk_dim, d.qk_dim);
          logits[s - begin] = l;
          max_logit = std::max(max_logit, l);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0.0;
        for (int64_t s = begin; s <= last; ++s) {
          const double p = std::exp(logits[s - begin] - max_logit);
          denom += p;
          const T* vs = v + s * v_row + h * d.v_dim;
          for (int64_t c = 0; c < d.v_dim; ++c) acc[c] += p * static_cast<double>(vs[c]);
        }
        // No key (denom 0): out 0, lse -inf.
        T* ot = out + t * v_row + h * d.v_dim;
        for (int64_t c = 0; c < d.v_dim; ++c) ot[c] = static_cast<T>(denom > 0.0 ? acc[c] / denom : 0.0);
        lse[t * d.heads + h] = static_cast<T>(denom > 0.0 ? max_logit + std::log(denom) : max_logit);
      }
    }
  }
}

// dq, dk, dv are overwritten. P is recomputed from q, k and the saved lse;
// D[t] = dout[t] . out[t], dS = P * (dP - D), dq = scale * dS . k, dk = scale * dS^T . q, dv = P^T . dout.
template <typename T>
void attention_backward(const AttentionBackwardArgs& args) {
  const AttentionDims d = attention_dims(args.q, args.k, args.v);
  expect_shape(args.out, Shape({d.tokens, d.heads, d.v_dim}), "out");
  expect_shape(args.dout, args.out.shape, "dout");
  expect_lse(args.lse, d);
  expect_shape(args.dq, args.q.shape, "dq");
  expect_shape(args.dk, args.k.shape, "dk");
  expect_shape(args.dv, args.v.shape, "dv");
  const std::vector<SegmentPair> segments =
      segment_pairs(args.cu_seqlens, args.cu_seqlens_k, args.key_shift, d, args.causal);
  const T* q = args.q.ptr<T>();
  const T* k = args.k.ptr<T>();
  const T* v = args.v.ptr<T>();
  const T* out = args.out.ptr<T>();
  const T* dout = args.dout.ptr<T>();
  const T* lse = args.lse.ptr<T>();
  T* dq = args.dq.ptr<T>();
  T* dk = args.dk.ptr<T>();
  T* dv = args.dv.ptr<T>();
  const int64_t q_row = d.heads * d.qk_dim, v_row = d.heads * d.v_dim;

  std::vector<double> dq_acc(static_cast<size_t>(d.qk_dim));
  std::vector<double> dk_acc, dv_acc;  // [segment length, dim] for one (segment, head)
  for (const SegmentPair& seg : segments) {
    const int64_t begin = seg.k_begin, end = seg.k_end;
    for (int64_t h = 0; h < d.heads; ++h) {
      dk_acc.assign(static_cast<size_t>((end - begin) * d.qk_dim), 0.0);
      dv_acc.assign(static_cast<size_t>((end - begin) * d.v_dim), 0.0);
      for (int64_t t = seg.q_begin; t < seg.q_end; ++t) {
        const int64_t last = seg.last_key(t);
        const T* qt = q + t * q_row + h * d.qk_dim;
        const T* dout_t = dout + t * v_row + h * d.v_dim;
        const double row_lse = static_cast<double>(lse[t * d.heads + h]);
        const double delta = dot_double(dout_t, out + t * v_row + h * d.v_dim, d.v_dim);
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
        for (int64_t s = begin; s <= last; ++s) {
          const T* ks = k + s * q_row + h * d.qk_dim;
          const T* vs = v + s * v_row + h * d.v_dim;
          const double p = std::exp(args.scale * dot_double(qt, ks, d.qk_dim) - row_lse);
          const double dp = dot_double(dout_t, vs, d.v_dim);
          const double ds = p * (dp - delta) * args.scale;
          double* dks = dk_acc.data() + (s - begin) * d.qk_dim;
          double* dvs = dv_acc.data() + (s - begin) * d.v_dim;
          for (int64_t c = 0; c < d.qk_dim; ++c) {
            dq_acc[c] += ds * static_cast<double>(ks[c]);
            dks[c] += ds * static_cast<double>(qt[c]);
          }
          for (int64_t c = 0; c < d.v_dim; ++c) dvs[c] += p * static_cast<double>(dout_t[c]);
        }
        T* dqt = dq + t * q_row + h * d.qk_dim;
        for (int64_t c = 0; c < d.qk_dim; ++c) dqt[c] = static_cast<T>(dq_acc[c]);
      }
      for (int64_t s = begin; s < end; ++s) {
        T* dks = dk + s * q_row + h * d.qk_dim;
        T* dvs = dv + s * v_row + h * d.v_dim;
        for (int64_t c = 0; c < d.qk_dim; ++c) dks[c] = static_cast<T>(dk_acc[(s - begin) * d.qk_dim + c]);
        for (int64_t c = 0; c < d.v_dim; ++c) dvs[c] = static_cast<T>(dv_acc[(s - begin) * d.v_dim + c]);
      }
    }
  }
}

// Per (t, h), in double: the larger lse is the base, so no exponent overflows; both -inf keep
// out and lse as they are (0 and -inf).
template <typename T>
void attention_merge(const AttentionMergeArgs& args) {
  const int64_t rows = args.lse.numel(), v_dim = args.out.size(2);
  T* out = args.out.ptr<T>();
  T* lse = args.lse.ptr<T>();
  const T* chunk_out = args.chunk_out.ptr<T>();
  const T* chunk_lse = args.chunk_lse.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const double a = static_cast<double>(lse[r]), b = static_cast<double>(chunk_lse[r]);
    const double base = std::max(a, b);
    if (base == -std::numeric_limits<double>::infinity()) continue;
    const double wa = std::exp(a - base), wb = std::exp(b - base), sum = wa + wb;
    for (int64_t c = 0; c < v_dim; ++c) {
      T& o = out[r * v_dim + c];
      o = static_cast<T>((wa * static_cast<double>(o) + wb * static_cast<double>(chunk_out[r * v_dim + c])) / sum);
    }
    lse[r] = static_cast<T>(base + std::log(sum));
  }
}

MOETRAIN_CPU_INSTANTIATE(attention_forward, const AttentionArgs&)
MOETRAIN_CPU_INSTANTIATE(attention_backward, const AttentionBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(attention_merge, const AttentionMergeArgs&)

}  // namespace moetrain::kernels::cpu
