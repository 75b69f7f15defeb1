// CUDA DSA ops against the CPU reference (F64) on the same inputs: the indexer key's LayerNorm, the
// attention output gate (elementwise and headwise, forward and backward, in place), the lightning
// indexer's top-k and sparse attention forward/backward.
//   - Indexer, exact: q, k and head weights on a coarse dyadic grid, so every score is exact in F32
//     as in F64 and ties (zero scores above all) are frequent; the selection must equal the
//     reference's index for index (ties to the lower key) on both the tensor-core (BF16) and the
//     SIMT (F32) paths, with packed segments, top_k above the keys available, head counts and dims
//     that need padding, and a forced small chunk (the chunk loop).
//   - Indexer, random values: the selection must be a top-k of the F64 scores up to the F32
//     rounding of the scores (every chosen key within tol of the k-th best, every other below it
//     plus tol); rows past 16384 keys take the selection's global-memory path.
//   - Sparse attention: indices from the reference indexer; out, lse, dq, dkv within the output
//     dtype's tolerance; the backward is bitwise repeatable and bitwise the same with its dkv
//     contributions in small chunks. At the latent dims 576 / 512 the Hopper kernels and the SIMT
//     ones (MOETRAIN_SPARSE_ATTENTION=simt) each against the CPU, forward and backward: packed
//     documents, block tails, -1 selections, top_k above the keys, more heads than one CTA (two
//     head groups adding to the same dkv contributions), an empty selection.
// Outputs are poisoned first (NaN, or -1 bytes for indices). Tagged [.bench]: timings at
// DeepSeek-V3.2 shapes (run with `test_cuda_dsa "[.bench]"`).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "kernels/cuda/dsa/dsa_indexer.h"
#include "kernels/cuda/dsa/sparse_attention.h"
#include "kernels/cuda/common/scratch.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

cudaStream_t gpu_stream() { return static_cast<cudaStream_t>(gpu().stream()); }

std::string label(DType dtype, const std::string& what) { return std::string(dtype_name(dtype)) + " " + what; }

// ---------------------------------------------------------------------------------------------
// LayerNorm and the output gate

TEST_CASE("cuda layernorm_forward matches the CPU reference", "[cuda][dsa]") {
  struct Case {
    int64_t rows, dim;
    bool in_place;
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Case c : {Case{37, 128, false}, Case{5, 7, false}, Case{3, 1000, false}, Case{17, 128, true}}) {
      INFO(label(dtype, "rows " + std::to_string(c.rows) + " dim " + std::to_string(c.dim) +
                            (c.in_place ? " in place" : "")));
      Operand x = random_operand({c.rows, c.dim}, dtype, 11 + c.dim, 0.1, 2.0);
      // A common offset per row, so that the mean matters.
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t j = 0; j < c.dim; ++j) x.host.ptr<double>()[r * c.dim + j] += 0.25 * static_cast<double>(r % 5);
      round_and_upload(x, dtype);
      Operand weight = random_operand({c.dim}, dtype, 12, 0.5, 1.5);
      Operand bias = random_operand({c.dim}, dtype, 13, 0.0, 0.5);
      Operand y = output_operand({c.rows, c.dim}, dtype);
      gpu().layernorm_forward(
          kernels::LayerNormArgs{c.in_place ? x.dev.view() : y.dev.view(), x.dev, weight.dev, bias.dev, 1e-6});
      cpu().layernorm_forward(kernels::LayerNormArgs{y.host, x.host, weight.host, bias.host, 1e-6});
      CUDA_TEST_EXPECT_CLOSE(c.in_place ? x.dev.view() : y.dev.view(), y.host.view(), tolerance_for(dtype), "y");
    }
  }
}

