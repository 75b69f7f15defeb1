// CPU MoE dispatch: the expert-order permutation on hand-worked cases, gather/scatter and the
// weighted combine with finite-difference checks of their backward in double.
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/cpu/reference.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

struct Permutation {
  Tensor offsets, sorted_pair, pair_row;
};

Permutation permute_by_expert(const Tensor& topk_index, int64_t experts) {
  const int64_t pairs = topk_index.numel();
  Permutation p{Tensor({experts + 1}, DType::kI32), Tensor({pairs}, DType::kI32), Tensor({pairs}, DType::kI32)};
  MoePermutationArgs args{p.offsets, p.sorted_pair, p.pair_row, topk_index, experts};
  cpu::moe_permutation<float>(args);
  return p;
}

// Five tokens, top-2, four experts; expert 2 gets nothing.
Tensor five_token_routing() { return i32_tensor({1, 3, 0, 1, 3, 0, 1, 3, 0, 1}, {5, 2}); }

}  // namespace

TEST_CASE("moe_permutation sorts pairs by expert, stably, with empty experts", "[moe]") {
  Permutation p = permute_by_expert(five_token_routing(), 4);
  // Pairs t * 2 + j: expert 0 has pairs 2, 5, 8; expert 1: 0, 3, 6, 9; expert 2: none; expert 3: 1, 4, 7.
  CHECK(i32_values(p.offsets) == std::vector<int32_t>{0, 3, 7, 7, 10});
  CHECK(i32_values(p.sorted_pair) == std::vector<int32_t>{2, 5, 8, 0, 3, 6, 9, 1, 4, 7});
  CHECK(i32_values(p.pair_row) == std::vector<int32_t>{3, 7, 0, 4, 8, 1, 5, 9, 2, 6});
}

