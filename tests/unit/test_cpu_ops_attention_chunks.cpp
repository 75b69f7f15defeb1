// CPU attention over chunks of the keys (AttentionArgs::key_shift) and attention_merge, the way a
// context-parallel MLA layer attends the keys of earlier shards (core/model/mla_context_parallel.h):
// the chunks' results merged equal one call over every key, their backward (with the merged out
// and lse) the whole backward; one chunk alone by finite differences in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "catch.h"
#include "kernels/cpu/reference.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

// A shard's 6 queries against 15 keys: documents [0, 4), [4, 11), [11, 15) of the keys; the
// queries are the last 6 keys' tokens (keys 9..14), so the first document has none of them.
constexpr int64_t kKeys = 15, kQueries = 6, kHeads = 2, kQk = 4, kV = 3;
constexpr double kScale = 0.5;
const std::vector<int32_t> kQueryCu = {0, 0, 2, 6};
const std::vector<int32_t> kKeyCu = {0, 4, 11, 15};

struct Operands {
  Tensor q = random_tensor({kQueries, kHeads, kQk}, DType::kF64, 51, -1.0, 1.0);
  Tensor k = random_tensor({kKeys, kHeads, kQk}, DType::kF64, 52, -1.0, 1.0);
  Tensor v = random_tensor({kKeys, kHeads, kV}, DType::kF64, 53, -1.0, 1.0);
  Tensor dout = random_tensor({kQueries, kHeads, kV}, DType::kF64, 54, -1.0, 1.0);
  Tensor cu = make_i32(kQueryCu);
};

// Keys [from, to): their segments and the shift that places them (query t sits at key kKeys - kQueries + t).
Tensor chunk_cu(int64_t from, int64_t to) {
  std::vector<int32_t> cu = kKeyCu;
  for (int32_t& c : cu) c = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(c, from), to) - from);
  return make_i32(cu);
}
int64_t chunk_shift(int64_t from) { return kKeys - kQueries - from; }

Tensor rows(const Tensor& t, int64_t from, int64_t to) { return copy_as(t.view().slice_rows(from, to), t.dtype()); }

// dst's rows [from, from + src rows) = src (F64).
void put_rows(const Tensor& dst, int64_t from, const Tensor& src) {
  const int64_t width = src.numel() / std::max<int64_t>(src.shape()[0], 1);
  std::copy(src.ptr<double>(), src.ptr<double>() + src.numel(), dst.ptr<double>() + from * width);
}

}  // namespace

TEST_CASE("attention over key chunks, merged, equals attention over every key", "[attention][chunks]") {
  Operands in;
  Tensor want_out({kQueries, kHeads, kV}, DType::kF64), want_lse({kQueries, kHeads}, DType::kF64);
  Tensor key_cu = make_i32(kKeyCu);
  cpu::attention_forward<double>(AttentionArgs{want_out, want_lse, in.q, in.k, in.v, in.cu, kScale, key_cu});
  Tensor want_dq(in.q.shape(), DType::kF64), want_dk(in.k.shape(), DType::kF64), want_dv(in.v.shape(), DType::kF64);
  cpu::attention_backward<double>(AttentionBackwardArgs{want_dq, want_dk, want_dv, in.dout, in.q, in.k, in.v, want_out,
                                                        want_lse, in.cu, kScale, key_cu});

  for (const int64_t chunk : {4, 5, 7, 15}) {
    INFO("chunks of " << chunk << " keys");
    Tensor out({kQueries, kHeads, kV}, DType::kF64), lse({kQueries, kHeads}, DType::kF64);
    fill_random(out, 61);  // the merge must not read them before the first fold
    for (int64_t i = 0; i < lse.numel(); ++i) lse.ptr<double>()[i] = -std::numeric_limits<double>::infinity();
    for (int64_t from = 0; from < kKeys; from += chunk) {
      const int64_t to = std::min(from + chunk, kKeys);
      Tensor k = rows(in.k, from, to), v = rows(in.v, from, to), cu = chunk_cu(from, to);
      Tensor chunk_out(out.shape(), DType::kF64), chunk_lse(lse.shape(), DType::kF64);
      cpu::attention_forward<double>(
          AttentionArgs{chunk_out, chunk_lse, in.q, k, v, in.cu, kScale, cu, chunk_shift(from)});
      // Query t sees keys of its document up to key kKeys - kQueries + t; in this chunk, none
      // when the chunk lies wholly before its document or after that key: out 0, lse -inf.
      for (int64_t t = 0; t < kQueries; ++t) {
        const int64_t doc = t < 2 ? 1 : 2, at = kKeys - kQueries + t;
        const bool none = to <= kKeyCu[doc] || from > at;
        for (int64_t h = 0; h < kHeads; ++h) {
          CHECK(std::isinf(chunk_lse.ptr<double>()[t * kHeads + h]) == none);
          if (none)
            for (int64_t c = 0; c < kV; ++c) CHECK(chunk_out.ptr<double>()[(t * kHeads + h) * kV + c] == 0.0);
        }
      }
      if (from == 0) fill_random(out, 62);  // lse -inf: the first fold takes the chunk whole
      cpu::attention_merge<double>(AttentionMergeArgs{out, lse, chunk_out, chunk_lse});
    }
    check(compare_tensors(out, want_out, 1e-12, 1e-13, "merged out"));
    check(compare_tensors(lse, want_lse, 1e-12, 1e-13, "merged lse"));

    Tensor dq({kQueries, kHeads, kQk}, DType::kF64), dk(in.k.shape(), DType::kF64), dv(in.v.shape(), DType::kF64);
    std::fill(dq.ptr<double>(), dq.ptr<double>() + dq.numel(), 0.0);
    for (int64_t from = 0; from < kKeys; from += chunk) {
      const int64_t to = std::min(from + chunk, kKeys);
      Tensor k = rows(in.k, from, to), v = rows(in.v, from, to), cu = chunk_cu(from, to);
      Tensor dq_chunk(dq.shape(), DType::kF64), dk_chunk(k.shape(), DType::kF64), dv_chunk(v.shape(), DType::kF64);
      cpu::attention_backward<double>(AttentionBackwardArgs{dq_chunk, dk_chunk, dv_chunk, in.dout, in.q, k, v, out, lse,
                                                            in.cu, kScale, cu, chunk_shift(from)});
      for (int64_t i = 0; i < dq.numel(); ++i) dq.ptr<double>()[i] += dq_chunk.ptr<double>()[i];
      put_rows(dk, from, dk_chunk);
      put_rows(dv, from, dv_chunk);
    }
    check(compare_tensors(dq, want_dq, 1e-12, 1e-13, "dq summed over the chunks"));
    check(compare_tensors(dk, want_dk, 1e-12, 1e-13, "dk of each chunk"));
    check(compare_tensors(dv, want_dv, 1e-12, 1e-13, "dv of each chunk"));
  }
}