TEST_CASE("cuda attention gate forward and backward match the CPU reference", "[cuda][dsa]") {
  struct Case {
    int64_t tokens, heads, dim;
    bool headwise, in_place;
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (const Case c : {Case{19, 3, 40, false, false}, Case{19, 3, 40, true, false}, Case{7, 5, 7, true, true},
                         Case{7, 5, 7, false, true}, Case{2, 2, 300, true, false}}) {
      INFO(label(dtype, std::string(c.headwise ? "headwise" : "elementwise") + " tokens " + std::to_string(c.tokens) +
                            " heads " + std::to_string(c.heads) + " dim " + std::to_string(c.dim) +
                            (c.in_place ? " in place" : "")));
      const Shape x_shape{c.tokens, c.heads, c.dim};
      const Shape gate_shape = c.headwise ? Shape{c.tokens, c.heads} : Shape{c.tokens, c.heads * c.dim};
      Operand x = random_operand(x_shape, dtype, 21, 0.1, 2.0);
      Operand gate = random_operand(gate_shape, dtype, 22, 0.05, 4.0);
      Operand dy = random_operand(x_shape, dtype, 23, 0.1, 1.0);

      Operand y = output_operand(x_shape, dtype);
      const TensorView y_dev = c.in_place ? x.dev.view() : y.dev.view();
      Tensor x_saved = download(x.dev);  // the backward needs x after an in-place forward
      gpu().attention_gate_forward(kernels::AttentionGateArgs{y_dev, x.dev, gate.dev, c.headwise});
      cpu().attention_gate_forward(kernels::AttentionGateArgs{y.host, x.host, gate.host, c.headwise});
      CUDA_TEST_EXPECT_CLOSE(y_dev, y.host.view(), tolerance_for(dtype), "y");

      Tensor x_dev = upload(x_saved.view(), dtype);
      Operand dx = output_operand(x_shape, dtype);
      Operand dgate = output_operand(gate_shape, dtype);
      const TensorView dx_dev = c.in_place ? dy.dev.view() : dx.dev.view();
      gpu().attention_gate_backward(kernels::AttentionGateBackwardArgs{dx_dev, dgate.dev, dy.dev, x_dev, gate.dev,
                                                                       c.headwise});
      cpu().attention_gate_backward(kernels::AttentionGateBackwardArgs{dx.host, dgate.host, dy.host, x.host, gate.host,
                                                                       c.headwise});
      CUDA_TEST_EXPECT_CLOSE(dx_dev, dx.host.view(), tolerance_for(dtype), "dx");
      CUDA_TEST_EXPECT_CLOSE(dgate.dev, dgate.host.view(), tolerance_for(dtype), "dgate");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Indexer

struct IndexerInputs {
  Operand q, k, w, cu;
  std::vector<int32_t> cu_values;
  int64_t heads = 0, dim = 0;
  double scale = 1.0;
};

// Values from `grid` (exact in BF16), or random magnitudes when grid is empty.
Operand grid_operand(Shape shape, DType dtype, std::mt19937_64& rng, const std::vector<double>& grid) {
  Operand op;
  op.host = Tensor(shape, DType::kF64);
  std::uniform_int_distribution<size_t> pick(0, grid.size() - 1);
  for (int64_t i = 0; i < op.host.numel(); ++i) op.host.ptr<double>()[i] = grid[pick(rng)];
  op.dev = upload(op.host.view(), dtype);
  return op;
}

IndexerInputs indexer_inputs(const std::vector<int32_t>& cu, int64_t heads, int64_t dim, DType dtype, uint64_t seed,
                             bool on_grid) {
  IndexerInputs in;
  in.cu_values = cu;
  in.heads = heads;
  in.dim = dim;
  in.scale = 1.0 / std::sqrt(static_cast<double>(heads * dim));
  const int64_t tokens = cu.back();
  if (on_grid) {
    std::mt19937_64 rng(seed);
    in.q = grid_operand({tokens, heads, dim}, dtype, rng, {-1.0, -0.5, 0.0, 0.5, 1.0});
    in.k = grid_operand({tokens, dim}, dtype, rng, {-1.0, -0.5, 0.0, 0.5, 1.0});
    in.w = grid_operand({tokens, heads}, DType::kF32, rng, {-1.0, -0.25, 0.25, 0.5, 1.0});
  } else {
    in.q = random_operand({tokens, heads, dim}, dtype, seed, 0.05, 1.0);
    in.k = random_operand({tokens, dim}, dtype, seed + 1, 0.05, 1.0);
    in.w = random_operand({tokens, heads}, DType::kF32, seed + 2, 0.05, 1.0);
  }
  in.cu = cu_seqlens_operand(cu);
  return in;
}

Tensor cpu_selection(const IndexerInputs& in, int64_t top_k) {
  const int64_t tokens = in.cu_values.back();
  Tensor out({tokens, top_k}, DType::kI32);
  cpu().dsa_indexer_topk(kernels::DsaIndexerArgs{out, in.q.host, in.k.host, in.w.host, in.cu.host, top_k, in.scale});
  return out;
}

Tensor gpu_selection(const IndexerInputs& in, int64_t top_k, int64_t chunk_rows = 0) {
  const int64_t tokens = in.cu_values.back();
  Tensor out = poisoned(Shape{tokens, top_k}, DType::kI32);
  const kernels::DsaIndexerArgs args{out, in.q.dev, in.k.dev, in.w.dev, in.cu.dev, top_k, in.scale};
  if (chunk_rows == 0) {
    gpu().dsa_indexer_topk(args);
  } else {
    kernels::cuda_ops::DeviceScratch scratch;
    kernels::cuda_ops::dsa_indexer_topk(args, scratch, gpu_stream(), chunk_rows);
    gpu().synchronize();  // before the scratch goes
  }
  return out;
}

struct IndexerCase {
  std::vector<int32_t> cu_seqlens;
  int64_t heads, dim, top_k;
};

std::string describe(const IndexerCase& c) {
  return "heads " + std::to_string(c.heads) + " dim " + std::to_string(c.dim) + " top_k " + std::to_string(c.top_k) +
         " " + cu_seqlens_label(c.cu_seqlens);
}

TEST_CASE("cuda dsa_indexer_topk equals the CPU reference on exact scores, ties included", "[cuda][dsa]") {
  const std::vector<IndexerCase> cases = {
      {{0, 37}, 8, 16, 5},                 // heads padded to 16 on the tensor cores
      {{0, 5, 5, 40, 77}, 4, 20, 8},       // packed, an empty segment, dim 20 (scalar loads, padded to 32)
      {{0, 130}, 64, 128, 50},             // DeepSeek-V3.2's indexer heads and dim
      {{0, 30, 61}, 16, 32, 100},          // top_k above every query's keys (no scores at all)
      {{0, 1, 200, 300}, 3, 24, 64},       // a length-1 segment, 3 heads
      {{0, 3, 4397}, 4, 16, 40},           // the score CTAs' 4096-key span ends inside a segment
      {{0, 70}, 80, 16, 20},               // 5 head blocks: a full group of 4, then a group of 1
  };
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const IndexerCase& c = cases[i];
      INFO(label(dtype, describe(c)));
      const IndexerInputs in = indexer_inputs(c.cu_seqlens, c.heads, c.dim, dtype, 100 + i, true);
      const Tensor expected = cpu_selection(in, c.top_k);
      const Tensor got = gpu_selection(in, c.top_k);
      expect_same_ints(got, expected, "topk_index");
      const Tensor chunked = gpu_selection(in, c.top_k, 7);
      expect_same_ints(chunked, expected, "topk_index (chunks of 7 queries)");
    }
  }
}

// Every row: keys of the query's segment up to t, strictly ascending, min(top_k, available) of
// them then -1; and a top-k of `score` up to `tolerance(t)`.
template <typename Score, typename Tolerance>
void expect_near_top_k(const Tensor& got, const std::vector<int32_t>& cu, int64_t top_k, const std::vector<int64_t>& rows,
                       Score score, Tolerance tolerance) {
  int64_t bad_structure = 0, not_top = 0, first_bad = -1;
  for (int64_t t : rows) {
    const int32_t* row = got.ptr<int32_t>() + t * top_k;
    const int64_t start = *(std::upper_bound(cu.begin(), cu.end(), static_cast<int32_t>(t)) - 1);
    const int64_t available = t - start + 1, want = std::min(top_k, available);
    bool ok = true;
    for (int64_t i = 0; i < top_k; ++i) {
      if (i < want) {
        ok = ok && row[i] >= start && row[i] <= t && (i == 0 || row[i] > row[i - 1]);
      } else {
        ok = ok && row[i] == -1;
      }
    }
    if (!ok) {
      ++bad_structure;
      if (first_bad < 0) first_bad = t;
      continue;
    }
    if (want == available) continue;
    std::vector<double> scores;
    for (int64_t s = start; s <= t; ++s) scores.push_back(score(t, s));
    std::vector<double> sorted = scores;
    std::nth_element(sorted.begin(), sorted.begin() + (want - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[want - 1], tol = tolerance(t);
    std::vector<bool> chosen(static_cast<size_t>(available), false);
    for (int64_t i = 0; i < want; ++i) chosen[row[i] - start] = true;
    for (int64_t s = 0; s < available; ++s) {
      if (chosen[s] ? scores[s] < kth - tol : scores[s] > kth + tol) {
        ++not_top;
        if (first_bad < 0) first_bad = t;
        break;
      }
    }
  }
  INFO(std::to_string(bad_structure) + " malformed rows, " + std::to_string(not_top) +
       " rows not a top-k; first at query " + std::to_string(first_bad));
  CHECK(bad_structure == 0);
  CHECK(not_top == 0);
}

// F64 scores of the (rounded) inputs, and their sums of |terms| (what bounds F32 rounding).
struct HostScores {
  const IndexerInputs& in;
  double operator()(int64_t t, int64_t s) const { return sum(t, s, false); }
  double magnitude(int64_t t, int64_t s) const { return sum(t, s, true); }
  double sum(int64_t t, int64_t s, bool absolute) const {
    const double* q = in.q.host.ptr<double>();
    const double* k = in.k.host.ptr<double>();
    const double* w = in.w.host.ptr<double>();
    double total = 0.0;
    for (int64_t j = 0; j < in.heads; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < in.dim; ++d) {
        const double term = q[(t * in.heads + j) * in.dim + d] * k[s * in.dim + d];
        dot += absolute ? std::fabs(term) : term;
      }
      total += absolute ? std::fabs(w[t * in.heads + j]) * dot : w[t * in.heads + j] * std::max(dot, 0.0);
    }
    return total * in.scale;
  }
};

// The largest sum of |terms| over query t's keys, times 1e-5: far above F32 rounding of the scores
// (a few hundred roundings of 6e-8 at most, usually far fewer), far below the gaps of random scores.
double score_tolerance(const HostScores& scores, int64_t t) {
  double m = 0.0;
  for (int64_t s = 0; s <= t; ++s) m = std::max(m, scores.magnitude(t, s));
  return 1e-5 * m;
}

TEST_CASE("cuda dsa_indexer_topk picks a top-k of random scores", "[cuda][dsa]") {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dtype));
    const std::vector<int32_t> cu = {0, 100, 101, 256};
    const IndexerInputs in = indexer_inputs(cu, 64, 128, dtype, 7, false);
    const Tensor got = download(gpu_selection(in, 64));
    std::vector<int64_t> rows(256);
    for (int64_t t = 0; t < 256; ++t) rows[t] = t;
    const HostScores scores{in};
    expect_near_top_k(got, cu, 64, rows, scores, [&](int64_t t) { return score_tolerance(scores, t); });
  }
}

