// CUDA MoE dispatch ops against the CPU reference (F64): the stable sort by expert (random
// routing with empty experts, everything on one expert, more than one 1024-pair chunk, a pair
// count that is not a multiple of 32), gather into expert order and its backward, and the
// weighted combine and its backward, for F32 and BF16 rows at a vectorisable width (40) and
// an odd one (13). Outputs are poisoned first (NaN, or -1 for indices).
#include <random>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

// The permutation of `expert_of` ([tokens, top_k]) on both backends; returns the CPU's
// pair_row and sorted_pair for the row tests.
struct Permutation {
  Operand offsets, sorted_pair, pair_row;
};

Permutation check_permutation(const std::vector<int32_t>& expert_of, int64_t tokens, int64_t top_k, int64_t experts) {
  INFO("tokens " << tokens << " top_k " << top_k << " experts " << experts);
  Operand topk = int_operand(expert_of, Shape{tokens, top_k});
  const int64_t pairs = tokens * top_k;
  Permutation p{int_output_operand({experts + 1}), int_output_operand({pairs}), int_output_operand({pairs})};
  const auto permutation_args = [&](BackendSide on) {
    kernels::MoePermutationArgs args;
    args.num_experts = experts;
    args.expert_offsets = on(p.offsets);
    args.sorted_pair = on(p.sorted_pair);
    args.pair_row = on(p.pair_row);
    args.topk_index = on(topk);
    return args;
  };
  gpu().moe_permutation(permutation_args(kGpu));
  cpu().moe_permutation(permutation_args(kCpu));
  expect_same_ints(p.offsets.dev, p.offsets.host, "expert_offsets");
  expect_same_ints(p.sorted_pair.dev, p.sorted_pair.host, "sorted_pair");
  expect_same_ints(p.pair_row.dev, p.pair_row.host, "pair_row");
  return p;
}

// Experts drawn from the even ones only, so the odd experts stay empty.
std::vector<int32_t> random_routing(int64_t tokens, int64_t top_k, int64_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> values(static_cast<size_t>(tokens * top_k));
  for (int32_t& e : values) e = static_cast<int32_t>(2 * (rng() % static_cast<uint64_t>((experts + 1) / 2)));
  return values;
}

TEST_CASE("cuda moe_permutation is the CPU's stable sort") {
  SECTION("random routing with empty experts, several chunks, pairs not a multiple of 32") {
    check_permutation(random_routing(1001, 3, 37, 1), 1001, 3, 37);
  }
  SECTION("everything on one expert") {
    check_permutation(std::vector<int32_t>(700 * 4, 5), 700, 4, 8);
  }
  SECTION("one token, one slot, one expert") {
    check_permutation({0}, 1, 1, 1);
  }
  SECTION("Kimi-like: 256 experts, top-8") {
    check_permutation(random_routing(515, 8, 256, 2), 515, 8, 256);
  }
}

// moe_combine_backward on the GPU and on the CPU reference, from the same operands.
void combine_backward_on_both(Operand& drows, Operand& dweight, const Operand& dout, const Operand& rows,
                              const Operand& weight, const Operand& pair_row) {
  const auto backward_args = [&](BackendSide on) {
    kernels::MoeCombineBackwardArgs args;
    args.drows = on(drows);
    args.dweight = on(dweight);
    args.dout = on(dout);
    args.rows = on(rows);
    args.weight = on(weight);
    args.pair_row = on(pair_row);
    return args;
  };
  gpu().moe_combine_backward(backward_args(kGpu));
  cpu().moe_combine_backward(backward_args(kCpu));
}

