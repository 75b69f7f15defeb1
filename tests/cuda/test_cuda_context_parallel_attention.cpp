// The attention ops of context parallelism on CUDA against the CPU reference: dense attention with
// key segments of their own (AttentionArgs::cu_seqlens_k, bottom-right causal alignment), the DSA
// indexer with cu_seqlens_k and sparse attention with key_offset != 0. Per op, first direct
// comparisons over several (query, key) segment layouts with q_len < k_len and q_len == k_len and
// lengths not multiples of any tile, at the models' head dims (128/128, MLA's 192/128); then the
// property context parallelism rests on: a query shard run against [earlier keys of its documents
// + its own] gives the rows of the full causal run (and its key gradients, summed over the
// shards, the full run's). Dense attention with cu_seqlens_k runs on the SIMT kernels
// (kernels/cuda/attention/attention.cu says why); the sparse attention at the latent dims on the
// Hopper kernels where the device has them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

// Rows [begin, end) of a host F64 tensor (first dimension), as a new operand in `dtype`.
Operand rows_of(const Operand& full, int64_t begin, int64_t end, DType dtype) {
  Shape shape = full.host.shape();
  const int64_t row = full.host.numel() / shape[0];
  shape[0] = end - begin;
  Tensor host(shape, DType::kF64);
  std::memcpy(host.ptr<double>(), full.host.ptr<double>() + begin * row,
              static_cast<size_t>((end - begin) * row) * sizeof(double));
  return operand_from_host(std::move(host), dtype);
}

// Host F64 rows [begin, end) of a host tensor.
Tensor host_rows(const Tensor& full, int64_t begin, int64_t end) {
  Shape shape = full.shape();
  const int64_t row = full.numel() / shape[0];
  shape[0] = end - begin;
  Tensor out(shape, DType::kF64);
  std::memcpy(out.ptr<double>(), full.ptr<double>() + begin * row, static_cast<size_t>((end - begin) * row) * sizeof(double));
  return out;
}

// A query shard [begin, end) of documents `cu_full`: its query segments (local offsets), its key
// segments (every key of each document it touches up to `end`, local to key_begin) and the first
// key row of the full sequence its keys start at.
struct Shard {
  std::vector<int32_t> cu_q, cu_k;
  int64_t key_begin = 0;
};

Shard shard_of(const std::vector<int32_t>& cu_full, int32_t begin, int32_t end) {
  Shard s;
  s.cu_q = {0};
  s.cu_k = {0};
  bool first = true;
  for (size_t d = 0; d + 1 < cu_full.size(); ++d) {
    const int32_t ds = cu_full[d], de = cu_full[d + 1];
    if (de <= begin || ds >= end || ds == de) continue;
    if (first) s.key_begin = ds;
    first = false;
    s.cu_q.push_back(std::min(de, end) - begin);
    s.cu_k.push_back(std::min(de, end) - static_cast<int32_t>(s.key_begin));
  }
  return s;
}

std::string layout_label(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k) {
  std::string k = "cu_seqlens_k";
  for (int32_t b : cu_k) k += " " + std::to_string(b);
  return cu_seqlens_label(cu_q) + ", " + k;
}

// ---------------------------------------------------------------------------------------------
// Dense attention

struct DenseProblem {
  Operand q, k, v, dout, cu, cu_k;
  Operand out, lse, dq, dk, dv;
  double scale = 1.0;
  bool own_keys = true;
};

DenseProblem dense_problem(Operand q, Operand k, Operand v, Operand dout, const std::vector<int32_t>& cu_q,
                           const std::vector<int32_t>& cu_k, DType dtype) {
  DenseProblem p;
  const Shape qs = q.host.shape(), ks = k.host.shape(), vs = v.host.shape();
  p.scale = 1.0 / std::sqrt(static_cast<double>(qs[2]));
  p.out = output_operand({qs[0], qs[1], vs[2]}, dtype);
  p.lse = output_operand({qs[0], qs[1]}, DType::kF32);
  p.dq = output_operand(qs, dtype);
  p.dk = output_operand(ks, dtype);
  p.dv = output_operand(vs, dtype);
  p.q = std::move(q);
  p.k = std::move(k);
  p.v = std::move(v);
  p.dout = std::move(dout);
  p.cu = cu_seqlens_operand(cu_q);
  p.cu_k = cu_seqlens_operand(cu_k);
  return p;
}