TEST_CASE("cuda dsa_indexer_topk selects rows longer than its shared-memory cache", "[cuda][dsa]") {
  const std::vector<int32_t> cu = {0, 17000};
  const IndexerInputs in = indexer_inputs(cu, 1, 16, DType::kBF16, 9, false);
  const Tensor got = download(gpu_selection(in, 300));
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < 17000; t += 997) rows.push_back(t);
  for (int64_t t = 16380; t < 17000; t += 31) rows.push_back(t);
  const HostScores scores{in};
  expect_near_top_k(got, cu, 300, rows, scores, [&](int64_t t) { return score_tolerance(scores, t); });
}

// ---------------------------------------------------------------------------------------------
// Sparse attention

struct SparseCase {
  std::vector<int32_t> cu_seqlens;
  int64_t heads, qk_dim, v_dim, top_k;
};

std::string describe(const SparseCase& c) {
  return "heads " + std::to_string(c.heads) + " dims " + std::to_string(c.qk_dim) + "/" + std::to_string(c.v_dim) +
         " top_k " + std::to_string(c.top_k) + " " + cu_seqlens_label(c.cu_seqlens);
}

// A realistic selection: the reference indexer on random queries and keys.
Operand selection_for(const std::vector<int32_t>& cu, int64_t top_k, uint64_t seed) {
  const IndexerInputs in = indexer_inputs(cu, 4, 16, DType::kF32, seed, false);
  Operand index;
  index.host = cpu_selection(in, top_k);
  index.dev = upload(index.host.view(), DType::kI32);
  return index;
}

