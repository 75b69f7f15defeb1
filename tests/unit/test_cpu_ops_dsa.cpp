// CPU reference backend: the DSA family (LayerNorm, the lightning indexer's top-k, sparse MQA
// attention) and the attention output gate. Forwards against naive double computations written
// here from the formulas of kernels/ops.h (after transformers' deepseek_v32); backwards against
// central differences in double; the sparse attention with every key selected against the dense
// attention op, bit for bit; packed documents against each document alone.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Segments of 5, 1, 0 and 7 tokens: a single-token document and an empty one.
const std::vector<int32_t> kSegments = {0, 5, 6, 6, 13};

// The indexer's inputs; q and k magnitudes chosen so that relu cuts some (q_j, k_s) pairs.
struct IndexerInputs {
  int64_t tokens = 0, heads = 0, dim = 0;
  Tensor q, k, weights, cu_seqlens;
};

IndexerInputs make_indexer_inputs(const std::vector<int32_t>& cu, int64_t heads, int64_t dim, uint64_t seed) {
  IndexerInputs in;
  in.tokens = cu.back();
  in.heads = heads;
  in.dim = dim;
  in.q = random_tensor({in.tokens, heads, dim}, DType::kF64, seed + 1);
  in.k = random_tensor({in.tokens, dim}, DType::kF64, seed + 2);
  in.weights = random_tensor({in.tokens, heads}, DType::kF64, seed + 3);
  in.cu_seqlens = make_i32(cu);
  return in;
}

// I[t, s] from the definition, in double.
double naive_index_score(const IndexerInputs& in, int64_t t, int64_t s, double scale) {
  double score = 0.0;
  for (int64_t j = 0; j < in.heads; ++j) {
    double logit = 0.0;
    for (int64_t c = 0; c < in.dim; ++c)
      logit += get_element(in.q, (t * in.heads + j) * in.dim + c) * get_element(in.k, s * in.dim + c);
    score += get_element(in.weights, t * in.heads + j) * std::max(logit, 0.0);
  }
  return scale * score;
}

// The expected rows: all keys of t's segment up to t, ranked by (score desc, key asc), the first
// top_k kept, listed ascending, -1 padded.
Tensor naive_topk(const IndexerInputs& in, const std::vector<int32_t>& cu, int64_t top_k, double scale) {
  Tensor out({in.tokens, top_k}, DType::kI32);
  for (size_t seg = 0; seg + 1 < cu.size(); ++seg) {
    for (int64_t t = cu[seg]; t < cu[seg + 1]; ++t) {
      std::vector<std::pair<double, int64_t>> ranked;
      for (int64_t s = cu[seg]; s <= t; ++s) ranked.emplace_back(-naive_index_score(in, t, s, scale), s);
      std::sort(ranked.begin(), ranked.end());
      std::vector<int32_t> kept;
      for (int64_t i = 0; i < top_k && i < static_cast<int64_t>(ranked.size()); ++i)
        kept.push_back(static_cast<int32_t>(ranked[i].second));
      std::sort(kept.begin(), kept.end());
      kept.resize(static_cast<size_t>(top_k), -1);
      std::copy(kept.begin(), kept.end(), out.ptr<int32_t>() + t * top_k);
    }
  }
  return out;
}

Tensor run_indexer(Backend& be, const IndexerInputs& in, int64_t top_k, double scale, DType dtype = DType::kF64) {
  Tensor q = copy_as(in.q, dtype), k = copy_as(in.k, dtype), w = copy_as(in.weights, dtype);
  Tensor out({in.tokens, top_k}, DType::kI32);
  be.dsa_indexer_topk(DsaIndexerArgs{out, q, k, w, in.cu_seqlens, top_k, scale});
  return out;
}

// Sparse attention problem: q [tokens, heads, qk], kv [tokens, qk], value = kv[:, :v].
struct SparseInputs {
  int64_t tokens = 0, heads = 0, qk = 0, v = 0;
  double scale = 0.4;
  Tensor q, kv, dout;
};

