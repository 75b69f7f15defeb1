// The mixers across a context-parallel group (core/model/kda_context_parallel.h: KDA and its short
// convolution; attention_context_parallel.h) equal the same mixer over the whole window on one rank, forward
// and every input gradient, on the CPU backend under mpirun, in both layouts (contiguous and
// balanced, core/data/context_shards.h): documents inside one shard, across two and across all, a
// document starting exactly at a shard's start, a window that does not split evenly, and (3 ranks
// or more) an empty shard (contiguous); documents starting inside a chunk and running through the
// pair of chunks a rank holds, and chunks shorter than the attention key chunk (balanced); in F64
// and F32. Attention also with its keys in chunks of 1 and 7 rows (shorter than a shard, not
// dividing it), merged by log-sum-exp.
// Prints "EQUAL" on rank 0 when every case of every rank agrees.
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/base/log.h"
#include "core/model/attention_context_parallel.h"
#include "core/model/kda_context_parallel.h"
#include "kda_inputs.h"
#include "kernels/ops.h"
#include "parallel/comm.h"
#include "parallel/runtime.h"

namespace moetrain {
namespace {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;
using kernels::KdaArgs;
using kernels::KdaBackwardArgs;
using testing::KdaInputs;

struct Case {
  std::string name;
  std::vector<int32_t> cu;     // the window's documents
  std::vector<int64_t> cuts;   // shard r holds [cuts[r], cuts[r + 1]); empty: an even split
  bool balanced = false;       // the balanced layout over one window of cu.back() tokens (cuts unused)
};

struct Outputs {
  Tensor out, dq, dk, dv, dg, dbeta;
  explicit Outputs(const KdaInputs& in)
      : out({in.tokens, in.heads, in.vd}, in.q.dtype()), dq({in.tokens, in.heads, in.kd}, in.q.dtype()),
        dk({in.tokens, in.heads, in.kd}, in.q.dtype()), dv({in.tokens, in.heads, in.vd}, in.q.dtype()),
        dg({in.tokens, in.heads, in.kd}, in.q.dtype()), dbeta({in.tokens, in.heads}, in.q.dtype()) {}
  KdaArgs forward(const KdaInputs& in) const { return {out, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale}; }
  KdaBackwardArgs backward(const KdaInputs& in) const {
    return {dq, dk, dv, dg, dbeta, in.dout, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale};
  }
};

// The checks of one case on this rank: each named tensor of the shard against its rows of the whole.
struct Checked {
  const char* name;
  const Tensor* shard;
  const Tensor* whole;
};

int compare(const std::string& label, const std::vector<Checked>& checks, const ContextShards& shards, int me,
            double tolerance) {
  int failures = 0;
  for (const Checked& c : checks) {
    const double worst = testing::worst_shard_difference(*c.shard, testing::shard_rows(*c.whole, shards, me), 0);
    if (!(worst <= tolerance)) {
      ++failures;
      log::error(fmt::format("{}, rank {} ({} tokens): {} differs from the whole window's by {:.3e} (relative "
                             "to its largest value; at most {:.0e})",
                             label, me, shards.tokens(me), c.name, worst, tolerance));
    }
  }
  return failures;
}

int run_kda_case(const Case& c, const ContextShards& shards, DType dtype, double tolerance, kernels::Backend& backend,
                 Communicator& cp) {
  const int me = cp.rank();
  const KdaInputs whole = testing::make_kda_inputs(c.cu, 2, 4, 3, 1000 + c.cu.size(), dtype);
  Outputs want(whole);
  backend.kda_forward(want.forward(whole));
  backend.kda_backward(want.backward(whole));

  const KdaInputs shard = testing::shard_of(whole, shards, me);
  Outputs got(shard);
  KdaAcrossRanks kda(backend, cp, shards);
  KdaShardState saved;
  kda.forward(got.forward(shard), &saved);
  kda.backward(got.backward(shard), saved);
  return compare("kda: " + c.name + " (" + dtype_name(dtype) + ")",
                 {{"out", &got.out, &want.out}, {"dq", &got.dq, &want.dq}, {"dk", &got.dk, &want.dk},
                  {"dv", &got.dv, &want.dv}, {"dg", &got.dg, &want.dg}, {"dbeta", &got.dbeta, &want.dbeta}},
                 shards, me, tolerance);
}

// Attention: q, k, v [tokens, heads, dim] of one window, and every result of a call on them.
struct AttentionRun {
  Tensor q, k, v, dout, out, lse, dq, dk, dv, cu;
  AttentionRun(const Tensor& q_, const Tensor& k_, const Tensor& v_, const Tensor& dout_, std::vector<int32_t> cu_)
      : q(testing::copy_as(q_, q_.dtype())), k(testing::copy_as(k_, k_.dtype())), v(testing::copy_as(v_, v_.dtype())),
        dout(testing::copy_as(dout_, dout_.dtype())), out(v.shape(), v.dtype()), lse({q.shape()[0], q.shape()[1]}, q.dtype()),
        dq(q.shape(), q.dtype()), dk(k.shape(), k.dtype()), dv(v.shape(), v.dtype()), cu(testing::make_i32(cu_)) {}
  AttentionArgs forward(double scale) const { return {out, lse, q, k, v, cu, scale}; }
  AttentionBackwardArgs backward(double scale) const { return {dq, dk, dv, dout, q, k, v, out, lse, cu, scale}; }
};

// key_chunk: AttentionAcrossRanks' key chunk (0: a shard's length).
int run_attention_case(const Case& c, const ContextShards& shards, DType dtype, double tolerance, int64_t key_chunk,
                       kernels::Backend& backend, Communicator& cp) {
  const int me = cp.rank();
  const int64_t tokens = c.cu.back(), heads = 2, qk = 5, vd = 3;
  const double scale = 0.4;
  const uint64_t seed = 2000 + c.cu.size();
  AttentionRun whole(testing::random_tensor({tokens, heads, qk}, dtype, seed, -1.0, 1.0),
                     testing::random_tensor({tokens, heads, qk}, dtype, seed + 1, -1.0, 1.0),
                     testing::random_tensor({tokens, heads, vd}, dtype, seed + 2, -1.0, 1.0),
                     testing::random_tensor({tokens, heads, vd}, dtype, seed + 3, -1.0, 1.0), c.cu);
  backend.attention_forward(whole.forward(scale));
  backend.attention_backward(whole.backward(scale));

  auto rows = [&](const Tensor& t) { return testing::shard_rows(t, shards, me); };
  AttentionRun shard(rows(whole.q), rows(whole.k), rows(whole.v), rows(whole.dout), shards.local_cu(me));
  AttentionAcrossRanks attention(backend, cp, shards, key_chunk);
  attention.forward(shard.forward(scale));
  attention.backward(shard.backward(scale));
  return compare("attention: " + c.name + " (" + dtype_name(dtype) + ", key chunks of " + std::to_string(key_chunk) + ")",
                 {{"out", &shard.out, &whole.out}, {"lse", &shard.lse, &whole.lse}, {"dq", &shard.dq, &whole.dq},
                  {"dk", &shard.dk, &whole.dk}, {"dv", &shard.dv, &whole.dv}},
                 shards, me, tolerance);
}

// The short convolution before KDA (ShortConvAcrossRanks: the halos from the spans before each of
// a rank's spans, and the halos' gradients back to their owners) against one call over the whole
// window: y, dx, and dweight summed over the group.
int run_short_conv_case(const Case& c, const ContextShards& shards, DType dtype, double tolerance,
                        kernels::Backend& backend, Communicator& cp) {
  constexpr int64_t kChannels = 5, kWidth = 4;
  const int me = cp.rank();
  const int64_t tokens = c.cu.back();
  const uint64_t seed = 4000 + c.cu.size();
  const Tensor x = testing::random_tensor({tokens, kChannels}, dtype, seed + 1, -1.0, 1.0);
  const Tensor weight = testing::random_tensor({kChannels, kWidth}, dtype, seed + 2, -1.0, 1.0);
  const Tensor dy = testing::random_tensor({tokens, kChannels}, dtype, seed + 3, -1.0, 1.0);
  const Tensor cu = testing::make_i32(c.cu);
  Tensor want_y({tokens, kChannels}, dtype), want_dx({tokens, kChannels}, dtype), want_dw({kChannels, kWidth}, dtype);
  backend.short_conv_forward({want_y, x, weight, cu, true});
  backend.short_conv_backward({want_dx, want_dw, dy, x, weight, cu, true});

  const Tensor sx = testing::shard_rows(x, shards, me), sdy = testing::shard_rows(dy, shards, me);
  const Tensor scu = testing::make_i32(shards.local_cu(me));
  Tensor y({shards.tokens(me), kChannels}, dtype), dx(y.shape(), dtype), dw({kChannels, kWidth}, dtype);
  ShortConvAcrossRanks conv(backend, cp, shards, kWidth);
  conv.forward({y, sx, weight, scu, true});
  conv.backward({dx, dw, sdy, sx, weight, scu, true});
  cp.all_reduce(dw.view());
  const std::string label = "short conv: " + c.name + " (" + dtype_name(dtype) + ")";
  int failures = compare(label, {{"y", &y, &want_y}, {"dx", &dx, &want_dx}}, shards, me, tolerance);
  const double worst = testing::worst_shard_difference(dw, want_dw, 0);
  if (!(worst <= tolerance)) {
    ++failures;
    log::error(fmt::format("{}, rank {}: dweight summed over the group differs from the whole window's by {:.3e}",
                           label, me, worst));
  }
  return failures;
}

int run_test(Runtime& runtime, int, char**) {
  MpiCommunicator cp(MPI_COMM_WORLD);
  auto backend = kernels::make_cpu_backend();
  const int ranks = cp.size();
  std::vector<Case> cases = {
      {"one document over every shard, uneven split", {0, 150}, {}},
      {"documents inside one shard and across two", {0, 40, 100, 130, 150}, {}},
      {"short documents, several per shard", {0, 7, 9, 30, 31, 60, 90, 121}, {}},
  };
  // A document that starts exactly where shard 1 starts.
  cases.push_back({"a document starting at a shard's start", {0, 200 / ranks, 200}, {}});
  if (ranks >= 3) {
    std::vector<int64_t> cuts = {0, 50, 50};  // shard 1 is empty
    for (int r = 3; r <= ranks; ++r) cuts.push_back(50 + 70 * (r - 2) / (ranks - 2));
    cases.push_back({"an empty shard inside a document", {0, 120}, cuts});
  }
  // Balanced: one window of 2 ranks x chunk tokens, rank r holding chunks r and 2 ranks - 1 - r.
  const int32_t chunk = 9, window = 2 * ranks * chunk;
  cases.push_back({"balanced: one document over every chunk", {0, window}, {}, true});
  cases.push_back({"balanced: documents starting inside chunks, through a rank's pair",
                   {0, 5, window / 2 + 3, window - 4, window}, {}, true});
  cases.push_back({"balanced: a document starting at the second half", {0, 2, window / 2, window}, {}, true});
  cases.push_back({"balanced: chunks of 2 tokens, short documents", {0, 1, 2 * ranks + 1, 4 * ranks}, {}, true});
  cases.push_back({"balanced: chunks of 1 token (halos over several spans)", {0, 2 * ranks}, {}, true});
  int failures = 0;
  for (const Case& c : cases) {
    const ContextShards shards = c.balanced       ? ContextShards::balanced(c.cu, ranks, c.cu.back())
                                 : c.cuts.empty() ? ContextShards::even(c.cu, ranks)
                                                  : ContextShards(c.cu, c.cuts);
    for (const auto& [dtype, tolerance] : {std::make_pair(DType::kF64, 1e-10), std::make_pair(DType::kF32, 2e-5)}) {
      failures += run_kda_case(c, shards, dtype, tolerance, *backend, cp);
      failures += run_short_conv_case(c, shards, dtype, tolerance, *backend, cp);
      for (const int64_t key_chunk : {0, 1, 7}) {
        failures += run_attention_case(c, shards, dtype, tolerance, key_chunk, *backend, cp);
      }
    }
  }
  cp.all_reduce(&failures, 1);
  if (runtime.is_root())
    std::printf("context_parallel cp %d, kda, short conv and attention, %zu cases in F64 and F32: %s\n", ranks,
                cases.size(), failures == 0 ? "EQUAL" : "DIFFERENT");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