// One sparse attention problem on both backends: the inputs and, poisoned on the device, the
// forward's outputs (which the backward reads) and the backward's.
struct SparseOperands {
  Operand q, kv, index, dout;
  Operand out, lse, dq, dkv;
  double scale;
};

// Logits of a few units (q up to 3): softmax rows far from uniform.
SparseOperands sparse_operands(const SparseCase& c, DType dtype, uint64_t seed) {
  const int64_t tokens = c.cu_seqlens.back();
  const Shape q_shape{tokens, c.heads, c.qk_dim}, kv_shape{tokens, c.qk_dim}, o_shape{tokens, c.heads, c.v_dim};
  return {random_operand(q_shape, dtype, seed, 0.05, 3.0),
          random_operand(kv_shape, dtype, seed + 1, 0.05, 1.0),
          selection_for(c.cu_seqlens, c.top_k, seed + 2),
          random_operand(o_shape, dtype, seed + 3, 0.1, 1.0),
          output_operand(o_shape, dtype),
          output_operand({tokens, c.heads}, DType::kF32),
          output_operand(q_shape, dtype),
          output_operand(kv_shape, dtype),
          1.0 / std::sqrt(static_cast<double>(c.qk_dim))};
}

kernels::SparseAttentionArgs forward_args(BackendSide on, const SparseOperands& s) {
  return kernels::SparseAttentionArgs{on(s.out), on(s.lse), on(s.q), on(s.kv), on(s.index), s.scale};
}

