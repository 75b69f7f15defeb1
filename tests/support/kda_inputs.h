// KDA inputs as a KDA layer makes them, for the op tests and the context-parallel tests: q, k
// L2-normalised rows, g = -exp(a) * softplus(x) (a few channels with strong decays, down to about
// -20), beta = sigmoid(x) in (0, 1), v and an upstream gradient dout uniform. Deterministic in the
// seed, so every rank of a test builds the same window.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/base/tensor.h"
#include "core/data/context_shards.h"
#include "gradcheck.h"

namespace moetrain::testing {

struct KdaInputs {
  int64_t tokens = 0, heads = 0, kd = 0, vd = 0;
  double scale = 1.0;
  Tensor q, k, v, g, beta, cu_seqlens, dout;
};

inline void normalise_rows(Tensor& t, int64_t dim) {
  for (int64_t r = 0; r < t.numel() / dim; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += get_element(t, r * dim + c) * get_element(t, r * dim + c);
    for (int64_t c = 0; c < dim; ++c) set_element(t, r * dim + c, get_element(t, r * dim + c) / std::sqrt(ss));
  }
}

inline KdaInputs make_kda_inputs(std::vector<int32_t> cu, int64_t heads, int64_t kd, int64_t vd, uint64_t seed,
                                 DType dtype = DType::kF64) {
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  auto softplus = [](double x) { return std::log1p(std::exp(x)); };
  KdaInputs in;
  in.tokens = cu.back();
  in.heads = heads;
  in.kd = kd;
  in.vd = vd;
  in.scale = 1.0 / std::sqrt(static_cast<double>(kd));
  const int64_t t = in.tokens;
  in.q = random_tensor({t, heads, kd}, dtype, seed + 1);
  in.k = random_tensor({t, heads, kd}, dtype, seed + 2);
  normalise_rows(in.q, kd);
  normalise_rows(in.k, kd);
  in.v = random_tensor({t, heads, vd}, dtype, seed + 3);
  in.g = Tensor({t, heads, kd}, dtype);
  in.beta = Tensor({t, heads}, dtype);
  TestRng rng(seed + 4);
  for (int64_t i = 0; i < in.g.numel(); ++i) {
    const bool strong = i % 7 == 3;
    const double a = strong ? rng.uniform(1.5, 2.3) : rng.uniform(-2.0, 0.5);
    set_element(in.g, i, -std::exp(a) * softplus(rng.uniform(-3.0, 2.0)));
  }
  for (int64_t i = 0; i < in.beta.numel(); ++i) set_element(in.beta, i, sigmoid(rng.uniform(-3.0, 3.0)));
  in.cu_seqlens = make_i32(cu);
  in.dout = random_tensor({t, heads, vd}, dtype, seed + 5);
  return in;
}

// Rows [start, end) of every input, in their dtype, with their own segment offsets `cu`
// (relative to start): one document of a packed window, or one rank's shard of it.
inline KdaInputs rows_of(const KdaInputs& in, int64_t start, int64_t end, const std::vector<int32_t>& cu) {
  KdaInputs part;
  part.tokens = end - start;
  part.heads = in.heads;
  part.kd = in.kd;
  part.vd = in.vd;
  part.scale = in.scale;
  auto rows = [&](const Tensor& t) { return copy_as(t.view().slice_rows(start, end), t.dtype()); };
  part.q = rows(in.q);
  part.k = rows(in.k);
  part.v = rows(in.v);
  part.g = rows(in.g);
  part.beta = rows(in.beta);
  part.dout = rows(in.dout);
  part.cu_seqlens = make_i32(cu);
  return part;
}

// Rank `rank`'s rows of a whole window's host tensor: its spans' rows end to end, as the rank
// holds them (ContextShards::spans_of).
inline Tensor shard_rows(const Tensor& whole, const ContextShards& shards, int rank) {
  Shape shape = whole.shape();
  shape[0] = shards.tokens(rank);
  Tensor part(shape, whole.dtype());
  const size_t row_bytes = whole.view().nbytes() / static_cast<size_t>(std::max<int64_t>(whole.shape()[0], 1));
  for (int s : shards.spans_of(rank)) {
    const ContextShards::Span& span = shards.spans()[s];
    if (span.tokens() == 0) continue;
    std::memcpy(static_cast<char*>(part.view().data) + span.row * row_bytes,
                static_cast<const char*>(whole.view().data) + span.begin * row_bytes, span.tokens() * row_bytes);
  }
  return part;
}

// Every input's rows of rank `rank`, with its own segment offsets.
inline KdaInputs shard_of(const KdaInputs& in, const ContextShards& shards, int rank) {
  KdaInputs part;
  part.tokens = shards.tokens(rank);
  part.heads = in.heads;
  part.kd = in.kd;
  part.vd = in.vd;
  part.scale = in.scale;
  part.q = shard_rows(in.q, shards, rank);
  part.k = shard_rows(in.k, shards, rank);
  part.v = shard_rows(in.v, shards, rank);
  part.g = shard_rows(in.g, shards, rank);
  part.beta = shard_rows(in.beta, shards, rank);
  part.dout = shard_rows(in.dout, shards, rank);
  part.cu_seqlens = make_i32(shards.local_cu(rank));
  return part;
}

// The worst difference of a shard's rows (host, any float dtype) against rows [begin, ...) of the
// whole window's tensor, relative to the whole's largest value (the context-parallel tests).
inline double worst_shard_difference(const Tensor& shard, const Tensor& whole, int64_t begin) {
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < whole.numel(); ++i) scale = std::max(scale, std::fabs(get_element(whole, i)));
  const int64_t row = whole.numel() / std::max<int64_t>(whole.shape()[0], 1);
  for (int64_t i = 0; i < shard.numel(); ++i) {
    const double d = get_element(shard, i) - get_element(whole, begin * row + i);
    worst = std::max(worst, std::fabs(d));
  }
  return scale > 0 ? worst / scale : worst;
}

}  // namespace moetrain::testing