SparseInputs make_sparse_inputs(int64_t tokens, int64_t heads, int64_t qk, int64_t v, uint64_t seed) {
  SparseInputs in;
  in.tokens = tokens;
  in.heads = heads;
  in.qk = qk;
  in.v = v;
  in.q = random_tensor({tokens, heads, qk}, DType::kF64, seed + 1, 0.1, 1.5);
  in.kv = random_tensor({tokens, qk}, DType::kF64, seed + 2, 0.1, 1.5);
  in.dout = random_tensor({tokens, heads, v}, DType::kF64, seed + 3);
  return in;
}

struct SparseOut {
  Tensor out, lse;
};

SparseOut sparse_forward(Backend& be, const Tensor& q, const Tensor& kv, const Tensor& index, int64_t v, double scale,
                         int64_t key_offset = 0) {
  SparseOut r{Tensor({q.size(0), q.size(1), v}, q.dtype()), Tensor({q.size(0), q.size(1)}, q.dtype())};
  be.sparse_attention_forward(SparseAttentionArgs{r.out, r.lse, q, kv, index, scale, key_offset});
  return r;
}

struct SparseGrads {
  Tensor dq, dkv;
};

SparseGrads sparse_backward(Backend& be, const Tensor& dout, const Tensor& q, const Tensor& kv, const SparseOut& fwd,
                            const Tensor& index, double scale, int64_t key_offset = 0) {
  // Overwritten: start from garbage.
  SparseGrads g{random_tensor(q.shape(), q.dtype(), 91, 5.0, 9.0), random_tensor(kv.shape(), kv.dtype(), 92, 5.0, 9.0)};
  be.sparse_attention_backward(
      SparseAttentionBackwardArgs{g.dq, g.dkv, dout, q, kv, fwd.out, fwd.lse, index, scale, key_offset});
  return g;
}

// out and lse from the definition: softmax over the listed keys only.
SparseOut naive_sparse(const SparseInputs& in, const Tensor& index) {
  SparseOut r{Tensor({in.tokens, in.heads, in.v}, DType::kF64), Tensor({in.tokens, in.heads}, DType::kF64)};
  const int64_t top_k = index.size(1);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t h = 0; h < in.heads; ++h) {
      std::vector<double> logits;
      std::vector<int64_t> keys;
      for (int64_t i = 0; i < top_k; ++i) {
        const int32_t s = index.ptr<int32_t>()[t * top_k + i];
        if (s < 0) continue;
        double dot = 0.0;
        for (int64_t c = 0; c < in.qk; ++c)
          dot += get_element(in.q, (t * in.heads + h) * in.qk + c) * get_element(in.kv, s * in.qk + c);
        logits.push_back(in.scale * dot);
        keys.push_back(s);
      }
      double total = 0.0;
      for (double l : logits) total += std::exp(l);
      set_element(r.lse, t * in.heads + h, std::log(total));
      for (int64_t c = 0; c < in.v; ++c) {
        double acc = 0.0;
        for (size_t i = 0; i < keys.size(); ++i) acc += std::exp(logits[i]) / total * get_element(in.kv, keys[i] * in.qk + c);
        set_element(r.out, (t * in.heads + h) * in.v + c, acc);
      }
    }
  }
  return r;
}