kernels::AttentionArgs dense_forward_args(BackendSide on, const DenseProblem& p) {
  kernels::AttentionArgs args{on(p.out), on(p.lse), on(p.q), on(p.k), on(p.v), on(p.cu), p.scale};
  if (p.own_keys) args.cu_seqlens_k = on(p.cu_k);
  return args;
}

kernels::AttentionBackwardArgs dense_backward_args(BackendSide on, const DenseProblem& p) {
  kernels::AttentionBackwardArgs args{on(p.dq), on(p.dk),  on(p.dv),  on(p.dout), on(p.q), on(p.k),
                                      on(p.v),  on(p.out), on(p.lse), on(p.cu),   p.scale};
  if (p.own_keys) args.cu_seqlens_k = on(p.cu_k);
  return args;
}

// Forward on both backends, then the backward from the CPU's out and lse as the device stores them.
void run_dense_both(DenseProblem& p, DType dtype) {
  gpu().attention_forward(dense_forward_args(kGpu, p));
  cpu().attention_forward(dense_forward_args(kCpu, p));
  CUDA_TEST_EXPECT_CLOSE(p.out.dev, p.out.host.view(), tolerance_for(dtype), "out");
  CUDA_TEST_EXPECT_CLOSE(p.lse.dev, p.lse.host.view(), tolerance_for(DType::kF32), "lse");
  round_and_upload(p.out, dtype);
  round_and_upload(p.lse, DType::kF32);
  gpu().attention_backward(dense_backward_args(kGpu, p));
  cpu().attention_backward(dense_backward_args(kCpu, p));
  CUDA_TEST_EXPECT_CLOSE(p.dq.dev, p.dq.host.view(), tolerance_for(dtype), "dq");
  CUDA_TEST_EXPECT_CLOSE(p.dk.dev, p.dk.host.view(), tolerance_for(dtype), "dk");
  CUDA_TEST_EXPECT_CLOSE(p.dv.dev, p.dv.host.view(), tolerance_for(dtype), "dv");
}

struct KeySegmentLayout {
  std::vector<int32_t> cu_q, cu_k;
};

// q_len < k_len, q_len == k_len, an empty query segment whose keys nobody sees, a length-1 query
// segment, lengths not multiples of the 64/32 tiles, a key segment over several tiles.
const std::vector<KeySegmentLayout> kKeyLayouts = {
    {{0, 37, 100, 101}, {0, 90, 153, 170}},        // 37 of 90, 63 of 63, 1 of 17
    {{0, 0, 45, 140}, {0, 33, 130, 300}},          // keys no query sees, 45 of 97, 95 of 170
    {{0, 129}, {0, 257}},                          // one shard's queries after 128 earlier keys
};

TEST_CASE("cuda attention with key segments matches the CPU reference", "[cuda][context_parallel]") {
  struct Dims {
    int64_t heads, qk_dim, v_dim;
  };
  for (const Dims& d : {Dims{2, 128, 128}, Dims{3, 192, 128}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (size_t i = 0; i < kKeyLayouts.size(); ++i) {
        const KeySegmentLayout& l = kKeyLayouts[i];
        INFO(std::string(dtype_name(dtype)) + " heads " + std::to_string(d.heads) + " dims " +
             std::to_string(d.qk_dim) + "/" + std::to_string(d.v_dim) + " " + layout_label(l.cu_q, l.cu_k));
        const int64_t tokens = l.cu_q.back(), keys = l.cu_k.back();
        const uint64_t seed = 700 + 10 * i;
        DenseProblem p = dense_problem(random_operand({tokens, d.heads, d.qk_dim}, dtype, seed, 0.05, 2.0),
                                       random_operand({keys, d.heads, d.qk_dim}, dtype, seed + 1, 0.05, 2.0),
                                       random_operand({keys, d.heads, d.v_dim}, dtype, seed + 2, 0.05, 1.0),
                                       random_operand({tokens, d.heads, d.v_dim}, dtype, seed + 3, 0.05, 1.0),
                                       l.cu_q, l.cu_k, dtype);
        run_dense_both(p, dtype);
      }
    }
  }
}