kernels::SparseAttentionBackwardArgs backward_args(BackendSide on, const SparseOperands& s) {
  return kernels::SparseAttentionBackwardArgs{on(s.dq),  on(s.dkv), on(s.dout),  on(s.q),  on(s.kv),
                                              on(s.out), on(s.lse), on(s.index), s.scale};
}

// The GPU backward run again into fresh poisoned gradients, and then with its dkv contributions
// in chunks of `chunk_rows` queries, gives the bytes of the run already in s.dq and s.dkv.
void expect_backward_repeatable(const SparseOperands& s, DType dtype, int64_t chunk_rows) {
  const Tensor dq_first = download(s.dq.dev), dkv_first = download(s.dkv.dev);
  Tensor dq_again = poisoned(s.dq.dev.shape(), dtype), dkv_again = poisoned(s.dkv.dev.shape(), dtype);
  kernels::SparseAttentionBackwardArgs again = backward_args(kGpu, s);
  again.dq = dq_again;
  again.dkv = dkv_again;
  gpu().sparse_attention_backward(again);
  CHECK(same_bytes(download(dq_again), dq_first));
  CHECK(same_bytes(download(dkv_again), dkv_first));
  {
    kernels::cuda_ops::DeviceScratch scratch;
    kernels::cuda_ops::sparse_attention_backward(again, scratch, gpu_stream(), chunk_rows);
    gpu().synchronize();
  }
  CHECK(same_bytes(download(dkv_again), dkv_first));
  CHECK(same_bytes(download(dq_again), dq_first));
}

