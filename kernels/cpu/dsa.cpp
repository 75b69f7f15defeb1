// DeepSeek Sparse Attention, CPU reference (contracts: kernels/ops.h, the DSA section):
// the indexer key's LayerNorm, the lightning indexer's causal top-k, and sparse attention in MQA
// form over the selected keys, forward and backward. Sums run in double in a fixed order (query,
// then head, then selected key), so results depend on nothing but the inputs; with every key
// selected the forward performs exactly attention_forward's arithmetic (kernels/cpu/attention.cpp),
// so "top-k >= T" reproduces dense attention bit for bit.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/cpu/rows.h"

namespace moetrain::kernels::cpu {
namespace {

// The valid (>= 0) entries at the front of a topk_index row.
int64_t selected_count(const int32_t* row, int64_t top_k) {
  int64_t n = 0;
  while (n < top_k && row[n] >= 0) ++n;
  return n;
}

// The sizes of a sparse attention call: q [tokens, heads, qk_dim], out [tokens, heads, v_dim].
struct SparseDims {
  int64_t tokens, heads, qk_dim, v_dim;
};

SparseDims sparse_dims(const TensorView& q, const TensorView& out) {
  return {q.size(0), q.size(1), q.size(2), out.size(2)};
}

// body(t, selected, count) for every query t in order: its row of topk_index and the number of
// valid keys at the row's front.
template <typename Body>
void for_each_query(const TensorView& topk_index, int64_t tokens, Body&& body) {
  const int64_t top_k = topk_index.size(1);
  const int32_t* index = topk_index.ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* selected = index + t * top_k;
    body(t, selected, selected_count(selected, top_k));
  }
}

}  // namespace

// y = (x - mean) * rstd * weight + bias per row, statistics in double. y may alias x.
template <typename T>
void layernorm_forward(const LayerNormArgs& args) {
  const int64_t dim = args.x.size(-1);
  const int64_t rows = row_count(args.x, dim);
  const T* x = args.x.ptr<T>();
  const T* weight = args.weight.ptr<T>();
  const T* bias = args.bias.ptr<T>();
  T* y = args.y.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    double mean = 0.0;
    for (int64_t j = 0; j < dim; ++j) mean += static_cast<double>(xr[j]);
    mean /= static_cast<double>(dim);
    double var = 0.0;
    for (int64_t j = 0; j < dim; ++j) var += (static_cast<double>(xr[j]) - mean) * (static_cast<double>(xr[j]) - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(dim) + args.eps);
    T* yr = y + r * dim;  // may be xr: each element is read before it is written
    for (int64_t j = 0; j < dim; ++j) {
      yr[j] = static_cast<T>((static_cast<double>(xr[j]) - mean) * rstd * static_cast<double>(weight[j]) +
                             static_cast<double>(bias[j]));
    }
  }
}

// Scores in double; selection by (score descending, key ascending), written in ascending key
// order, -1 padded. The caller has checked shapes and cu_seqlens.
template <typename T>
void dsa_indexer_topk(const DsaIndexerArgs& args) {
  const int64_t heads = args.q.size(1), dim = args.q.size(2);
  const int64_t top_k = args.top_k;
  const T* q = args.q.ptr<T>();
  const T* k = args.k.ptr<T>();
  const T* w = args.weights.ptr<T>();
  int32_t* out = args.topk_index.ptr<int32_t>();
  const int32_t* cu = args.cu_seqlens.ptr<int32_t>();
  const int32_t* cu_k = args.cu_seqlens_k.data != nullptr ? args.cu_seqlens_k.ptr<int32_t>() : cu;
  const int64_t segments = args.cu_seqlens.numel() - 1;

  // (score, key) with the better first: higher score, then lower key. A NaN score ranks last.
  auto better = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<std::pair<double, int64_t>> scored;
  for (int64_t seg = 0; seg < segments; ++seg) {
    const int64_t begin = cu[seg], end = cu[seg + 1];
    // Query t sees the keys of its key segment up to its own: the segment's last query the last key.
    const int64_t key_begin = cu_k[seg], shift = cu_k[seg + 1] - end;
    for (int64_t t = begin; t < end; ++t) {
      scored.clear();
      for (int64_t s = key_begin; s <= t + shift; ++s) {
        double score = 0.0;
        for (int64_t j = 0; j < heads; ++j) {
          const double logit = dot_double(q + (t * heads + j) * dim, k + s * dim, dim);
          score += static_cast<double>(w[t * heads + j]) * std::max(logit, 0.0);
        }
        score *= args.scale;
        scored.emplace_back(std::isnan(score) ? -std::numeric_limits<double>::infinity() : score, s);
      }
      const int64_t kept = std::min<int64_t>(top_k, static_cast<int64_t>(scored.size()));
      std::nth_element(scored.begin(), scored.begin() + (kept - 1), scored.end(), better);
      std::sort(scored.begin(), scored.begin() + kept,
                [](const auto& a, const auto& b) { return a.second < b.second; });
      int32_t* row = out + t * top_k;
      for (int64_t i = 0; i < top_k; ++i) row[i] = i < kept ? static_cast<int32_t>(scored[i].second) : -1;
    }
  }
}