TEST_CASE("attention over one key chunk matches finite differences", "[attention][chunks][grad]") {
  Operands in;
  // Keys [5, 12): the middle of document 1 and the start of document 2; queries 0-1 see part of
  // it, queries 2-3 only key 11, queries 4-5 keys 11 and up to their own.
  const int64_t from = 5, to = 12;
  Tensor k = rows(in.k, from, to), v = rows(in.v, from, to), cu = chunk_cu(from, to);
  Tensor out({kQueries, kHeads, kV}, DType::kF64), lse({kQueries, kHeads}, DType::kF64);
  auto forward = [&](const Tensor& o, const Tensor& l) {
    cpu::attention_forward<double>(AttentionArgs{o, l, in.q, k, v, in.cu, kScale, cu, chunk_shift(from)});
  };
  forward(out, lse);
  Tensor dq = random_tensor(in.q.shape(), DType::kF64, 71, 5.0, 9.0);
  Tensor dk = random_tensor(k.shape(), DType::kF64, 72, 5.0, 9.0);
  Tensor dv = random_tensor(v.shape(), DType::kF64, 73, 5.0, 9.0);
  cpu::attention_backward<double>(
      AttentionBackwardArgs{dq, dk, dv, in.dout, in.q, k, v, out, lse, in.cu, kScale, cu, chunk_shift(from)});
  Tensor scratch_out(out.shape(), DType::kF64), scratch_lse(lse.shape(), DType::kF64);
  auto loss = [&] {
    forward(scratch_out, scratch_lse);
    return moetrain::testing::dot(in.dout, scratch_out);
  };
  GradCheckOptions options;
  options.max_elements = 200;
  for (auto [input, grad, name] : {std::tuple<const Tensor*, const Tensor*, const char*>{&in.q, &dq, "q"},
                                   {&k, &dk, "k"},
                                   {&v, &dv, "v"}}) {
    check(check_gradient(loss, *input, *grad, name, options));
  }
}

TEST_CASE("attention_merge folds by the log-sum-exp rule", "[attention][chunks]") {
  // Two rows, one head, two columns: row 0 merges finite parts, row 1 keeps its own when the
  // chunk saw nothing (-inf).
  const double inf = std::numeric_limits<double>::infinity();
  Tensor out = tensor_of({1.0, 2.0, 3.0, 4.0}, {2, 1, 2}), lse = tensor_of({0.5, 1.5}, {2, 1});
  Tensor chunk_out = tensor_of({5.0, 6.0, 7.0, 8.0}, {2, 1, 2}), chunk_lse = tensor_of({-0.25, -inf}, {2, 1});
  auto backend = make_cpu_backend();
  backend->attention_merge(AttentionMergeArgs{out, lse, chunk_out, chunk_lse});
  const double a = std::exp(0.5), b = std::exp(-0.25);
  check(compare_tensors(out, tensor_of({(a * 1 + b * 5) / (a + b), (a * 2 + b * 6) / (a + b), 3.0, 4.0}, {2, 1, 2}),
                        1e-15, 1e-15, "out"));
  check(compare_tensors(lse, tensor_of({std::log(a + b), 1.5}, {2, 1}), 1e-15, 1e-15, "lse"));
  // A key shift without key segments is refused by name.
  Tensor q = random_tensor({2, 1, 2}, DType::kF64, 1), cu = make_i32({0, 2});
  CHECK(contains(error_message([&] { backend->attention_forward(AttentionArgs{out, lse, q, q, out, cu, 1.0, {}, 0}); }),
                 "key_shift"));
}