void check_rows(DType dtype, int64_t width, uint64_t seed) {
  INFO(dtype_name(dtype) << " width " << width);
  const int64_t tokens = 97, top_k = 3, experts = 11, pairs = tokens * top_k;
  const Permutation perm = check_permutation(random_routing(tokens, top_k, experts, seed), tokens, top_k, experts);
  const Tolerance tol = tolerance_for(dtype);

  // Gather into expert order: a copy, so exact; compared with the common tolerance anyway.
  Operand x = random_operand({tokens, width}, dtype, seed + 1);
  Operand permuted = output_operand({pairs, width}, dtype);
  gpu().moe_permute(permuted.dev, x.dev, perm.sorted_pair.dev, top_k);
  cpu().moe_permute(permuted.host, x.host, perm.sorted_pair.host, top_k);
  CUDA_TEST_EXPECT_CLOSE(permuted.dev, permuted.host.view(), tol, "moe_permute out");

  // Its backward, overwriting and accumulating.
  Operand drows = random_operand({pairs, width}, dtype, seed + 2);
  Operand dx = output_operand({tokens, width}, dtype);
  gpu().moe_unpermute_sum(dx.dev, drows.dev, perm.pair_row.dev, top_k, false);
  cpu().moe_unpermute_sum(dx.host, drows.host, perm.pair_row.host, top_k, false);
  CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tol, "moe_unpermute_sum dx");
  Operand dx_acc = random_operand({tokens, width}, dtype, seed + 3);
  gpu().moe_unpermute_sum(dx_acc.dev, drows.dev, perm.pair_row.dev, top_k, true);
  cpu().moe_unpermute_sum(dx_acc.host, drows.host, perm.pair_row.host, top_k, true);
  CUDA_TEST_EXPECT_CLOSE(dx_acc.dev, dx_acc.host.view(), tol, "moe_unpermute_sum dx (accumulate)");

  // Weighted combine (weights F32, as the dtype policy says) and its backward.
  Operand rows = random_operand({pairs, width}, dtype, seed + 4);
  Operand weight = random_operand({tokens, top_k}, DType::kF32, seed + 5);
  Operand out = output_operand({tokens, width}, dtype);
  const auto combine_args = [&](BackendSide on) {
    kernels::MoeCombineArgs args;
    args.out = on(out);
    args.rows = on(rows);
    args.weight = on(weight);
    args.pair_row = on(perm.pair_row);
    return args;
  };
  gpu().moe_combine(combine_args(kGpu));
  cpu().moe_combine(combine_args(kCpu));
  CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tol, "moe_combine out");

  Operand dout = random_operand({tokens, width}, dtype, seed + 6);
  Operand drows_out = output_operand({pairs, width}, dtype);
  Operand dweight = output_operand({tokens, top_k}, DType::kF32);
  combine_backward_on_both(drows_out, dweight, dout, rows, weight, perm.pair_row);
  CUDA_TEST_EXPECT_CLOSE(drows_out.dev, drows_out.host.view(), tol, "moe_combine_backward drows");
  // dweight is F32 whatever the rows' dtype: the dot products see identical inputs on both sides.
  CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32), "moe_combine_backward dweight");
}

TEST_CASE("cuda moe_permute, moe_unpermute_sum, moe_combine and its backward match the CPU") {
  uint64_t seed = 500;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int64_t width : {int64_t{40}, int64_t{13}}) check_rows(dtype, width, seed += 10);
}

TEST_CASE("cuda moe_combine_backward zeroes rows no pair maps to") {
  // Two spare rows beyond tokens * top_k (padding): their gradient must be 0, not NaN.
  const int64_t tokens = 5, top_k = 2, width = 16, rows_count = tokens * top_k + 2;
  std::vector<int32_t> pair_row_values;
  for (int32_t i = 0; i < tokens * top_k; ++i) pair_row_values.push_back(i + 2);  // rows 0 and 1 unused
  Operand pair_row = int_operand(pair_row_values, Shape{tokens * top_k});
  Operand rows = random_operand({rows_count, width}, DType::kBF16, 900);
  Operand weight = random_operand({tokens, top_k}, DType::kF32, 901);
  Operand dout = random_operand({tokens, width}, DType::kBF16, 902);
  Operand drows = output_operand({rows_count, width}, DType::kBF16);
  Operand dweight = output_operand({tokens, top_k}, DType::kF32);
  combine_backward_on_both(drows, dweight, dout, rows, weight, pair_row);
  CUDA_TEST_EXPECT_CLOSE(drows.dev, drows.host.view(), tolerance_for(DType::kBF16), "drows with spare rows");
  CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32), "dweight");
}

}  // namespace