// The caller has checked that every row of topk_index is valid keys <= t + key_offset (strictly
// ascending) followed by -1s.
template <typename T>
void sparse_attention_forward(const SparseAttentionArgs& args) {
  const SparseDims d = sparse_dims(args.q, args.out);
  const int64_t tokens = d.tokens, heads = d.heads, qk_dim = d.qk_dim, v_dim = d.v_dim;
  const T* q = args.q.ptr<T>();
  const T* kv = args.kv.ptr<T>();
  T* out = args.out.ptr<T>();
  T* lse = args.lse.ptr<T>();

  std::vector<double> logits(static_cast<size_t>(args.topk_index.size(1)));
  std::vector<double> acc(static_cast<size_t>(v_dim));
  for_each_query(args.topk_index, tokens, [&](int64_t t, const int32_t* selected, int64_t count) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* qt = q + (t * heads + h) * qk_dim;
      // The same arithmetic, in the same order, as attention_forward over keys begin..t.
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < count; ++i) {
        logits[i] = args.scale * dot_double(qt, kv + selected[i] * qk_dim, qk_dim);
        max_logit = std::max(max_logit, logits[i]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double denom = 0.0;
      for (int64_t i = 0; i < count; ++i) {
        const double p = std::exp(logits[i] - max_logit);
        denom += p;
        const T* value = kv + selected[i] * qk_dim;
        for (int64_t c = 0; c < v_dim; ++c) acc[c] += p * static_cast<double>(value[c]);
      }
      T* ot = out + (t * heads + h) * v_dim;
      for (int64_t c = 0; c < v_dim; ++c) ot[c] = count > 0 ? static_cast<T>(acc[c] / denom) : T(0);
      lse[t * heads + h] = static_cast<T>(count > 0 ? max_logit + std::log(denom) : max_logit);
    }
  });
}

// dq, dkv overwritten; P recomputed from q, kv and lse.
template <typename T>
void sparse_attention_backward(const SparseAttentionBackwardArgs& args) {
  const SparseDims d = sparse_dims(args.q, args.out);
  const int64_t tokens = d.tokens, heads = d.heads, qk_dim = d.qk_dim, v_dim = d.v_dim;
  const T* q = args.q.ptr<T>();
  const T* kv = args.kv.ptr<T>();
  const T* out = args.out.ptr<T>();
  const T* dout = args.dout.ptr<T>();
  const T* lse = args.lse.ptr<T>();
  T* dq = args.dq.ptr<T>();
  T* dkv = args.dkv.ptr<T>();

  // dkv is a sum over every (query, head) that selected the row: accumulated in double over
  // queries, heads and selected keys in ascending order.
  const int64_t keys = args.kv.size(0);  // tokens + key_offset
  std::vector<double> dkv_acc(static_cast<size_t>(keys * qk_dim), 0.0);
  std::vector<double> dq_acc(static_cast<size_t>(qk_dim));
  for_each_query(args.topk_index, tokens, [&](int64_t t, const int32_t* selected, int64_t count) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = t * heads + h;
      const T* qt = q + row * qk_dim;
      const T* dout_t = dout + row * v_dim;
      const double row_lse = static_cast<double>(lse[row]);
      const double delta = dot_double(dout_t, out + row * v_dim, v_dim);
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t s = selected[i];
        const T* kvs = kv + s * qk_dim;
        const double p = std::exp(args.scale * dot_double(qt, kvs, qk_dim) - row_lse);
        const double dp = dot_double(dout_t, kvs, v_dim);
        const double ds = p * (dp - delta) * args.scale;
        double* dkvs = dkv_acc.data() + s * qk_dim;
        for (int64_t c = 0; c < qk_dim; ++c) {
          dq_acc[c] += ds * static_cast<double>(kvs[c]);
          dkvs[c] += ds * static_cast<double>(qt[c]);
        }
        for (int64_t c = 0; c < v_dim; ++c) dkvs[c] += p * static_cast<double>(dout_t[c]);
      }
      T* dqt = dq + row * qk_dim;
      for (int64_t c = 0; c < qk_dim; ++c) dqt[c] = static_cast<T>(dq_acc[c]);
    }
  });
  for (int64_t i = 0; i < keys * qk_dim; ++i) dkv[i] = static_cast<T>(dkv_acc[i]);
}

MOETRAIN_CPU_INSTANTIATE(layernorm_forward, const LayerNormArgs&)
MOETRAIN_CPU_INSTANTIATE(dsa_indexer_topk, const DsaIndexerArgs&)
MOETRAIN_CPU_INSTANTIATE(sparse_attention_forward, const SparseAttentionArgs&)
MOETRAIN_CPU_INSTANTIATE(sparse_attention_backward, const SparseAttentionBackwardArgs&)

}  // namespace moetrain::kernels::cpu