// The backward from the CPU's out and lse as the device stores them (the backward reads them as
// stored: both backends get the same rounded values), against the CPU; then bitwise repeatable,
// with the dkv contributions in chunks of `chunk_rows` queries too. `hopper_expected`: the Hopper
// kernel must be the one the GPU takes.
void check_sparse_backward(SparseOperands& s, DType dtype, bool hopper_expected, int64_t chunk_rows) {
  round_and_upload(s.out, dtype);
  round_and_upload(s.lse, DType::kF32);
  if (hopper_expected) CHECK(kernels::cuda_ops::sparse_attention_backward_sm90_supported(backward_args(kGpu, s)));
  gpu().sparse_attention_backward(backward_args(kGpu, s));
  cpu().sparse_attention_backward(backward_args(kCpu, s));
  CUDA_TEST_EXPECT_CLOSE(s.dq.dev, s.dq.host.view(), tolerance_for(dtype), "dq");
  CUDA_TEST_EXPECT_CLOSE(s.dkv.dev, s.dkv.host.view(), tolerance_for(dtype), "dkv");
  expect_backward_repeatable(s, dtype, chunk_rows);
}

void check_sparse_case(const SparseCase& c, DType dtype, uint64_t seed) {
  INFO(label(dtype, describe(c)));
  SparseOperands s = sparse_operands(c, dtype, seed);
  gpu().sparse_attention_forward(forward_args(kGpu, s));
  cpu().sparse_attention_forward(forward_args(kCpu, s));
  CUDA_TEST_EXPECT_CLOSE(s.out.dev, s.out.host.view(), tolerance_for(dtype), "out");
  CUDA_TEST_EXPECT_CLOSE(s.lse.dev, s.lse.host.view(), tolerance_for(DType::kF32), "lse");
  check_sparse_backward(s, dtype, false, 3);
}

TEST_CASE("cuda sparse attention forward and backward match the CPU reference", "[cuda][dsa]") {
  const std::vector<SparseCase> cases = {
      {{0, 37}, 2, 20, 16, 8},               // the quickstart's shape class
      {{0, 5, 5, 40, 77}, 4, 24, 9, 64},     // packed, top_k above the keys available, odd v_dim
      {{0, 48}, 16, 576, 512, 24},           // FlashMLA's latent dims
      {{0, 20, 41}, 40, 64, 33, 16},         // more heads than one CTA's group (forward 32, backward 16)
      {{0, 9}, 3, 7, 7, 4},                  // odd qk_dim == v_dim
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (size_t i = 0; i < cases.size(); ++i) check_sparse_case(cases[i], dtype, 300 + 10 * i);
  }
}

// Forward and backward at DeepSeek-V3.2's latent dims (576 / 512), where BF16 runs on the Hopper
// kernels (sparse_attention_*_sm90.cu) and MOETRAIN_SPARSE_ATTENTION=simt forces the SIMT ones: both
// paths against the CPU. `empty_query`: that query's whole selection set to -1 (out 0, lse -inf,
// checked apart; the rest compared as usual; its dq must come out 0).
void check_latent(const SparseCase& c, DType dtype, uint64_t seed, bool simt, int64_t empty_query) {
  INFO(label(dtype, describe(c)) + (simt ? " (SIMT)" : " (default path)") +
       (empty_query >= 0 ? " empty query " + std::to_string(empty_query) : ""));
  const ScopedEnv path("MOETRAIN_SPARSE_ATTENTION", simt ? "simt" : nullptr);
  // On an H100/H200 from an sm_90a build the Hopper kernels must be the ones tested.
  const bool hopper_expected = !simt && dtype == DType::kBF16 && compute_capability() / 10 == 9;
  SparseOperands s = sparse_operands(c, dtype, seed);
  if (empty_query >= 0) {
    std::fill_n(s.index.host.ptr<int32_t>() + empty_query * c.top_k, c.top_k, -1);
    s.index.dev = upload(s.index.host.view(), DType::kI32);
  }
  if (hopper_expected) CHECK(kernels::cuda_ops::sparse_attention_forward_sm90_supported(forward_args(kGpu, s)));
  gpu().sparse_attention_forward(forward_args(kGpu, s));
  cpu().sparse_attention_forward(forward_args(kCpu, s));
  Tensor got_out = download(s.out.dev), got_lse = download(s.lse.dev);
  Tensor expected_lse(s.lse.host.shape(), DType::kF64);  // a copy: the backward below gets the -inf
  std::memcpy(expected_lse.data(), s.lse.host.data(), s.lse.host.nbytes());
  if (empty_query >= 0) {
    int64_t wrong = 0;
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t row = empty_query * c.heads + h;
      wrong += got_lse.ptr<double>()[row] == -INFINITY ? 0 : 1;
      for (int64_t j = 0; j < c.v_dim; ++j) wrong += got_out.ptr<double>()[row * c.v_dim + j] == 0.0 ? 0 : 1;
      got_lse.ptr<double>()[row] = expected_lse.ptr<double>()[row] = 0.0;  // -inf on both sides
    }
    CHECK(wrong == 0);
  }
  for (const Result& r : {compare(got_out.view(), s.out.host.view(), tolerance_for(dtype), "out"),
                          compare(got_lse.view(), expected_lse.view(), tolerance_for(DType::kF32), "lse")}) {
    INFO(r.message);
    CHECK(r.ok);
  }
  check_sparse_backward(s, dtype, hopper_expected, 5);
}