// kv broadcast over heads: the dense attention op's k [tokens, heads, qk] and v [tokens, heads, v].
std::pair<Tensor, Tensor> dense_kv(const Tensor& kv, int64_t heads, int64_t v) {
  const int64_t tokens = kv.size(0), qk = kv.size(1);
  Tensor k({tokens, heads, qk}, kv.dtype()), val({tokens, heads, v}, kv.dtype());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < qk; ++c) set_element(k, (t * heads + h) * qk + c, get_element(kv, t * qk + c));
      for (int64_t c = 0; c < v; ++c) set_element(val, (t * heads + h) * v + c, get_element(kv, t * qk + c));
    }
  return {std::move(k), std::move(val)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// LayerNorm

TEST_CASE("layernorm forward matches the formula (biased variance, eps inside the sqrt)", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  Tensor x = random_tensor({5, 6}, DType::kF64, 1, 0.1, 3.0);
  Tensor w = random_tensor({6}, DType::kF64, 2);
  Tensor b = random_tensor({6}, DType::kF64, 3);
  const double eps = 1e-3;  // large enough to matter
  Tensor y({5, 6}, DType::kF64);
  be->layernorm_forward(LayerNormArgs{y, x, w, b, eps});
  Tensor want({5, 6}, DType::kF64);
  for (int64_t r = 0; r < 5; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < 6; ++c) mean += get_element(x, r * 6 + c) / 6.0;
    for (int64_t c = 0; c < 6; ++c) var += std::pow(get_element(x, r * 6 + c) - mean, 2) / 6.0;
    for (int64_t c = 0; c < 6; ++c)
      set_element(want, r * 6 + c,
                  (get_element(x, r * 6 + c) - mean) / std::sqrt(var + eps) * get_element(w, c) + get_element(b, c));
  }
  check(compare_tensors(y, want, 1e-13, 1e-14, "y"));

  SECTION("in place, and in float") {
    Tensor inplace = copy_as(x, DType::kF64);
    be->layernorm_forward(LayerNormArgs{inplace, inplace, w, b, eps});
    CHECK(bitwise_equal(inplace, y));
    Tensor xf = copy_as(x, DType::kF32), wf = copy_as(w, DType::kF32), bf = copy_as(b, DType::kF32);
    Tensor yf({5, 6}, DType::kF32);
    be->layernorm_forward(LayerNormArgs{yf, xf, wf, bf, eps});
    check(compare_tensors(yf, want, 1e-5, 1e-6, "y (float)"));
  }
}

// ---------------------------------------------------------------------------------------------
// The lightning indexer's top-k

TEST_CASE("indexer top-k equals ranking the definition's scores, per document, padded with -1", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const IndexerInputs in = make_indexer_inputs(kSegments, 3, 4, 10);
  const double scale = 0.3;
  for (int64_t top_k : {1, 3, 4}) {
    INFO("top_k " << top_k);
    Tensor got = run_indexer(*be, in, top_k, scale);
    Tensor want = naive_topk(in, kSegments, top_k, scale);
    CHECK(bitwise_equal(got, want));
  }
  // Spot checks the naive ranking cannot share a bug with: a document's first token keeps only
  // itself; token 7 (second of the last document) has two keys, so with top_k 3 it pads once.
  Tensor got = run_indexer(*be, in, 3, scale);
  CHECK(i32_row(got, 0) == std::vector<int32_t>{0, -1, -1});
  CHECK(i32_row(got, 5) == std::vector<int32_t>{5, -1, -1});
  CHECK(i32_row(got, 7) == std::vector<int32_t>{6, 7, -1});
  // Documents never cross: every selected key lies in the query's own document, at or before it.
  for (size_t seg = 0; seg + 1 < kSegments.size(); ++seg)
    for (int64_t t = kSegments[seg]; t < kSegments[seg + 1]; ++t)
      for (int32_t s : i32_row(got, t)) CHECK((s == -1 || (s >= kSegments[seg] && s <= t)));
  // Scores in float select the same keys here (no near-ties in this draw).
  CHECK(bitwise_equal(run_indexer(*be, in, 3, scale, DType::kF32), got));
}

TEST_CASE("indexer top-k >= the keys available selects all of them", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const IndexerInputs in = make_indexer_inputs(kSegments, 2, 4, 20);
  for (int64_t top_k : {7, 13, 20}) {
    Tensor got = run_indexer(*be, in, top_k, 1.0);
    for (size_t seg = 0; seg + 1 < kSegments.size(); ++seg)
      for (int64_t t = kSegments[seg]; t < kSegments[seg + 1]; ++t) {
        std::vector<int32_t> want;
        for (int64_t s = kSegments[seg]; s <= t; ++s) want.push_back(static_cast<int32_t>(s));
        want.resize(static_cast<size_t>(top_k), -1);
        CHECK(i32_row(got, t) == want);
      }
  }
}