// Adds the host F64 rows `part` into rows [begin, ...) of `sum`.
void add_rows(Tensor& sum, const Tensor& part, int64_t begin) {
  const int64_t row = sum.numel() / sum.shape()[0];
  double* dst = sum.ptr<double>() + begin * row;
  for (int64_t i = 0; i < part.numel(); ++i) dst[i] += part.ptr<double>()[i];
}

TEST_CASE("cuda attention over query shards equals the full causal run", "[cuda][context_parallel]") {
  // Two documents, the first ending inside shard 1 (not on a shard boundary), shards of unequal
  // lengths that are no multiple of any tile.
  const std::vector<int32_t> cu_full = {0, 150, 301};
  const std::vector<int32_t> shard_ends = {0, 97, 211, 301};
  const int64_t tokens = cu_full.back(), heads = 2, qk_dim = 192, v_dim = 128;
  const DType dtype = DType::kF32;
  const Operand q = random_operand({tokens, heads, qk_dim}, dtype, 801, 0.05, 2.0);
  const Operand k = random_operand({tokens, heads, qk_dim}, dtype, 802, 0.05, 2.0);
  const Operand v = random_operand({tokens, heads, v_dim}, dtype, 803, 0.05, 1.0);
  const Operand dout = random_operand({tokens, heads, v_dim}, dtype, 804, 0.05, 1.0);

  // The full causal run on the CPU (no cu_seqlens_k).
  DenseProblem full = dense_problem(rows_of(q, 0, tokens, dtype), rows_of(k, 0, tokens, dtype),
                                    rows_of(v, 0, tokens, dtype), rows_of(dout, 0, tokens, dtype), cu_full, cu_full,
                                    dtype);
  full.own_keys = false;
  cpu().attention_forward(dense_forward_args(kCpu, full));
  cpu().attention_backward(dense_backward_args(kCpu, full));

  Tensor dk_sum = Tensor::zeros(k.host.shape(), DType::kF64), dv_sum = Tensor::zeros(v.host.shape(), DType::kF64);
  for (size_t i = 0; i + 1 < shard_ends.size(); ++i) {
    const int32_t begin = shard_ends[i], end = shard_ends[i + 1];
    const Shard s = shard_of(cu_full, begin, end);
    INFO("shard [" + std::to_string(begin) + ", " + std::to_string(end) + ") " + layout_label(s.cu_q, s.cu_k));
    DenseProblem p = dense_problem(rows_of(q, begin, end, dtype), rows_of(k, s.key_begin, end, dtype),
                                   rows_of(v, s.key_begin, end, dtype), rows_of(dout, begin, end, dtype), s.cu_q,
                                   s.cu_k, dtype);
    gpu().attention_forward(dense_forward_args(kGpu, p));
    CUDA_TEST_EXPECT_CLOSE(p.out.dev, host_rows(full.out.host, begin, end).view(), tolerance_for(dtype), "out rows");
    CUDA_TEST_EXPECT_CLOSE(p.lse.dev, host_rows(full.lse.host, begin, end).view(), tolerance_for(DType::kF32),
                           "lse rows");
    p.out = rows_of(full.out, begin, end, dtype);
    p.lse = rows_of(full.lse, begin, end, DType::kF32);
    gpu().attention_backward(dense_backward_args(kGpu, p));
    CUDA_TEST_EXPECT_CLOSE(p.dq.dev, host_rows(full.dq.host, begin, end).view(), tolerance_for(dtype), "dq rows");
    add_rows(dk_sum, download(p.dk.dev), s.key_begin);
    add_rows(dv_sum, download(p.dv.dev), s.key_begin);
  }
  const Result dk = compare(dk_sum.view(), full.dk.host.view(), tolerance_for(dtype), "dk summed over the shards");
  const Result dv = compare(dv_sum.view(), full.dv.host.view(), tolerance_for(dtype), "dv summed over the shards");
  INFO(dk.message + "\n" + dv.message);
  CHECK(dk.ok);
  CHECK(dv.ok);
}