TEST_CASE("moe_permutation with every token on one expert", "[moe]") {
  Permutation p = permute_by_expert(i32_tensor({2, 2, 2, 2}, {4, 1}), 3);
  CHECK(i32_values(p.offsets) == std::vector<int32_t>{0, 0, 0, 4});  // experts 0 and 1 empty, 2 holds all
  CHECK(i32_values(p.sorted_pair) == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(i32_values(p.pair_row) == std::vector<int32_t>{0, 1, 2, 3});
}

TEST_CASE("moe_permutation with no tokens", "[moe]") {
  Permutation p = permute_by_expert(i32_tensor({}, {0, 2}), 3);
  CHECK(i32_values(p.offsets) == std::vector<int32_t>{0, 0, 0, 0});
}

TEST_CASE("moe_permutation names the token and slot of a bad expert", "[moe]") {
  Tensor bad = i32_tensor({1, 3, 0, 1, 3, 0, 1, 4, 0, 1}, {5, 2});
  bool thrown = false;
  try {
    permute_by_expert(bad, 4);
  } catch (const Error& e) {
    thrown = true;
    CHECK(e.code() == ExitCode::kInternal);
    CHECK(std::string(e.what()).find("token 3 slot 1") != std::string::npos);
    CHECK(std::string(e.what()).find("expert 4") != std::string::npos);
  }
  CHECK(thrown);
  CHECK_THROWS_AS(permute_by_expert(i32_tensor({-1}, {1, 1}), 4), Error);
}

TEST_CASE("moe_permute gathers tokens into expert order and unpermute_sum is its backward", "[moe][grad]") {
  const int64_t tokens = 5, top_k = 2, dim = 3;
  Permutation p = permute_by_expert(five_token_routing(), 4);
  Tensor x = random_tensor({tokens, dim}, DType::kF64, 1);
  Tensor rows({tokens * top_k, dim}, DType::kF64);
  cpu::moe_permute<double>(rows, x, p.sorted_pair, top_k);
  // Row 3 is pair 0 (token 0); row 9 is pair 7 (token 3).
  for (int64_t c = 0; c < dim; ++c) {
    CHECK(rows.ptr<double>()[3 * dim + c] == x.ptr<double>()[0 * dim + c]);
    CHECK(rows.ptr<double>()[9 * dim + c] == x.ptr<double>()[3 * dim + c]);
  }

  Tensor drows = random_tensor({tokens * top_k, dim}, DType::kF64, 2);
  Tensor dx = random_tensor({tokens, dim}, DType::kF64, 3, 5.0, 9.0);  // overwritten
  cpu::moe_unpermute_sum<double>(dx, drows, p.pair_row, top_k, false);
  Tensor scratch({tokens * top_k, dim}, DType::kF64);
  auto loss = [&] {
    cpu::moe_permute<double>(scratch, x, p.sorted_pair, top_k);
    return moetrain::testing::dot(drows, scratch);
  };
  check(check_gradient(loss, x, dx, "x"));

  // accumulate adds onto what is there.
  Tensor acc = random_tensor({tokens, dim}, DType::kF64, 4);
  Tensor expected({tokens, dim}, DType::kF64);
  for (int64_t i = 0; i < acc.numel(); ++i) expected.ptr<double>()[i] = acc.ptr<double>()[i] + dx.ptr<double>()[i];
  cpu::moe_unpermute_sum<double>(acc, drows, p.pair_row, top_k, true);
  check(compare_tensors(acc, expected, 1e-14, 1e-15, "accumulated dx"));
}

TEST_CASE("moe_combine weights expert outputs back into token order", "[moe]") {
  const int64_t tokens = 5, top_k = 2, dim = 4;
  Permutation p = permute_by_expert(five_token_routing(), 4);
  Tensor rows = random_tensor({tokens * top_k, dim}, DType::kF64, 5);
  Tensor weight = random_tensor({tokens, top_k}, DType::kF64, 6);
  Tensor out = random_tensor({tokens, dim}, DType::kF64, 7, 5.0, 9.0);  // overwritten
  MoeCombineArgs args{out, rows, weight, p.pair_row};
  cpu::moe_combine<double>(args);

  // Scatter from the expert side: row r belongs to pair sorted_pair[r] = t * top_k + j.
  Tensor expected = Tensor::zeros({tokens, dim}, DType::kF64);
  for (int64_t r = 0; r < tokens * top_k; ++r) {
    const int32_t pair = p.sorted_pair.ptr<int32_t>()[r];
    for (int64_t c = 0; c < dim; ++c)
      expected.ptr<double>()[(pair / top_k) * dim + c] += weight.ptr<double>()[pair] * rows.ptr<double>()[r * dim + c];
  }
  check(compare_tensors(out, expected, 1e-14, 1e-15, "out"));

  // Dispatch, identity experts, combine: every token comes back scaled by its weight sum.
  Tensor x = random_tensor({tokens, dim}, DType::kF64, 8);
  Tensor dispatched({tokens * top_k, dim}, DType::kF64);
  cpu::moe_permute<double>(dispatched, x, p.sorted_pair, top_k);
  args.rows = dispatched;
  cpu::moe_combine<double>(args);
  for (int64_t t = 0; t < tokens; ++t) {
    const double w = weight.ptr<double>()[t * top_k] + weight.ptr<double>()[t * top_k + 1];
    for (int64_t c = 0; c < dim; ++c)
      CHECK(std::fabs(out.ptr<double>()[t * dim + c] - w * x.ptr<double>()[t * dim + c]) < 1e-14);
  }
}

TEST_CASE("moe_combine backward matches finite differences", "[moe][grad]") {
  const int64_t tokens = 5, top_k = 2, dim = 3;
  Permutation p = permute_by_expert(five_token_routing(), 4);
  // One row more than the pairs use: it must get a zero gradient.
  const int64_t rows_n = tokens * top_k + 1;
  Tensor rows = random_tensor({rows_n, dim}, DType::kF64, 11);
  Tensor weight = random_tensor({tokens, top_k}, DType::kF64, 12);
  Tensor dout = random_tensor({tokens, dim}, DType::kF64, 13);
  Tensor drows = random_tensor({rows_n, dim}, DType::kF64, 14, 5.0, 9.0);  // overwritten
  Tensor dweight = random_tensor({tokens, top_k}, DType::kF64, 15, 5.0, 9.0);
  MoeCombineBackwardArgs back{drows, dweight, dout, rows, weight, p.pair_row};
  cpu::moe_combine_backward<double>(back);

  Tensor out({tokens, dim}, DType::kF64);
  auto loss = [&] {
    MoeCombineArgs args{out, rows, weight, p.pair_row};
    cpu::moe_combine<double>(args);
    return moetrain::testing::dot(dout, out);
  };
  check(check_gradient(loss, rows, drows, "rows"));
  check(check_gradient(loss, weight, dweight, "weight"));
  for (int64_t c = 0; c < dim; ++c) CHECK(drows.ptr<double>()[(rows_n - 1) * dim + c] == 0.0);
}

TEST_CASE("moe ops in float agree with double", "[moe]") {
  const int64_t tokens = 5, top_k = 2, dim = 3;
  Permutation p = permute_by_expert(five_token_routing(), 4);
  Tensor rows64 = random_tensor({tokens * top_k, dim}, DType::kF64, 21);
  Tensor weight64 = random_tensor({tokens, top_k}, DType::kF64, 22);
  Tensor rows32({tokens * top_k, dim}, DType::kF32), weight32({tokens, top_k}, DType::kF32);
  for (int64_t i = 0; i < rows64.numel(); ++i) rows32.ptr<float>()[i] = static_cast<float>(rows64.ptr<double>()[i]);
  for (int64_t i = 0; i < weight64.numel(); ++i) weight32.ptr<float>()[i] = static_cast<float>(weight64.ptr<double>()[i]);
  Tensor out64({tokens, dim}, DType::kF64), out32({tokens, dim}, DType::kF32);
  MoeCombineArgs a64{out64, rows64, weight64, p.pair_row};
  MoeCombineArgs a32{out32, rows32, weight32, p.pair_row};
  cpu::moe_combine<double>(a64);
  cpu::moe_combine<float>(a32);
  check(compare_tensors(out32, out64, 1e-6, 1e-7, "combine out"));
}

TEST_CASE("moe ops through the CPU backend", "[moe][backend]") {
  auto backend = make_cpu_backend();
  const int64_t tokens = 5, top_k = 2, dim = 2;
  Tensor topk = five_token_routing();
  Tensor offsets({5}, DType::kI32), sorted_pair({10}, DType::kI32), pair_row({10}, DType::kI32);
  backend->moe_permutation(MoePermutationArgs{offsets, sorted_pair, pair_row, topk, 4});
  CHECK(i32_values(pair_row) == std::vector<int32_t>{3, 7, 0, 4, 8, 1, 5, 9, 2, 6});

  Tensor x = random_tensor({tokens, dim}, DType::kF32, 31);
  Tensor rows({tokens * top_k, dim}, DType::kF32), out({tokens, dim}, DType::kF32);
  Tensor weight = random_tensor({tokens, top_k}, DType::kF32, 32);
  backend->moe_permute(rows, x, sorted_pair, top_k);
  backend->moe_combine(MoeCombineArgs{out, rows, weight, pair_row});
  for (int64_t t = 0; t < tokens; ++t) {
    const double w = static_cast<double>(weight.ptr<float>()[t * 2]) + weight.ptr<float>()[t * 2 + 1];
    for (int64_t c = 0; c < dim; ++c) CHECK(std::fabs(out.ptr<float>()[t * dim + c] - w * x.ptr<float>()[t * dim + c]) < 1e-6);
  }

  Tensor bad = i32_tensor({1, 3, 0, 1, 3, 0, 1, 3, 0, 9}, {5, 2});
  bool named = false;
  try {
    backend->moe_permutation(MoePermutationArgs{offsets, sorted_pair, pair_row, bad, 4});
  } catch (const Error& e) {
    named = e.code() == ExitCode::kInternal && std::string(e.what()).find("token 4 slot 1") != std::string::npos;
  }
  CHECK(named);
}