TEST_CASE("indexer ties go to the lower key, relu zeros included", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  // One document of 8 tokens, 2 heads of dim 2, positive head weights.
  IndexerInputs in = make_indexer_inputs({0, 8}, 2, 2, 30);
  for (int64_t i = 0; i < in.weights.numel(); ++i) set_element(in.weights, i, 0.5 + 0.1 * static_cast<double>(i % 3));
  // Every query is (1, 0) in both heads: the score of key s is (w0 + w1) * relu(k[s, 0]).
  for (int64_t i = 0; i < in.q.numel(); ++i) set_element(in.q, i, i % 2 == 0 ? 1.0 : 0.0);
  const std::vector<double> k0 = {0.7, -1.0, 0.7, 0.2, 0.7, -0.5, 0.2, -0.3};
  for (int64_t s = 0; s < 8; ++s) {
    set_element(in.k, s * 2, k0[s]);
    set_element(in.k, s * 2 + 1, 0.3 * static_cast<double>(s));  // differs per key, but q ignores it
  }
  // Query 7 ranks: 0.7 at keys 0, 2, 4; 0.2 at 3, 6; 0 (relu) at 1, 5, 7.
  CHECK(i32_row(run_indexer(*be, in, 2, 1.0), 7) == std::vector<int32_t>{0, 2});
  CHECK(i32_row(run_indexer(*be, in, 4, 1.0), 7) == std::vector<int32_t>{0, 2, 3, 4});
  CHECK(i32_row(run_indexer(*be, in, 6, 1.0), 7) == std::vector<int32_t>{0, 1, 2, 3, 4, 6});
  // Query 5 (keys 0..5): the relu ties at 0 are keys 1 and 5; one of them fits: key 1.
  CHECK(i32_row(run_indexer(*be, in, 5, 1.0), 5) == std::vector<int32_t>{0, 1, 2, 3, 4});
}