// A shard's queries against its visible keys in chunks (AttentionArgs::key_shift), folded by
// attention_merge, as a context-parallel MLA layer runs them (core/model/mla_context_parallel.h):
// each chunk's forward, the merged out and lse, and each chunk's backward from the merged ones,
// on the GPU against the CPU. 101 queries (keys 129..229) of documents [0, 90), [90, 200), [200,
// 230) of the keys: the first document has no query, and chunks of 48 and 77 keys (no tile
// multiple) leave some queries with no key of a chunk (out 0, lse -inf, which the merge skips).
TEST_CASE("cuda attention over key chunks with attention_merge matches the CPU reference",
          "[cuda][context_parallel]") {
  const std::vector<int32_t> cu_k = {0, 90, 200, 230}, cu_q = {0, 0, 71, 101};
  const int64_t keys = 230, tokens = 101, heads = 2, qk_dim = 192, v_dim = 128;
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Operand q = random_operand({tokens, heads, qk_dim}, dtype, 901, 0.05, 2.0);
    const Operand k = random_operand({keys, heads, qk_dim}, dtype, 902, 0.05, 2.0);
    const Operand v = random_operand({keys, heads, v_dim}, dtype, 903, 0.05, 1.0);
    const Operand dout = random_operand({tokens, heads, v_dim}, dtype, 904, 0.05, 1.0);
    const Operand cu = cu_seqlens_operand(cu_q);
    const double scale = 1.0 / std::sqrt(static_cast<double>(qk_dim));
    for (const int64_t chunk : {48, 77}) {
      INFO(std::string(dtype_name(dtype)) + ", chunks of " + std::to_string(chunk) + " keys");
      Tensor lse_start({tokens, heads}, DType::kF64);
      std::fill(lse_start.ptr<double>(), lse_start.ptr<double>() + lse_start.numel(), -inf);
      Operand out = operand_from_host(Tensor::zeros({tokens, heads, v_dim}, DType::kF64), dtype);
      Operand lse = operand_from_host(std::move(lse_start), DType::kF32);
      auto for_each_chunk = [&](auto&& body) {
        for (int64_t from = 0; from < keys; from += chunk) {
          const int64_t to = std::min(from + chunk, keys);
          std::vector<int32_t> segments = cu_k;
          for (int32_t& c : segments) c = static_cast<int32_t>(std::clamp<int64_t>(c, from, to) - from);
          body(rows_of(k, from, to, dtype), rows_of(v, from, to, dtype), cu_seqlens_operand(segments),
               keys - tokens - from);
        }
      };
      for_each_chunk([&](const Operand& ck, const Operand& cv, const Operand& ccu, int64_t shift) {
        Operand chunk_out = output_operand({tokens, heads, v_dim}, dtype);
        Operand chunk_lse = output_operand({tokens, heads}, DType::kF32);
        for (BackendSide on : {kGpu, kCpu}) {
          (on.device ? gpu() : cpu())
              .attention_forward({on(chunk_out), on(chunk_lse), on(q), on(ck), on(cv), on(cu), scale, on(ccu), shift});
        }
        CUDA_TEST_EXPECT_CLOSE(chunk_out.dev, chunk_out.host.view(), tolerance_for(dtype), "chunk out");
        for (BackendSide on : {kGpu, kCpu}) {
          (on.device ? gpu() : cpu()).attention_merge({on(out), on(lse), on(chunk_out), on(chunk_lse)});
        }
      });
      CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tolerance_for(dtype), "merged out");
      CUDA_TEST_EXPECT_CLOSE(lse.dev, lse.host.view(), tolerance_for(DType::kF32), "merged lse");
      round_and_upload(out, dtype);
      round_and_upload(lse, DType::kF32);
      for_each_chunk([&](const Operand& ck, const Operand& cv, const Operand& ccu, int64_t shift) {
        Operand dq = output_operand(q.host.shape(), dtype), dk = output_operand(ck.host.shape(), dtype);
        Operand dv = output_operand(cv.host.shape(), dtype);
        for (BackendSide on : {kGpu, kCpu}) {
          (on.device ? gpu() : cpu())
              .attention_backward({on(dq), on(dk), on(dv), on(dout), on(q), on(ck), on(cv), on(out), on(lse), on(cu),
                                   scale, on(ccu), shift});
        }
        CUDA_TEST_EXPECT_CLOSE(dq.dev, dq.host.view(), tolerance_for(dtype), "chunk dq");
        CUDA_TEST_EXPECT_CLOSE(dk.dev, dk.host.view(), tolerance_for(dtype), "chunk dk");
        CUDA_TEST_EXPECT_CLOSE(dv.dev, dv.host.view(), tolerance_for(dtype), "chunk dv");
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// DSA indexer

// Values from a small grid exact in BF16, so that many scores tie and the GPU's F32 sums equal the
// CPU's: the selections must then be equal, ties to the lower key included.
Operand grid_values(Shape shape, DType dtype, uint64_t seed, const std::vector<double>& grid) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, grid.size() - 1);
  Tensor host(shape, DType::kF64);
  for (int64_t i = 0; i < host.numel(); ++i) host.ptr<double>()[i] = grid[pick(rng)];
  return operand_from_host(std::move(host), dtype);
}

struct IndexerProblem {
  Operand q, k, w;
  int64_t heads = 0, dim = 0;
};

IndexerProblem indexer_problem(int64_t tokens, int64_t heads, int64_t dim, DType dtype, uint64_t seed) {
  const std::vector<double> grid = {-1.0, -0.5, 0.0, 0.5, 1.0};
  return {grid_values({tokens, heads, dim}, dtype, seed, grid), grid_values({tokens, dim}, dtype, seed + 1, grid),
          grid_values({tokens, heads}, DType::kF32, seed + 2, {-1.0, -0.25, 0.25, 0.5, 1.0}), heads, dim};
}

double indexer_scale(const IndexerProblem& p) { return 1.0 / std::sqrt(static_cast<double>(p.heads * p.dim)); }

// The selection of queries q (with weights w) over keys k on one backend; cu_k empty: none.
Tensor indexer_select(BackendSide on, const Operand& q, const Operand& k, const Operand& w, const std::vector<int32_t>& cu_q,
              const std::vector<int32_t>& cu_k, int64_t top_k, double scale) {
  const Operand cu = cu_seqlens_operand(cu_q);
  const Operand cu_keys = cu_seqlens_operand(cu_k.empty() ? cu_q : cu_k);
  const int64_t tokens = cu_q.back();
  Tensor out = on.device ? poisoned({tokens, top_k}, DType::kI32) : Tensor({tokens, top_k}, DType::kI32);
  kernels::DsaIndexerArgs args{out, on(q), on(k), on(w), on(cu), top_k, scale};
  if (!cu_k.empty()) args.cu_seqlens_k = on(cu_keys);
  (on.device ? gpu() : cpu()).dsa_indexer_topk(args);
  return out;
}

TEST_CASE("cuda dsa_indexer_topk with key segments equals the CPU reference", "[cuda][context_parallel]") {
  struct Dims {
    int64_t heads, dim, top_k;
  };
  // DeepSeek-V3.2's indexer (64 heads, dim 128) and a small odd one; top_k below and above the
  // keys some queries see.
  for (const Dims& d : {Dims{64, 128, 48}, Dims{3, 20, 9}}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (size_t i = 0; i < kKeyLayouts.size(); ++i) {
        const KeySegmentLayout& l = kKeyLayouts[i];
        INFO(std::string(dtype_name(dtype)) + " heads " + std::to_string(d.heads) + " dim " + std::to_string(d.dim) +
             " top_k " + std::to_string(d.top_k) + " " + layout_label(l.cu_q, l.cu_k));
        const IndexerProblem p = indexer_problem(l.cu_k.back(), d.heads, d.dim, dtype, 900 + 10 * i);
        const Operand q = rows_of(p.q, 0, l.cu_q.back(), dtype), w = rows_of(p.w, 0, l.cu_q.back(), DType::kF32);
        const double scale = indexer_scale(p);
        const Tensor expected = indexer_select(kCpu, q, p.k, w, l.cu_q, l.cu_k, d.top_k, scale);
        const Tensor got = indexer_select(kGpu, q, p.k, w, l.cu_q, l.cu_k, d.top_k, scale);
        expect_same_ints(got, expected, "topk_index");
      }
    }
  }
}

