// Attention and the grouped GEMM at shapes past 2^31 elements (large_shape_support.h), and the
// guard of the sparse attention backward's int32 inverse index:
//   - dense attention forward and backward over 128 heads x 128 in repeated 1,000-token segments,
//     tokens x heads x 128 past 2^31 (two heads of each sampled segment against the CPU reference);
//   - one causal segment of 65,536 tokens (T x T = 4.3e9 scores), sampled query rows and the last
//     keys' gradients against a direct computation in double on the host;
//   - the grouped GEMM, M-grouped (the expert forward) and K-grouped (the expert weight gradient),
//     with rows x 4096 past 2^31 in a and c (and b), inputs of repeated rows, so that each sampled
//     output element is a short sum of dot products of the blocks;
//   - sparse_attention_backward refusing tokens x top_k past 2^31 - 1 with its message.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "large_shape_support.h"

namespace moetrain::cuda_test {
namespace {

Tensor int_host(const std::vector<int32_t>& values) {
  Tensor t({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

Tensor rounded_block(Shape shape, uint64_t seed, double lo = 0.1, double hi = 1.0) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, lo, hi);
  round_host(t.view(), DType::kBF16);
  return t;
}

// Heads `heads` of a [tokens, all_heads, dim] F64 host tensor, as [tokens, heads.size(), dim].
Tensor pick_heads(const Tensor& t, const std::vector<int64_t>& heads) {
  const int64_t tokens = t.shape()[0], all = t.shape()[1], dim = t.shape()[2];
  const int64_t n = static_cast<int64_t>(heads.size());
  Tensor out({tokens, n, dim}, DType::kF64);
  for (int64_t s = 0; s < tokens; ++s)
    for (int64_t j = 0; j < n; ++j)
      std::copy_n(t.ptr<double>() + (s * all + heads[static_cast<size_t>(j)]) * dim, dim,
                  out.ptr<double>() + (s * n + j) * dim);
  return out;
}

// Gradients: BF16 outputs whose elements sum dS k (or P dout) over a segment's keys with P and dS
// rounded to BF16 for the tensor-core products: the BF16 tolerance with twice its absolute part,
// as test_cuda_attention.cpp's Hopper cases, and a looser relative part over 65,536 keys.
constexpr Tolerance kGradient{5e-3, 1.6e-2, 4e-3};
constexpr Tolerance kLongGradient{1e-2, 5e-2, 1e-2};

void expect_close(const Tensor& got, const Tensor& expected, Tolerance tol, const std::string& name) {
  const Result r = compare(got.view(), expected.view(), tol, name);
  INFO(r.message);
  CHECK(r.ok);
}

TEST_CASE("cuda attention forward and backward past 2^31 elements (repeated segments, 128 heads)") {
  const int64_t length = 1000, heads = 128, dim = 128;
  const int64_t segments = kTwoPow31 / (length * heads * dim) + 8;  // 139 segments, 2.28e9 elements
  const int64_t tokens = segments * length;
  if (!device_has(45, "attention past 2^31")) return;
  const Shape one{length, heads, dim}, all{tokens, heads, dim};
  const Tensor q_host = rounded_block(one, 900), k_host = rounded_block(one, 901), v_host = rounded_block(one, 902);
  const Tensor dout_host = rounded_block(one, 903);
  const Tensor q = repeated_rows(q_host.view(), tokens, DType::kBF16);
  const Tensor k = repeated_rows(k_host.view(), tokens, DType::kBF16);
  const Tensor v = repeated_rows(v_host.view(), tokens, DType::kBF16);
  std::vector<int32_t> cu_values(static_cast<size_t>(segments + 1));
  for (int64_t s = 0; s <= segments; ++s) cu_values[static_cast<size_t>(s)] = static_cast<int32_t>(s * length);
  const Tensor cu = upload(int_host(cu_values).view(), DType::kI32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  Tensor out(all, DType::kBF16, cuda::device_allocator()), lse({tokens, heads}, DType::kF32, cuda::device_allocator());
  gpu().fill(out, std::nan(""));
  gpu().attention_forward({out, lse, q, k, v, cu, scale});

  // The CPU reference of one segment at two heads (the first and the last).
  const std::vector<int64_t> picked{0, heads - 1};
  const Tensor q2 = pick_heads(q_host, picked), k2 = pick_heads(k_host, picked), v2 = pick_heads(v_host, picked);
  const Tensor dout2 = pick_heads(dout_host, picked);
  const Tensor cu_one = int_host({0, static_cast<int32_t>(length)});
  Tensor out_ref(q2.shape(), DType::kF64), lse_ref({length, 2}, DType::kF64);
  cpu().attention_forward({out_ref, lse_ref, q2, k2, v2, cu_one, scale});
  const std::vector<int64_t> starts = sampled_block_starts(tokens, heads * dim, length);
  for (int64_t start : starts)
    expect_close(pick_heads(download_rows(out, start, start + length), picked), out_ref, tolerance_for(DType::kBF16),
                 "attention out, segment at " + std::to_string(start));

  const Tensor dout = repeated_rows(dout_host.view(), tokens, DType::kBF16);
  Tensor dq(all, DType::kBF16, cuda::device_allocator()), dk(all, DType::kBF16, cuda::device_allocator()),
      dv(all, DType::kBF16, cuda::device_allocator());
  for (Tensor* t : {&dq, &dk, &dv}) gpu().fill(*t, std::nan(""));
  gpu().attention_backward({dq, dk, dv, dout, q, k, v, out, lse, cu, scale});
  // The CPU's out and lse as the device stores them (as test_cuda_attention.cpp does).
  round_host(out_ref.view(), DType::kBF16);
  round_host(lse_ref.view(), DType::kF32);
  Tensor dq_ref(q2.shape(), DType::kF64), dk_ref(q2.shape(), DType::kF64), dv_ref(q2.shape(), DType::kF64);
  cpu().attention_backward({dq_ref, dk_ref, dv_ref, dout2, q2, k2, v2, out_ref, lse_ref, cu_one, scale});
  for (int64_t start : starts) {
    const std::string at = ", segment at " + std::to_string(start);
    expect_close(pick_heads(download_rows(dq, start, start + length), picked), dq_ref, kGradient, "attention dq" + at);
    expect_close(pick_heads(download_rows(dk, start, start + length), picked), dk_ref, kGradient, "attention dk" + at);
    expect_close(pick_heads(download_rows(dv, start, start + length), picked), dv_ref, kGradient, "attention dv" + at);
  }
}

// Causal softmax attention of one head, directly in double: what a sampled row needs.
struct OneHead {
  const double *q, *k, *v, *dout;
  int64_t dim;
  double scale;
  double score(int64_t t, int64_t s) const {
    double dot = 0.0;
    for (int64_t d = 0; d < dim; ++d) dot += q[t * dim + d] * k[s * dim + d];
    return scale * dot;
  }
  double lse(int64_t t) const {
    double m = -INFINITY, sum = 0.0;
    for (int64_t s = 0; s <= t; ++s) m = std::max(m, score(t, s));
    for (int64_t s = 0; s <= t; ++s) sum += std::exp(score(t, s) - m);
    return m + std::log(sum);
  }
  // out[t] into `o` (dim values); returns lse[t].
  double out(int64_t t, std::vector<double>& o) const {
    const double l = lse(t);
    o.assign(static_cast<size_t>(dim), 0.0);
    for (int64_t s = 0; s <= t; ++s) {
      const double p = std::exp(score(t, s) - l);
      for (int64_t d = 0; d < dim; ++d) o[static_cast<size_t>(d)] += p * v[s * dim + d];
    }
    return l;
  }
  double dout_dot(int64_t t, const double* x) const {
    double dot = 0.0;
    for (int64_t d = 0; d < dim; ++d) dot += dout[t * dim + d] * x[d];
    return dot;
  }
};

TEST_CASE("cuda attention over one causal segment of 65,536 tokens (4.3e9 scores)") {
  const int64_t tokens = 65536, dim = 128;
  if (!device_has(2, "attention at T 65,536")) return;
  const Shape shape{tokens, 1, dim};
  const Tensor q_host = rounded_block(shape, 910), k_host = rounded_block(shape, 911), v_host = rounded_block(shape, 912);
  const Tensor dout_host = rounded_block(shape, 913);
  const Tensor q = upload(q_host.view(), DType::kBF16), k = upload(k_host.view(), DType::kBF16),
               v = upload(v_host.view(), DType::kBF16), dout = upload(dout_host.view(), DType::kBF16);
  const Tensor cu = upload(int_host({0, static_cast<int32_t>(tokens)}).view(), DType::kI32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  Tensor out(shape, DType::kBF16, cuda::device_allocator()), lse({tokens, 1}, DType::kF32, cuda::device_allocator());
  gpu().attention_forward({out, lse, q, k, v, cu, scale});
  Tensor dq(shape, DType::kBF16, cuda::device_allocator()), dk(shape, DType::kBF16, cuda::device_allocator()),
      dv(shape, DType::kBF16, cuda::device_allocator());
  gpu().attention_backward({dq, dk, dv, dout, q, k, v, out, lse, cu, scale});
  const OneHead head{q_host.ptr<double>(), k_host.ptr<double>(), v_host.ptr<double>(), dout_host.ptr<double>(), dim,
                     scale};
  const Tensor out_got = download(out), lse_got = download(lse), dq_got = download(dq), dk_got = download(dk),
               dv_got = download(dv);
  // Rows: out, lse and dq of sampled queries (the last ones see every key).
  const std::vector<int64_t> queries{0, 1, 4095, 32768, 46341, tokens - 2, tokens - 1};
  const int64_t n = static_cast<int64_t>(queries.size());
  Tensor out_ref({n, dim}, DType::kF64), out_at({n, dim}, DType::kF64), lse_ref({n}, DType::kF64),
      lse_at({n}, DType::kF64), dq_ref({n, dim}, DType::kF64), dq_at({n, dim}, DType::kF64);
  std::vector<double> o;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = queries[static_cast<size_t>(i)];
    const double l = head.out(t, o);
    const double delta = head.dout_dot(t, o.data());
    lse_ref.ptr<double>()[i] = l;
    lse_at.ptr<double>()[i] = lse_got.ptr<double>()[t];
    for (int64_t d = 0; d < dim; ++d) {
      out_ref.ptr<double>()[i * dim + d] = o[static_cast<size_t>(d)];
      out_at.ptr<double>()[i * dim + d] = out_got.ptr<double>()[t * dim + d];
      dq_at.ptr<double>()[i * dim + d] = dq_got.ptr<double>()[t * dim + d];
      dq_ref.ptr<double>()[i * dim + d] = 0.0;
    }
    // dq[t] = scale * sum_s P[t, s] (dout[t] . v[s] - delta[t]) k[s]
    for (int64_t s = 0; s <= t; ++s) {
      const double p = std::exp(head.score(t, s) - l);
      const double ds = p * (head.dout_dot(t, head.v + s * dim) - delta);
      for (int64_t d = 0; d < dim; ++d) dq_ref.ptr<double>()[i * dim + d] += scale * ds * head.k[s * dim + d];
    }
  }
  expect_close(out_at, out_ref, tolerance_for(DType::kBF16), "out of sampled queries");
  expect_close(lse_at, lse_ref, tolerance_for(DType::kF32), "lse of sampled queries");
  expect_close(dq_at, dq_ref, kLongGradient, "dq of sampled queries");
  // dk, dv of the last 4 keys: only the last 4 queries see them.
  const int64_t keys = 4;
  Tensor dk_ref({keys, dim}, DType::kF64), dv_ref({keys, dim}, DType::kF64), dk_at({keys, dim}, DType::kF64),
      dv_at({keys, dim}, DType::kF64);
  std::fill(dk_ref.ptr<double>(), dk_ref.ptr<double>() + dk_ref.numel(), 0.0);
  std::fill(dv_ref.ptr<double>(), dv_ref.ptr<double>() + dv_ref.numel(), 0.0);
  for (int64_t t = tokens - keys; t < tokens; ++t) {
    const double l = head.out(t, o);
    const double delta = head.dout_dot(t, o.data());
    for (int64_t s = tokens - keys; s <= t; ++s) {
      const int64_t j = s - (tokens - keys);
      const double p = std::exp(head.score(t, s) - l);
      const double ds = p * (head.dout_dot(t, head.v + s * dim) - delta);
      for (int64_t d = 0; d < dim; ++d) {
        dv_ref.ptr<double>()[j * dim + d] += p * head.dout[t * dim + d];
        dk_ref.ptr<double>()[j * dim + d] += scale * ds * head.q[t * dim + d];
      }
    }
  }
  for (int64_t j = 0; j < keys; ++j)
    for (int64_t d = 0; d < dim; ++d) {
      dk_at.ptr<double>()[j * dim + d] = dk_got.ptr<double>()[(tokens - keys + j) * dim + d];
      dv_at.ptr<double>()[j * dim + d] = dv_got.ptr<double>()[(tokens - keys + j) * dim + d];
    }
  expect_close(dk_at, dk_ref, kLongGradient, "dk of the last keys");
  expect_close(dv_at, dv_ref, kLongGradient, "dv of the last keys");
}

// Dot products of the rows of two blocks: dots[i * b_rows + j] = a[i] . b[j].
std::vector<double> block_dots(const Tensor& a, const Tensor& b) {
  const int64_t a_rows = a.shape()[0], b_rows = b.shape()[0], k = a.shape()[1];
  std::vector<double> dots(static_cast<size_t>(a_rows * b_rows), 0.0);
  for (int64_t i = 0; i < a_rows; ++i)
    for (int64_t j = 0; j < b_rows; ++j)
      for (int64_t e = 0; e < k; ++e)
        dots[static_cast<size_t>(i * b_rows + j)] += a.ptr<double>()[i * k + e] * b.ptr<double>()[j * k + e];
  return dots;
}

// Rows per group: uneven, summing to `rows` (the last group takes the rest).
std::vector<int32_t> uneven_offsets(int64_t rows, int64_t groups) {
  std::vector<int32_t> offsets{0};
  for (int64_t g = 0; g + 1 < groups; ++g)
    offsets.push_back(static_cast<int32_t>(offsets.back() + rows / groups + (g % 2 == 0 ? 1 : -1) * 1000 * (g + 1)));
  offsets.push_back(static_cast<int32_t>(rows));
  return offsets;
}

int64_t group_of(const std::vector<int32_t>& offsets, int64_t row) {
  return static_cast<int64_t>(std::upper_bound(offsets.begin(), offsets.end(), row) - offsets.begin()) - 1;
}

TEST_CASE("cuda grouped gemm past 2^31 elements: M-grouped a and c, K-grouped a and b") {
  const int64_t k = 4096, n = 4096, groups = 8, a_period = 3, b_period = 7;
  const int64_t rows = kTwoPow31 / k + 20000;  // 2.23e9 elements in a [rows, 4096]
  if (!device_has(12, "grouped gemm past 2^31")) return;
  const std::vector<int32_t> offsets = uneven_offsets(rows, groups);
  const Tensor offsets_dev = upload(int_host(offsets).view(), DType::kI32);
  const Tensor a_block = rounded_block({a_period, k}, 920), b_block = rounded_block({b_period, k}, 921);
  const Tensor a = repeated_rows(a_block.view(), rows, DType::kBF16);
  {
    // M-grouped, b [groups, n, k] (HF's [out, in] experts): row g * n + j of b is block row (g n + j) % 7.
    const Tensor b = repeated_rows(b_block.view(), groups * n, DType::kBF16);
    Tensor c({rows, n}, DType::kBF16, cuda::device_allocator());
    gpu().fill(c, std::nan(""));
    kernels::GroupedGemmArgs args;
    args.kind = kernels::GroupedGemmKind::kMGrouped;
    args.c = c;
    args.a = a;
    args.b = b.view().reshaped({groups, n, k});
    args.group_offsets = offsets_dev;
    args.host_group_offsets = offsets.data();
    args.transpose_b = true;
    gpu().grouped_gemm(args);
    const std::vector<double> dots = block_dots(a_block, b_block);
    for (int64_t start : {int64_t{0}, kTwoPow31 / n - 4, rows - 8}) {
      const Tensor got = download_rows(c, start, start + 8);
      Tensor expected({8, n}, DType::kF64);
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t row = start + r, g = group_of(offsets, row);
        for (int64_t j = 0; j < n; ++j)
          expected.ptr<double>()[r * n + j] = dots[static_cast<size_t>((row % a_period) * b_period + (g * n + j) % b_period)];
      }
      expect_close(got, expected, tolerance_for(DType::kBF16), "m-grouped c rows from " + std::to_string(start));
    }
  }
  // K-grouped: c[g] = a[rows_g]^T . x[rows_g] with x row r = block row r % 7; c[g, i, j] sums
  // a_block[r % 3, i] x_block[r % 7, j] over the group's rows: by residue r % 21, 21 products.
  const Tensor x = repeated_rows(b_block.view(), rows, DType::kBF16);
  Tensor c({groups, n, k}, DType::kF32, cuda::device_allocator());
  gpu().fill(c, std::nan(""));
  kernels::GroupedGemmArgs args;
  args.kind = kernels::GroupedGemmKind::kKGrouped;
  args.c = c;
  args.a = a;
  args.b = x;
  args.group_offsets = offsets_dev;
  args.host_group_offsets = offsets.data();
  gpu().grouped_gemm(args);
  const TensorView c_rows = c.view().reshaped({groups * n, k});
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<double> count(21, 0.0);
    for (int64_t r = offsets[static_cast<size_t>(g)]; r < offsets[static_cast<size_t>(g) + 1]; ++r)
      count[static_cast<size_t>(r % 21)] += 1;
    for (int64_t i : {int64_t{0}, int64_t{1}, n - 1}) {
      const Tensor got = download(c_rows.slice_rows(g * n + i, g * n + i + 1));
      Tensor expected({1, k}, DType::kF64);
      for (int64_t j = 0; j < k; ++j) {
        double sum = 0.0;
        for (int64_t res = 0; res < 21; ++res)
          sum += count[static_cast<size_t>(res)] * a_block.ptr<double>()[(res % a_period) * k + i] *
                 b_block.ptr<double>()[(res % b_period) * k + j];
        expected.ptr<double>()[j] = sum;
      }
      // Each element sums a group's ~68,000 rows of periodic products in F32: rounding grows with
      // the partial sums (up to rows x 2^-24 relative, ~4e-3); the H200 lands at rel L2 1.0-3.0e-4.
      // An offset past 2^31 would read other rows and miss by their size.
      expect_close(got, expected, (Tolerance{1e-3, 1e-2, 1e-3}),
                   "k-grouped c[" + std::to_string(g) + ", " + std::to_string(i) + ", :]");
    }
  }
}

TEST_CASE("cuda sparse_attention_backward refuses tokens x top_k past 2^31 - 1 with the fix in its message") {
  const int64_t tokens = 1048576, top_k = 2048, dim = 64;  // 2^31 entries
  if (!device_has(10, "the sparse attention guard")) return;
  const auto device = [](Shape shape, DType dtype) { return Tensor(shape, dtype, cuda::device_allocator()); };
  const Tensor q = device({tokens, 1, dim}, DType::kBF16), kv = device({tokens, dim}, DType::kBF16),
               out = device({tokens, 1, dim}, DType::kBF16), dout = device({tokens, 1, dim}, DType::kBF16),
               lse = device({tokens, 1}, DType::kF32), topk = device({tokens, top_k}, DType::kI32),
               dq = device({tokens, 1, dim}, DType::kBF16), dkv = device({tokens, dim}, DType::kBF16);
  std::string message;
  try {
    gpu().sparse_attention_backward({dq, dkv, dout, q, kv, out, lse, topk, 0.125});
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("sparse_attention_backward") != std::string::npos);
  CHECK(message.find("[1048576, 2048]") != std::string::npos);
  CHECK(message.find("2^31 - 1") != std::string::npos);
  CHECK(message.find("parallel.cp") != std::string::npos);
  CHECK(message.find("model.dsa.index_topk") != std::string::npos);
}

}  // namespace
}  // namespace moetrain::cuda_test