TEST_CASE("indexer on packed documents equals each document alone", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const IndexerInputs packed = make_indexer_inputs(kSegments, 2, 3, 40);
  const int64_t top_k = 3;
  Tensor together = run_indexer(*be, packed, top_k, 0.7);
  for (size_t seg = 0; seg + 1 < kSegments.size(); ++seg) {
    const int64_t begin = kSegments[seg], n = kSegments[seg + 1] - begin;
    if (n == 0) continue;
    IndexerInputs alone = make_indexer_inputs({0, static_cast<int32_t>(n)}, 2, 3, 0);
    alone.q = copy_as(packed.q.view().slice_rows(begin, begin + n), DType::kF64);
    alone.k = copy_as(packed.k.view().slice_rows(begin, begin + n), DType::kF64);
    alone.weights = copy_as(packed.weights.view().slice_rows(begin, begin + n), DType::kF64);
    Tensor apart = run_indexer(*be, alone, top_k, 0.7);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> shifted = i32_row(apart, t);
      for (int32_t& s : shifted) s = s < 0 ? -1 : s + static_cast<int32_t>(begin);
      CHECK(i32_row(together, begin + t) == shifted);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sparse attention

TEST_CASE("sparse attention forward matches softmax over the selected keys", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const SparseInputs in = make_sparse_inputs(13, 2, 6, 4, 50);
  const Tensor index = run_indexer(*be, make_indexer_inputs(kSegments, 2, 3, 51), 3, 1.0);
  const SparseOut want = naive_sparse(in, index);
  SparseOut got = sparse_forward(*be, in.q, in.kv, index, in.v, in.scale);
  check(compare_tensors(got.out, want.out, 1e-12, 1e-13, "out"));
  check(compare_tensors(got.lse, want.lse, 1e-12, 1e-13, "lse"));

  SECTION("float agrees with double") {
    SparseOut f = sparse_forward(*be, copy_as(in.q, DType::kF32), copy_as(in.kv, DType::kF32), index, in.v, in.scale);
    check(compare_tensors(f.out, want.out, 1e-5, 1e-6, "out (float)"));
    check(compare_tensors(f.lse, want.lse, 1e-5, 1e-6, "lse (float)"));
  }
  SECTION("a query with no selected key gets 0 and lse -inf") {
    Tensor none = copy_as(index, DType::kI32);
    for (int64_t i = 0; i < none.size(1); ++i) none.ptr<int32_t>()[4 * none.size(1) + i] = -1;
    SparseOut r = sparse_forward(*be, in.q, in.kv, none, in.v, in.scale);
    for (int64_t h = 0; h < in.heads; ++h) {
      CHECK(get_element(r.lse, 4 * in.heads + h) == -std::numeric_limits<double>::infinity());
      for (int64_t c = 0; c < in.v; ++c) CHECK(get_element(r.out, (4 * in.heads + h) * in.v + c) == 0.0);
    }
  }
}

TEST_CASE("sparse attention with top-k >= T is dense causal attention, exactly", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const SparseInputs in = make_sparse_inputs(13, 3, 5, 3, 60);
  Tensor cu = make_i32(kSegments);
  // The indexer's selection at top_k >= T: every key of the query's document up to it.
  const Tensor index = run_indexer(*be, make_indexer_inputs(kSegments, 2, 3, 61), 16, 1.0);
  for (DType dtype : {DType::kF64, DType::kF32}) {
    INFO(dtype_name(dtype));
    Tensor q = copy_as(in.q, dtype), kv = copy_as(in.kv, dtype), dout = copy_as(in.dout, dtype);
    auto [k, v] = dense_kv(kv, in.heads, in.v);
    Tensor out({in.tokens, in.heads, in.v}, dtype), lse({in.tokens, in.heads}, dtype);
    be->attention_forward(AttentionArgs{out, lse, q, k, v, cu, in.scale});
    SparseOut sparse = sparse_forward(*be, q, kv, index, in.v, in.scale);
    CHECK(bitwise_equal(sparse.out, out));
    CHECK(bitwise_equal(sparse.lse, lse));

    // Backward: the same dq; dkv is the dense dk summed over heads plus dv in the value columns.
    Tensor dq(q.shape(), dtype), dk(k.shape(), dtype), dv(v.shape(), dtype);
    be->attention_backward(AttentionBackwardArgs{dq, dk, dv, dout, q, k, v, out, lse, cu, in.scale});
    SparseGrads g = sparse_backward(*be, dout, q, kv, sparse, index, in.scale);
    CHECK(bitwise_equal(g.dq, dq));
    Tensor want_dkv({in.tokens, in.qk}, DType::kF64);
    for (int64_t s = 0; s < in.tokens; ++s)
      for (int64_t c = 0; c < in.qk; ++c) {
        double sum = 0.0;
        for (int64_t h = 0; h < in.heads; ++h) {
          sum += get_element(dk, (s * in.heads + h) * in.qk + c);
          if (c < in.v) sum += get_element(dv, (s * in.heads + h) * in.v + c);
        }
        set_element(want_dkv, s * in.qk + c, sum);
      }
    const double tol = dtype == DType::kF64 ? 1e-12 : 1e-5;
    check(compare_tensors(g.dkv, want_dkv, tol, tol, "dkv"));
  }
}

TEST_CASE("sparse attention backward matches finite differences (dq, and dkv as key and value)", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  SparseInputs in = make_sparse_inputs(13, 2, 6, 4, 70);
  // A real selection: top 3 of up to 7 keys, so some keys are selected by some queries only.
  const Tensor index = run_indexer(*be, make_indexer_inputs(kSegments, 2, 3, 71), 3, 1.0);
  SparseOut fwd = sparse_forward(*be, in.q, in.kv, index, in.v, in.scale);
  SparseGrads g = sparse_backward(*be, in.dout, in.q, in.kv, fwd, index, in.scale);
  auto loss = [&] { return dot(in.dout, sparse_forward(*be, in.q, in.kv, index, in.v, in.scale).out); };
  GradCheckOptions options;
  options.max_elements = 200;  // every element
  check(check_gradient(loss, in.q, g.dq, "q", options));
  check(check_gradient(loss, in.kv, g.dkv, "kv", options));
}

TEST_CASE("sparse attention on packed documents equals each document alone", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const SparseInputs in = make_sparse_inputs(13, 2, 5, 5, 80);  // v_dim == qk_dim: the value is the whole row
  const Tensor index = run_indexer(*be, make_indexer_inputs(kSegments, 2, 3, 81), 2, 1.0);
  SparseOut together = sparse_forward(*be, in.q, in.kv, index, in.v, in.scale);
  SparseGrads together_g = sparse_backward(*be, in.dout, in.q, in.kv, together, index, in.scale);
  for (size_t seg = 0; seg + 1 < kSegments.size(); ++seg) {
    const int64_t begin = kSegments[seg], n = kSegments[seg + 1] - begin;
    if (n == 0) continue;
    Tensor q = copy_as(in.q.view().slice_rows(begin, begin + n), DType::kF64);
    Tensor kv = copy_as(in.kv.view().slice_rows(begin, begin + n), DType::kF64);
    Tensor dout = copy_as(in.dout.view().slice_rows(begin, begin + n), DType::kF64);
    Tensor local = copy_as(index.view().slice_rows(begin, begin + n), DType::kI32);
    for (int64_t i = 0; i < local.numel(); ++i) {
      int32_t& s = local.ptr<int32_t>()[i];
      if (s >= 0) s -= static_cast<int32_t>(begin);
    }
    SparseOut apart = sparse_forward(*be, q, kv, local, in.v, in.scale);
    SparseGrads apart_g = sparse_backward(*be, dout, q, kv, apart, local, in.scale);
    CHECK(bitwise_equal(apart.out, copy_as(together.out.view().slice_rows(begin, begin + n), DType::kF64)));
    CHECK(bitwise_equal(apart_g.dq, copy_as(together_g.dq.view().slice_rows(begin, begin + n), DType::kF64)));
    CHECK(bitwise_equal(apart_g.dkv, copy_as(together_g.dkv.view().slice_rows(begin, begin + n), DType::kF64)));
  }
}

TEST_CASE("indexer and sparse attention with keys of their own equal the whole sequence's rows",
          "[cpu_ops][dsa][context_parallel]") {
  // Documents [0, 2) [2, 7) [7, 13); a context-parallel shard holds queries [4, 11) and sees keys
  // [2, 11): its documents from their starts (cu_seqlens_k), its own key at row t + 2.
  auto be = make_cpu_backend();
  const std::vector<int32_t> whole_cu = {0, 2, 7, 13};
  const int64_t first = 4, last = 11, key_first = 2, top_k = 3;
  const IndexerInputs whole = make_indexer_inputs(whole_cu, 2, 3, 90);
  const Tensor whole_index = run_indexer(*be, whole, top_k, 0.7);

  auto rows = [](const Tensor& t, int64_t begin, int64_t end) { return copy_as(t.view().slice_rows(begin, end), t.dtype()); };
  const Tensor q = rows(whole.q, first, last), weights = rows(whole.weights, first, last);
  const Tensor keys = rows(whole.k, key_first, last);
  const Tensor cu = make_i32({0, 3, 7}), cu_k = make_i32({0, 5, 9});
  Tensor index({last - first, top_k}, DType::kI32);
  be->dsa_indexer_topk(DsaIndexerArgs{index, q, keys, weights, cu, top_k, 0.7, cu_k});
  for (int64_t t = first; t < last; ++t) {
    std::vector<int32_t> want = i32_row(whole_index, t);
    for (int32_t& s : want) s = s < 0 ? -1 : s - static_cast<int32_t>(key_first);
    CHECK(i32_row(index, t - first) == want);
  }

  const SparseInputs in = make_sparse_inputs(13, 2, 5, 4, 91);
  const SparseOut whole_out = sparse_forward(*be, in.q, in.kv, whole_index, in.v, in.scale);
  // The whole sequence's backward with the gradient arriving at the shard's queries only: its dkv
  // is what the shard's queries send to every key.
  Tensor shard_dout = copy_as(in.dout, DType::kF64);
  for (int64_t i = 0; i < shard_dout.numel(); ++i) {
    const int64_t t = i / (in.heads * in.v);
    if (t < first || t >= last) shard_dout.ptr<double>()[i] = 0.0;
  }
  const SparseGrads whole_g = sparse_backward(*be, shard_dout, in.q, in.kv, whole_out, whole_index, in.scale);

  const Tensor sq = rows(in.q, first, last), skv = rows(in.kv, key_first, last), sdout = rows(in.dout, first, last);
  const SparseOut out = sparse_forward(*be, sq, skv, index, in.v, in.scale, first - key_first);
  const SparseGrads g = sparse_backward(*be, sdout, sq, skv, out, index, in.scale, first - key_first);
  CHECK(bitwise_equal(out.out, rows(whole_out.out, first, last)));
  CHECK(bitwise_equal(out.lse, rows(whole_out.lse, first, last)));
  CHECK(bitwise_equal(g.dq, rows(whole_g.dq, first, last)));
  CHECK(bitwise_equal(g.dkv, rows(whole_g.dkv, key_first, last)));
  // A key row past the query's own is refused.
  Tensor late = copy_as(index, DType::kI32);
  late.ptr<int32_t>()[0] = static_cast<int32_t>(first - key_first + 1);
  CHECK_THROWS_AS(sparse_forward(*be, sq, skv, late, in.v, in.scale, first - key_first), Error);
}

// ---------------------------------------------------------------------------------------------
// The attention output gate

TEST_CASE("attention gate: both forms match x * sigmoid(gate); backward matches finite differences",
          "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const int64_t tokens = 4, heads = 3, dim = 2;
  Tensor x = random_tensor({tokens, heads, dim}, DType::kF64, 90, 0.1, 2.0);
  Tensor dy = random_tensor({tokens, heads, dim}, DType::kF64, 91);
  for (bool headwise : {false, true}) {
    INFO((headwise ? "headwise" : "elementwise"));
    Tensor gate = random_tensor(headwise ? Shape{tokens, heads} : Shape{tokens, heads * dim}, DType::kF64, 92, 0.1, 3.0);
    Tensor y({tokens, heads, dim}, DType::kF64);
    be->attention_gate_forward(AttentionGateArgs{y, x, gate, headwise});
    Tensor want({tokens, heads, dim}, DType::kF64);
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double g = get_element(gate, headwise ? i / dim : i);
      set_element(want, i, get_element(x, i) / (1.0 + std::exp(-g)));
    }
    check(compare_tensors(y, want, 1e-14, 1e-15, "y"));

    Tensor dx(x.shape(), DType::kF64), dgate(gate.shape(), DType::kF64);
    be->attention_gate_backward(AttentionGateBackwardArgs{dx, dgate, dy, x, gate, headwise});
    Tensor scratch(x.shape(), DType::kF64);
    auto loss = [&] {
      be->attention_gate_forward(AttentionGateArgs{scratch, x, gate, headwise});
      return dot(dy, scratch);
    };
    check(check_gradient(loss, x, dx, "x"));
    check(check_gradient(loss, gate, dgate, "gate"));

    // In place: y over x, and dx over dy.
    Tensor inplace = copy_as(x, DType::kF64);
    be->attention_gate_forward(AttentionGateArgs{inplace, inplace, gate, headwise});
    CHECK(bitwise_equal(inplace, y));
    Tensor dy_inplace = copy_as(dy, DType::kF64), dgate2(gate.shape(), DType::kF64);
    be->attention_gate_backward(AttentionGateBackwardArgs{dy_inplace, dgate2, dy_inplace, x, gate, headwise});
    CHECK(bitwise_equal(dy_inplace, dx));
    CHECK(bitwise_equal(dgate2, dgate));
  }
}

// ---------------------------------------------------------------------------------------------
// Argument errors

TEST_CASE("dsa ops reject bad shapes and selections, naming the op and the tensor", "[cpu_ops][dsa]") {
  auto be = make_cpu_backend();
  const SparseInputs in = make_sparse_inputs(13, 2, 6, 4, 100);
  const IndexerInputs ix = make_indexer_inputs(kSegments, 2, 3, 101);
  Tensor index = run_indexer(*be, ix, 3, 1.0);
  auto sparse_error = [&](const Tensor& q, const Tensor& kv, const Tensor& idx, int64_t v) {
    return error_message([&] { sparse_forward(*be, q, kv, idx, v, 1.0); });
  };

  std::string m = sparse_error(in.q, Tensor({13, 5}, DType::kF64), index, 4);
  CHECK(contains(m, "sparse_attention_forward"));
  CHECK(contains(m, "kv"));
  CHECK(contains(sparse_error(in.q, in.kv, index, 7), "v_dim <= qk_dim"));
  CHECK(contains(sparse_error(in.q, in.kv, Tensor({12, 3}, DType::kI32), 4), "topk_index"));

  Tensor future = copy_as(index, DType::kI32);
  future.ptr<int32_t>()[2 * 3 + 1] = 3;  // query 2 may not see key 3
  m = sparse_error(in.q, in.kv, future, 4);
  CHECK(contains(m, "topk_index[2, 1] = 3"));
  Tensor unsorted = copy_as(index, DType::kI32);
  std::swap(unsorted.ptr<int32_t>()[12 * 3], unsorted.ptr<int32_t>()[12 * 3 + 1]);
  CHECK(contains(sparse_error(in.q, in.kv, unsorted, 4), "strictly ascending"));
  Tensor gap = copy_as(index, DType::kI32);
  gap.ptr<int32_t>()[0 * 3 + 2] = 0;  // query 0 lists key 0, then -1, then 0 again
  CHECK(contains(sparse_error(in.q, in.kv, gap, 4), "only -1"));

  SparseOut fwd = sparse_forward(*be, in.q, in.kv, index, in.v, 1.0);
  Tensor dq(in.q.shape(), DType::kF64), bad_dkv({13, 4}, DType::kF64);
  m = error_message([&] {
    be->sparse_attention_backward(
        SparseAttentionBackwardArgs{dq, bad_dkv, in.dout, in.q, in.kv, fwd.out, fwd.lse, index, 1.0});
  });
  CHECK(contains(m, "sparse_attention_backward"));
  CHECK(contains(m, "dkv"));

  Tensor out({13, 3}, DType::kI32);
  m = error_message([&] {
    be->dsa_indexer_topk(DsaIndexerArgs{out, ix.q, ix.k, Tensor({13, 3}, DType::kF64), ix.cu_seqlens, 3, 1.0});
  });
  CHECK(contains(m, "dsa_indexer_topk"));
  CHECK(contains(m, "weights"));
  m = error_message([&] {
    be->dsa_indexer_topk(DsaIndexerArgs{out, ix.q, ix.k, ix.weights, make_i32({0, 5, 12}), 3, 1.0});
  });
  CHECK(contains(m, "cu_seqlens"));
  CHECK(contains(error_message([&] {
                   be->dsa_indexer_topk(DsaIndexerArgs{Tensor({13, 3}, DType::kF64), ix.q, ix.k, ix.weights,
                                                       ix.cu_seqlens, 3, 1.0});
                 }),
                 "topk_index"));

  Tensor x({5, 6}, DType::kF64), w({6}, DType::kF64);
  m = error_message([&] { be->layernorm_forward(LayerNormArgs{x, x, w, Tensor({5}, DType::kF64), 1e-6}); });
  CHECK(contains(m, "layernorm_forward"));
  CHECK(contains(m, "bias"));

  Tensor gx({4, 3, 2}, DType::kF64);
  m = error_message([&] { be->attention_gate_forward(AttentionGateArgs{gx, gx, Tensor({4, 6}, DType::kF64), true}); });
  CHECK(contains(m, "attention_gate_forward"));
  CHECK(contains(m, "gate"));
  CHECK(contains(m, "headwise"));
  m = error_message([&] {
    be->attention_gate_backward(
        AttentionGateBackwardArgs{gx, Tensor({4, 3}, DType::kF64), gx, gx, Tensor({4, 6}, DType::kF64), false});
  });
  CHECK(contains(m, "attention_gate_backward"));
  CHECK(contains(m, "dgate"));
}