TEST_CASE("cuda sparse attention at the latent dims matches the CPU reference on both paths", "[cuda][dsa]") {
  struct LatentCase {
    SparseCase shape;
    int64_t empty_query;
  };
  const std::vector<LatentCase> cases = {
      {{{0, 100, 100, 230}, 64, 576, 512, 80}, -1},  // packed, an empty segment, a block tail, -1 tails
      {{{0, 70}, 72, 576, 512, 200}, 3},             // two head groups, top_k above every key count
      {{{0, 1, 300}, 16, 576, 512, 128}, -1},        // a length-1 segment, heads padded to 64
      {{{0, 48}, 8, 576, 512, 24}, 40},              // one block, one query with nothing selected
  };
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      for (bool simt : {false, true}) {
        if (dtype == DType::kF32 && simt) continue;  // F32 runs on the SIMT kernel anyway
        check_latent(cases[i].shape, dtype, 700 + 10 * i, simt, cases[i].empty_query);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Timings (not run by default)

// A device tensor of `shape` whose first-dimension rows repeat a random block of `block_rows`.
Tensor tiled_random(Shape shape, DType dtype, int64_t block_rows, uint64_t seed, double lo, double hi) {
  std::vector<int64_t> dims;
  for (int i = 0; i < shape.ndim(); ++i) dims.push_back(i == 0 ? std::min(block_rows, shape[0]) : shape[i]);
  const Shape block(dims.begin(), dims.end());
  const Operand source = random_operand(block, dtype, seed, lo, hi);
  Tensor out(shape, dtype, cuda::device_allocator());
  const size_t block_bytes = source.dev.view().nbytes();
  const size_t total = out.view().nbytes();
  for (size_t offset = 0; offset < total; offset += block_bytes) {
    const size_t bytes = std::min(block_bytes, total - offset);
    CHECK(cudaMemcpyAsync(static_cast<char*>(out.view().data) + offset, source.dev.view().data, bytes,
                          cudaMemcpyDeviceToDevice, gpu_stream()) == cudaSuccess);
  }
  gpu().synchronize();
  return out;
}

template <typename Op>
double time_ms(Op op, int reps) {
  op();  // warm-up (shared-memory attributes, scratch growth)
  gpu().synchronize();
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  cudaEventRecord(begin, gpu_stream());
  for (int i = 0; i < reps; ++i) op();
  cudaEventRecord(end, gpu_stream());
  cudaEventSynchronize(end);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, begin, end);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return static_cast<double>(ms) / reps;
}

TEST_CASE("cuda dsa timings at DeepSeek-V3.2 shapes", "[.bench]") {
  {
    const int64_t tokens = 4096, heads = 64, qk = 576, v = 512, top_k = 2048;
    Tensor q = tiled_random({tokens, heads, qk}, DType::kBF16, 256, 4, 0.05, 1.0);
    Tensor kv = tiled_random({tokens, qk}, DType::kBF16, 256, 5, 0.05, 1.0);
    Tensor dout = tiled_random({tokens, heads, v}, DType::kBF16, 256, 6, 0.05, 1.0);
    // A sliding window of the last top_k keys (every key while fewer exist).
    Tensor index_host({tokens, top_k}, DType::kI32);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t first = std::max<int64_t>(0, t - top_k + 1);
      for (int64_t i = 0; i < top_k; ++i)
        index_host.ptr<int32_t>()[t * top_k + i] = first + i <= t ? static_cast<int32_t>(first + i) : -1;
    }
    Tensor index = upload(index_host.view(), DType::kI32);
    Tensor out(Shape{tokens, heads, v}, DType::kBF16, cuda::device_allocator());
    Tensor lse(Shape{tokens, heads}, DType::kF32, cuda::device_allocator());
    Tensor dq(Shape{tokens, heads, qk}, DType::kBF16, cuda::device_allocator());
    Tensor dkv(Shape{tokens, qk}, DType::kBF16, cuda::device_allocator());
    const double scale = 1.0 / std::sqrt(double(qk));
    const kernels::SparseAttentionArgs fwd{out, lse, q, kv, index, scale};
    const double fwd_ms = time_ms([&] { gpu().sparse_attention_forward(fwd); }, 1);
    const kernels::SparseAttentionBackwardArgs bwd{dq, dkv, dout, q, kv, out, lse, index, scale};
    const double bwd_ms = time_ms([&] { gpu().sparse_attention_backward(bwd); }, 1);
    double pairs = 0.0;
    for (int64_t t = 0; t < tokens; ++t) pairs += static_cast<double>(std::min<int64_t>(t + 1, top_k));
    const double fwd_flops = 2.0 * heads * pairs * (qk + v);
    std::printf("bench sparse attention T %lld heads %lld dims %lld/%lld top_k %lld bf16: forward %.2f ms "
                "(%.1f TFLOP/s), backward %.2f ms (%.1f TFLOP/s at 2x forward flops)\n",
                static_cast<long long>(tokens), static_cast<long long>(heads), static_cast<long long>(qk),
                static_cast<long long>(v), static_cast<long long>(top_k), fwd_ms, fwd_flops / fwd_ms / 1e9, bwd_ms,
                2.0 * fwd_flops / bwd_ms / 1e9);
    std::fflush(stdout);
  }
  for (int64_t tokens : {int64_t{4096}, int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    const int64_t heads = 64, dim = 128, top_k = 2048;
    Tensor q = tiled_random({tokens, heads, dim}, DType::kBF16, 1024, 1, 0.05, 1.0);
    Tensor k = tiled_random({tokens, dim}, DType::kBF16, 1024, 2, 0.05, 1.0);
    Tensor w = tiled_random({tokens, heads}, DType::kF32, 1024, 3, 0.05, 1.0);
    Operand cu = int_operand({0, static_cast<int32_t>(tokens)}, Shape{2});
    Tensor out(Shape{tokens, top_k}, DType::kI32, cuda::device_allocator());
    const kernels::DsaIndexerArgs args{out, q, k, w, cu.dev, top_k, 1.0 / std::sqrt(double(heads * dim))};
    gpu().reset_peak_memory();
    const size_t before = gpu().stats().allocated_bytes;
    const double ms = time_ms([&] { gpu().dsa_indexer_topk(args); }, tokens > 8192 ? 1 : 5);
    const double flops = 2.0 * heads * dim * static_cast<double>(tokens) * (tokens + 1) / 2.0;
    std::printf("bench indexer+topk T %lld heads %lld dim %lld top_k %lld bf16: %.3f ms (scores %.1f TFLOP/s), "
                "extra peak memory %.1f MiB\n",
                static_cast<long long>(tokens), static_cast<long long>(heads), static_cast<long long>(dim),
                static_cast<long long>(top_k), ms, flops / ms / 1e9, (gpu().stats().peak_bytes - before) / 1048576.0);
    std::fflush(stdout);
  }
}

}  // namespace