TEST_CASE("cuda dsa_indexer_topk over query shards equals the full causal run", "[cuda][context_parallel]") {
  const std::vector<int32_t> cu_full = {0, 150, 301};
  const std::vector<int32_t> shard_ends = {0, 97, 211, 301};
  const int64_t tokens = cu_full.back(), top_k = 40;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dtype));
    const IndexerProblem p = indexer_problem(tokens, 16, 128, dtype, 950);
    const double scale = indexer_scale(p);
    const Tensor full = indexer_select(kCpu, p.q, p.k, p.w, cu_full, {}, top_k, scale);
    for (size_t i = 0; i + 1 < shard_ends.size(); ++i) {
      const int32_t begin = shard_ends[i], end = shard_ends[i + 1];
      const Shard s = shard_of(cu_full, begin, end);
      INFO("shard [" + std::to_string(begin) + ", " + std::to_string(end) + ") " + layout_label(s.cu_q, s.cu_k));
      const Tensor got = indexer_select(kGpu, rows_of(p.q, begin, end, dtype), rows_of(p.k, s.key_begin, end, dtype),
                                rows_of(p.w, begin, end, DType::kF32), s.cu_q, s.cu_k, top_k, scale);
      // The shard lists rows of its keys: shifted by key_begin they are the full run's rows.
      Tensor expected({end - begin, top_k}, DType::kI32);
      for (int64_t e = 0; e < expected.numel(); ++e) {
        const int32_t row = full.ptr<int32_t>()[begin * top_k + e];
        expected.ptr<int32_t>()[e] = row < 0 ? -1 : row - static_cast<int32_t>(s.key_begin);
      }
      expect_same_ints(got, expected, "topk_index rows");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sparse attention with key_offset

struct SparseProblem {
  Operand q, kv, index, dout;
  Operand out, lse, dq, dkv;
  double scale = 1.0;
  int64_t key_offset = 0;
};

kernels::SparseAttentionArgs sparse_forward_args(BackendSide on, const SparseProblem& p) {
  return kernels::SparseAttentionArgs{on(p.out), on(p.lse), on(p.q), on(p.kv), on(p.index), p.scale, p.key_offset};
}

kernels::SparseAttentionBackwardArgs sparse_backward_args(BackendSide on, const SparseProblem& p) {
  return kernels::SparseAttentionBackwardArgs{on(p.dq),  on(p.dkv), on(p.dout),  on(p.q),  on(p.kv),
                                              on(p.out), on(p.lse), on(p.index), p.scale, p.key_offset};
}

// Queries [begin, end) of a full problem (q, kv, dout, the full run's selection), reading kv rows
// [0, end) with key_offset = begin: a context-parallel shard's sparse attention.
SparseProblem sparse_shard(const Operand& q, const Operand& kv, const Operand& dout, const Tensor& full_index,
                           int64_t begin, int64_t end, DType dtype) {
  SparseProblem p;
  p.q = rows_of(q, begin, end, dtype);
  p.kv = rows_of(kv, 0, end, dtype);
  p.dout = rows_of(dout, begin, end, dtype);
  const int64_t top_k = full_index.shape()[1];
  std::vector<int32_t> index(full_index.ptr<int32_t>() + begin * top_k, full_index.ptr<int32_t>() + end * top_k);
  p.index = int_operand(index, Shape{end - begin, top_k});
  const Shape qs = p.q.host.shape();
  const int64_t v_dim = dout.host.shape()[2];
  p.out = output_operand({qs[0], qs[1], v_dim}, dtype);
  p.lse = output_operand({qs[0], qs[1]}, DType::kF32);
  p.dq = output_operand(qs, dtype);
  p.dkv = output_operand(p.kv.host.shape(), dtype);
  p.scale = 1.0 / std::sqrt(static_cast<double>(qs[2]));
  p.key_offset = begin;
  return p;
}

// A selection of the full causal run over documents cu_full: the CPU indexer on random inputs.
Tensor full_selection(const std::vector<int32_t>& cu_full, int64_t top_k, uint64_t seed) {
  const int64_t tokens = cu_full.back();
  const Operand q = random_operand({tokens, 4, 16}, DType::kF32, seed, 0.05, 1.0);
  const Operand k = random_operand({tokens, 16}, DType::kF32, seed + 1, 0.05, 1.0);
  const Operand w = random_operand({tokens, 4}, DType::kF32, seed + 2, 0.05, 1.0);
  return indexer_select(kCpu, q, k, w, cu_full, {}, top_k, 0.125);
}

TEST_CASE("cuda sparse attention with key_offset matches the CPU and the full causal run",
          "[cuda][context_parallel]") {
  struct Dims {
    int64_t heads, qk_dim, v_dim, top_k;
  };
  const std::vector<int32_t> cu_full = {0, 150, 301};
  const std::vector<int32_t> shard_ends = {0, 97, 211, 301};
  const int64_t tokens = cu_full.back();
  // MLA's q/k 192 / v 128 and the latent 576 / 512 (the Hopper kernels for BF16 on sm_90).
  for (const Dims& d : {Dims{3, 192, 128, 24}, Dims{16, 576, 512, 40}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      INFO(std::string(dtype_name(dtype)) + " heads " + std::to_string(d.heads) + " dims " +
           std::to_string(d.qk_dim) + "/" + std::to_string(d.v_dim) + " top_k " + std::to_string(d.top_k));
      const Operand q = random_operand({tokens, d.heads, d.qk_dim}, dtype, 1001, 0.05, 3.0);
      const Operand kv = random_operand({tokens, d.qk_dim}, dtype, 1002, 0.05, 1.0);
      const Operand dout = random_operand({tokens, d.heads, d.v_dim}, dtype, 1003, 0.1, 1.0);
      const Tensor index = full_selection(cu_full, d.top_k, 1004);
      SparseProblem full = sparse_shard(q, kv, dout, index, 0, tokens, dtype);
      cpu().sparse_attention_forward(sparse_forward_args(kCpu, full));
      cpu().sparse_attention_backward(sparse_backward_args(kCpu, full));

      Tensor dkv_sum = Tensor::zeros(kv.host.shape(), DType::kF64);
      for (size_t i = 0; i + 1 < shard_ends.size(); ++i) {
        const int64_t begin = shard_ends[i], end = shard_ends[i + 1];
        INFO("shard [" + std::to_string(begin) + ", " + std::to_string(end) + "), key_offset " + std::to_string(begin));
        SparseProblem p = sparse_shard(q, kv, dout, index, begin, end, dtype);
        gpu().sparse_attention_forward(sparse_forward_args(kGpu, p));
        cpu().sparse_attention_forward(sparse_forward_args(kCpu, p));
        CUDA_TEST_EXPECT_CLOSE(p.out.dev, p.out.host.view(), tolerance_for(dtype), "out");
        CUDA_TEST_EXPECT_CLOSE(p.lse.dev, p.lse.host.view(), tolerance_for(DType::kF32), "lse");
        CUDA_TEST_EXPECT_CLOSE(p.out.dev, host_rows(full.out.host, begin, end).view(), tolerance_for(dtype),
                               "out rows of the full run");
        round_and_upload(p.out, dtype);
        round_and_upload(p.lse, DType::kF32);
        gpu().sparse_attention_backward(sparse_backward_args(kGpu, p));
        cpu().sparse_attention_backward(sparse_backward_args(kCpu, p));
        // dq sums top_k products of 576-wide BF16 rows whose terms cancel: on the H200 a handful of
        // its smallest elements sit past the element-wise BF16 bound while its relative L2 error
        // stays at half the bound, so its absolute floor is 5e-3 of the largest value.
        Tolerance dq_tolerance = tolerance_for(dtype);
        if (dtype == DType::kBF16) dq_tolerance.atol_fraction = 5e-3;
        CUDA_TEST_EXPECT_CLOSE(p.dq.dev, p.dq.host.view(), dq_tolerance, "dq");
        CUDA_TEST_EXPECT_CLOSE(p.dkv.dev, p.dkv.host.view(), tolerance_for(dtype), "dkv");
        add_rows(dkv_sum, download(p.dkv.dev), 0);
      }
      const Result sum =
          compare(dkv_sum.view(), full.dkv.host.view(), tolerance_for(dtype), "dkv summed over the shards");
      INFO(sum.message);
      CHECK(sum.ok);
    }
  }
}

}  // namespace
