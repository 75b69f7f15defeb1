// CUDA attention forward and backward against the CPU reference (F64) on the same inputs:
// segment layouts with a length-1 segment, an empty one, segments that are not multiples of the
// tiles and one longer than several tiles; head dims MLA's 192/128, small odd 10/5 and the 256
// maximum; F32 (tight) and BF16 (relative L2 well under 1e-2) storage. Outputs are poisoned
// with NaN first, so an element a kernel forgets to write fails the comparison.
#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace {

using namespace moetrain;
using namespace moetrain::cuda_test;

struct AttentionCase {
  std::vector<int32_t> cu_seqlens;
  int64_t heads;
  int64_t qk_dim;
  int64_t v_dim;
};

std::string describe(const AttentionCase& c, DType dtype) {
  std::string s = std::string(dtype_name(dtype)) + " heads " + std::to_string(c.heads) + " dims " +
                  std::to_string(c.qk_dim) + "/" + std::to_string(c.v_dim) + " cu_seqlens";
  for (int32_t b : c.cu_seqlens) s += " " + std::to_string(b);
  return s;
}

void check_attention_case(const AttentionCase& c, DType dtype, uint64_t seed) {
  INFO(describe(c, dtype));
  const int64_t tokens = c.cu_seqlens.back();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_dim));
  const Shape qk_shape{tokens, c.heads, c.qk_dim}, v_shape{tokens, c.heads, c.v_dim}, lse_shape{tokens, c.heads};
  // Magnitudes up to 2 so that softmax rows are far from uniform.
  Operand q = random_operand(qk_shape, dtype, seed, 0.05, 2.0);
  Operand k = random_operand(qk_shape, dtype, seed + 1, 0.05, 2.0);
  Operand v = random_operand(v_shape, dtype, seed + 2, 0.05, 1.0);
  Operand cu = int_operand(c.cu_seqlens, Shape{static_cast<int64_t>(c.cu_seqlens.size())});

  // Forward.
  Operand out = output_operand(v_shape, dtype);
  Operand lse = output_operand(lse_shape, DType::kF32);
  kernels::AttentionArgs fwd;
  fwd.scale = scale;
  fwd.out = out.dev;
  fwd.lse = lse.dev;
  fwd.q = q.dev;
  fwd.k = k.dev;
  fwd.v = v.dev;
  fwd.cu_seqlens = cu.dev;
  gpu().attention_forward(fwd);
  fwd.out = out.host;
  fwd.lse = lse.host;
  fwd.q = q.host;
  fwd.k = k.host;
  fwd.v = v.host;
  fwd.cu_seqlens = cu.host;
  cpu().attention_forward(fwd);
  CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tolerance_for(dtype), "out");
  CUDA_TEST_EXPECT_CLOSE(lse.dev, lse.host.view(), tolerance_for(DType::kF32), "lse");

  // Backward from the CPU's out and lse, rounded to what the device stores, on both backends.
  round_host(out.host.view(), dtype);
  round_host(lse.host.view(), DType::kF32);
  const Tensor out_dev = upload(out.host.view(), dtype);
  const Tensor lse_dev = upload(lse.host.view(), DType::kF32);
  Operand dout = random_operand(v_shape, dtype, seed + 3, 0.05, 1.0);
  Operand dq = output_operand(qk_shape, dtype);
  Operand dk = output_operand(qk_shape, dtype);
  Operand dv = output_operand(v_shape, dtype);
  kernels::AttentionBackwardArgs bwd;
  bwd.scale = scale;
  bwd.dq = dq.dev;
  bwd.dk = dk.dev;
  bwd.dv = dv.dev;
  bwd.dout = dout.dev;
  bwd.q = q.dev;
  bwd.k = k.dev;
  bwd.v = v.dev;
  bwd.out = out_dev;
  bwd.lse = lse_dev;
  bwd.cu_seqlens = cu.dev;
  gpu().attention_backward(bwd);
  bwd.dq = dq.host;
  bwd.dk = dk.host;
  bwd.dv = dv.host;
  bwd.dout = dout.host;
  bwd.q = q.host;
  bwd.k = k.host;
  bwd.v = v.host;
  bwd.out = out.host;
  bwd.lse = lse.host;
  bwd.cu_seqlens = cu.host;
  cpu().attention_backward(bwd);
  CUDA_TEST_EXPECT_CLOSE(dq.dev, dq.host.view(), tolerance_for(dtype), "dq");
  CUDA_TEST_EXPECT_CLOSE(dk.dev, dk.host.view(), tolerance_for(dtype), "dk");
  CUDA_TEST_EXPECT_CLOSE(dv.dev, dv.host.view(), tolerance_for(dtype), "dv");
}

const std::vector<std::vector<int32_t>> kLayouts = {
    {0, 1, 70, 73, 200},     // a length-1 segment first, then lengths not multiples of any tile
    {0, 64, 128, 128, 150},  // tile-aligned segments and an empty one
    {0, 300},                // one segment over several forward and backward tiles
};

TEST_CASE("cuda attention matches the CPU reference: MLA dims 192/128") {
  uint64_t seed = 100;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (const auto& layout : kLayouts) check_attention_case({layout, 2, 192, 128}, dtype, seed += 10);
}

TEST_CASE("cuda attention matches the CPU reference: small odd dims 10/5") {
  uint64_t seed = 200;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (const auto& layout : kLayouts) check_attention_case({layout, 3, 10, 5}, dtype, seed += 10);
}

TEST_CASE("cuda attention matches the CPU reference: the largest head dims 256/256 and qk < v") {
  check_attention_case({{0, 5, 133}, 1, 256, 256}, DType::kF32, 300);
  check_attention_case({{0, 5, 133}, 1, 256, 256}, DType::kBF16, 310);
  check_attention_case({{0, 97, 98}, 2, 64, 160}, DType::kF32, 320);
}

TEST_CASE("cuda attention forward writes one lse per (token, head) equal to log-sum-exp of the first key") {
  // A single token per segment attends to itself only: out = v, lse = scale * q . k.
  const std::vector<int32_t> cu_seqlens = {0, 1, 2, 3};
  const int64_t tokens = 3, heads = 2, dim = 4;
  Operand q = random_operand({tokens, heads, dim}, DType::kF32, 400);
  Operand k = random_operand({tokens, heads, dim}, DType::kF32, 401);
  Operand v = random_operand({tokens, heads, dim}, DType::kF32, 402);
  Operand cu = int_operand(cu_seqlens, Shape{4});
  Operand out = output_operand({tokens, heads, dim}, DType::kF32);
  Operand lse = output_operand({tokens, heads}, DType::kF32);
  kernels::AttentionArgs fwd;
  fwd.scale = 0.5;
  fwd.out = out.dev;
  fwd.lse = lse.dev;
  fwd.q = q.dev;
  fwd.k = k.dev;
  fwd.v = v.dev;
  fwd.cu_seqlens = cu.dev;
  gpu().attention_forward(fwd);
  const Tensor got_out = download(out.dev);
  const Tensor got_lse = download(lse.dev);
  for (int64_t r = 0; r < tokens * heads; ++r) {
    double dot = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      dot += testing::get_element(q.host.view(), r * dim + d) * testing::get_element(k.host.view(), r * dim + d);
      CHECK(std::fabs(testing::get_element(got_out.view(), r * dim + d) - testing::get_element(v.host.view(), r * dim + d)) <= 1e-6);
    }
    CHECK(std::fabs(testing::get_element(got_lse.view(), r) - 0.5 * dot) <= 1e-5);
  }
}

}  // namespace
