// CUDA attention forward and backward against the CPU reference (F64) on the same inputs:
// segment layouts with a length-1 segment, an empty one, segments that are not multiples of the
// tiles and one longer than several tiles; head dims MLA's 192/128, small odd 10/5 and the 256
// maximum; F32 (tight) and BF16 (relative L2 well under 1e-2) storage. Outputs are poisoned
// with NaN first, so an element a kernel forgets to write fails the comparison. Three paths are
// covered: the Hopper flash attention (BF16 64/64, 128/128, 192/128 on sm_90), the mma.sync
// tensor-core path (other BF16 dims, or MOETRAIN_ATTENTION=mma) and SIMT (the rest, or =simt).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "kernels/cuda/attention/flash_attention_sm90.h"

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
  return std::string(dtype_name(dtype)) + " heads " + std::to_string(c.heads) + " dims " + std::to_string(c.qk_dim) +
         "/" + std::to_string(c.v_dim) + " " + cu_seqlens_label(c.cu_seqlens);
}

// The inputs of one attention problem (forward and backward) on both backends.
struct AttentionInputs {
  Operand q, k, v, dout, cu;
  double scale;
};

// Random inputs: q and k of magnitudes up to 2, so that softmax rows are far from uniform; v and
// dout up to 1; the usual scale 1 / sqrt(qk_dim).
AttentionInputs attention_inputs(const std::vector<int32_t>& cu_seqlens, int64_t heads, int64_t qk_dim, int64_t v_dim,
                                 DType dtype, uint64_t seed) {
  const int64_t tokens = cu_seqlens.back();
  const Shape qk_shape{tokens, heads, qk_dim}, v_shape{tokens, heads, v_dim};
  return {random_operand(qk_shape, dtype, seed, 0.05, 2.0),
          random_operand(qk_shape, dtype, seed + 1, 0.05, 2.0),
          random_operand(v_shape, dtype, seed + 2, 0.05, 1.0),
          random_operand(v_shape, dtype, seed + 3, 0.05, 1.0),
          cu_seqlens_operand(cu_seqlens),
          1.0 / std::sqrt(static_cast<double>(qk_dim))};
}

// The forward's outputs (out, lse: what the backward reads) and the backward's, poisoned on the
// device; out and the gradients in `dtype`, lse in F32.
struct AttentionResults {
  Operand out, lse, dq, dk, dv;
};

AttentionResults attention_results(const AttentionInputs& in, DType dtype) {
  const Shape qk_shape = in.q.host.shape(), v_shape = in.v.host.shape();
  return {output_operand(v_shape, dtype), output_operand({qk_shape[0], qk_shape[1]}, DType::kF32),
          output_operand(qk_shape, dtype), output_operand(qk_shape, dtype), output_operand(v_shape, dtype)};
}

kernels::AttentionArgs forward_args(BackendSide on, const AttentionInputs& in, const AttentionResults& r) {
  kernels::AttentionArgs args;
  args.scale = in.scale;
  args.out = on(r.out);
  args.lse = on(r.lse);
  args.q = on(in.q);
  args.k = on(in.k);
  args.v = on(in.v);
  args.cu_seqlens = on(in.cu);
  return args;
}

kernels::AttentionBackwardArgs backward_args(BackendSide on, const AttentionInputs& in, const AttentionResults& r) {
  kernels::AttentionBackwardArgs args;
  args.scale = in.scale;
  args.dq = on(r.dq);
  args.dk = on(r.dk);
  args.dv = on(r.dv);
  args.dout = on(in.dout);
  args.q = on(in.q);
  args.k = on(in.k);
  args.v = on(in.v);
  args.out = on(r.out);
  args.lse = on(r.lse);
  args.cu_seqlens = on(in.cu);
  return args;
}

// gradient_atol_scale widens the gradients' absolute tolerance (see the Hopper cases below).
void check_attention_case(const AttentionCase& c, DType dtype, uint64_t seed, double gradient_atol_scale = 1.0) {
  INFO(describe(c, dtype));
  const AttentionInputs in = attention_inputs(c.cu_seqlens, c.heads, c.qk_dim, c.v_dim, dtype, seed);
  AttentionResults r = attention_results(in, dtype);
  gpu().attention_forward(forward_args(kGpu, in, r));
  cpu().attention_forward(forward_args(kCpu, in, r));
  CUDA_TEST_EXPECT_CLOSE(r.out.dev, r.out.host.view(), tolerance_for(dtype), "out");
  CUDA_TEST_EXPECT_CLOSE(r.lse.dev, r.lse.host.view(), tolerance_for(DType::kF32), "lse");

  // Backward from the CPU's out and lse, rounded to what the device stores, on both backends.
  round_and_upload(r.out, dtype);
  round_and_upload(r.lse, DType::kF32);
  gpu().attention_backward(backward_args(kGpu, in, r));
  cpu().attention_backward(backward_args(kCpu, in, r));
  Tolerance gradient = tolerance_for(dtype);
  gradient.atol_fraction *= gradient_atol_scale;
  CUDA_TEST_EXPECT_CLOSE(r.dq.dev, r.dq.host.view(), gradient, "dq");
  CUDA_TEST_EXPECT_CLOSE(r.dk.dev, r.dk.host.view(), gradient, "dk");
  CUDA_TEST_EXPECT_CLOSE(r.dv.dev, r.dv.host.view(), gradient, "dv");
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
  const int64_t tokens = 3, heads = 2, dim = 4;
  // Forward only: no dout.
  const AttentionInputs in{random_operand({tokens, heads, dim}, DType::kF32, 400),
                           random_operand({tokens, heads, dim}, DType::kF32, 401),
                           random_operand({tokens, heads, dim}, DType::kF32, 402),
                           Operand{},
                           cu_seqlens_operand({0, 1, 2, 3}),
                           0.5};
  const AttentionResults results = attention_results(in, DType::kF32);
  gpu().attention_forward(forward_args(kGpu, in, results));
  const Tensor got_out = download(results.out.dev);
  const Tensor got_lse = download(results.lse.dev);
  for (int64_t r = 0; r < tokens * heads; ++r) {
    double dot = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      dot += testing::get_element(in.q.host.view(), r * dim + d) * testing::get_element(in.k.host.view(), r * dim + d);
      CHECK(std::fabs(testing::get_element(got_out.view(), r * dim + d) - testing::get_element(in.v.host.view(), r * dim + d)) <= 1e-6);
    }
    CHECK(std::fabs(testing::get_element(got_lse.view(), r) - 0.5 * dot) <= 1e-5);
  }
}

// --- The BF16 tensor-core path (attention_sm80.cu): all-BF16 operands, head dims that are
// multiples of 16. Its CTAs hold 64 queries (forward, dq) or 64 keys (dk/dv) and step over 64 keys
// or 32 queries, so these layouts put segment boundaries inside blocks, length-1 segments at a
// block start, inside and at the end, and totals that are not multiples of 64.
const std::vector<std::vector<int32_t>> kTensorCoreLayouts = {
    {0, 1, 70, 73, 200},                // from kLayouts: a length-1 segment first
    {0, 63, 64, 65, 129, 130, 257},     // length-1 segments at 63, 64 and 129 (block edges)
    {0, 190, 191},                      // a long segment over three blocks, then a length-1 one
    {0, 40},                            // less than one block
};

TEST_CASE("cuda attention tensor-core path matches the CPU reference: BF16 dims 192/128, 128/128, 64/64") {
  uint64_t seed = 500;
  for (const auto& layout : kTensorCoreLayouts) {
    check_attention_case({layout, 3, 192, 128}, DType::kBF16, seed += 10);
    check_attention_case({layout, 2, 128, 128}, DType::kBF16, seed += 10);
    check_attention_case({layout, 2, 64, 64}, DType::kBF16, seed += 10);
  }
}

TEST_CASE("cuda attention tensor-core path matches the CPU reference: BF16 dims padded to a bucket") {
  // 32/48 runs in the 64/64 bucket, 96/64 in 128/128, 160/112 in 192/128 (zero-filled columns);
  // 256/256 forward runs on tensor cores, its backward on SIMT.
  check_attention_case({{0, 1, 70, 73, 200}, 2, 32, 48}, DType::kBF16, 600);
  check_attention_case({{0, 63, 64, 65, 129, 130, 257}, 2, 96, 64}, DType::kBF16, 610);
  check_attention_case({{0, 190, 191}, 2, 160, 112}, DType::kBF16, 620);
  check_attention_case({{0, 5, 133}, 1, 256, 256}, DType::kBF16, 630);
}

// The kernel-path switch (unset: the default choice; "simt", "mma").
constexpr const char* kAttentionPath = "MOETRAIN_ATTENTION";

// Forward and backward outputs (downloaded) of one GPU path.
struct PathOutputs {
  Tensor out, lse, dq, dk, dv;
};

// BF16 attention forward, then backward from that forward's out and lse, on the GPU alone.
PathOutputs run_gpu_attention(const AttentionInputs& in) {
  const AttentionResults r = attention_results(in, DType::kBF16);
  gpu().attention_forward(forward_args(kGpu, in, r));
  gpu().attention_backward(backward_args(kGpu, in, r));
  return {download(r.out.dev), download(r.lse.dev), download(r.dq.dev), download(r.dk.dev), download(r.dv.dev)};
}

bool differs_somewhere(const TensorView& a, const TensorView& b) {
  for (int64_t i = 0; i < a.numel(); ++i)
    if (testing::get_element(a, i) != testing::get_element(b, i)) return true;
  return false;
}

// Two GPU paths agree: out and the gradients within twice tolerance_for(BF16) in relative L2 and
// rtol, and `atol_scale` times its absolute part (each path is within tolerance_for(BF16) of the
// F64 reference); lse, F32, within 1e-5.
void expect_paths_agree(const PathOutputs& got, const PathOutputs& reference, double atol_scale) {
  const Tolerance one = tolerance_for(DType::kBF16);
  const Tolerance bf16{2 * one.rel_l2, 2 * one.rtol, atol_scale * one.atol_fraction};
  const struct {
    const char* name;
    const Tensor& got;
    const Tensor& reference;
    Tolerance tolerance;
  } pairs[] = {{"out", got.out, reference.out, bf16},
               {"lse", got.lse, reference.lse, {1e-5, 1e-4, 1e-5}},
               {"dq", got.dq, reference.dq, bf16},
               {"dk", got.dk, reference.dk, bf16},
               {"dv", got.dv, reference.dv, bf16}};
  for (const auto& pair : pairs) {
    const Result r = compare(pair.got.view(), pair.reference.view(), pair.tolerance, pair.name);
    INFO(r.message);
    CHECK(r.ok);
  }
}

TEST_CASE("cuda attention: MOETRAIN_ATTENTION=simt switches paths, and the SIMT and tensor-core paths agree") {
  const AttentionInputs in = attention_inputs({0, 1, 70, 73, 200, 201, 330}, 2, 192, 128, DType::kBF16, 700);
  PathOutputs tensor_core, simt;
  {
    const ScopedEnv env(kAttentionPath, nullptr);
    tensor_core = run_gpu_attention(in);
  }
  {
    const ScopedEnv env(kAttentionPath, "simt");
    simt = run_gpu_attention(in);
  }
  // Each path is within tolerance_for(BF16) of the F64 reference (the cases above), so the two
  // agree within twice that.
  expect_paths_agree(tensor_core, simt, 2);
  // The paths round differently (the tensor-core one feeds P and dS to the mma as BF16), so
  // identical bits everywhere would mean the variable did not switch anything.
  CHECK(differs_somewhere(tensor_core.out.view(), simt.out.view()));
  CHECK(differs_somewhere(tensor_core.dk.view(), simt.dk.view()));
}

// --- The Hopper flash path (flash_attention_sm90_*.cu). Its CTAs hold 128 queries (forward, dQ)
// or 128 keys (dK/dV); it steps over 128-key (forward) and 64-key (dQ) tiles that start at the
// first query's segment start, and over 64-query (32 for qk 192) tiles in dK/dV. These layouts run
// over several CTAs: totals that are not multiples of any tile, segments that straddle blocks,
// length-1 segments at block edges, an empty segment, and tile-aligned packed documents.

const std::vector<std::vector<int32_t>> kFlashLayouts = {
    {0, 700},                                 // one segment over 6 query blocks
    {0, 1, 129, 130, 385, 512, 513, 901},     // length-1 segments at block edges, straddling segments
    {0, 256, 512, 768, 1024},                 // tile-aligned packed documents
    {0, 97, 98, 300, 300, 611},               // an empty segment, short ones inside one block
};

TEST_CASE("cuda attention: the Hopper flash path is taken on sm_90 for BF16 64/64, 128/128, 192/128 only") {
  if (!device_is_sm90()) {
    WARN("not a compute capability 9.0 device: the Hopper path is not expected here");
    return;
  }
  struct Dims {
    int64_t qk, v;
    DType dtype;
    bool expected;
  };
  const Dims cases[] = {{64, 64, DType::kBF16, true},   {128, 128, DType::kBF16, true},
                        {192, 128, DType::kBF16, true}, {96, 64, DType::kBF16, false},
                        {128, 64, DType::kBF16, false}, {128, 128, DType::kF32, false}};
  const int64_t tokens = 8, heads = 2;
  for (const Dims& d : cases) {
    INFO("dims " << d.qk << "/" << d.v << " " << dtype_name(d.dtype));
    Operand q = random_operand({tokens, heads, d.qk}, d.dtype, 800);
    Operand v = random_operand({tokens, heads, d.v}, d.dtype, 801);
    Operand out = output_operand({tokens, heads, d.v}, d.dtype);
    Operand lse = output_operand({tokens, heads}, DType::kF32);
    Operand dq = output_operand({tokens, heads, d.qk}, d.dtype);
    Operand dv = output_operand({tokens, heads, d.v}, d.dtype);
    Operand cu = int_operand({0, static_cast<int32_t>(tokens)}, Shape{2});
    kernels::AttentionArgs fwd{out.dev, lse.dev, q.dev, q.dev, v.dev, cu.dev, 0.125};
    kernels::AttentionBackwardArgs bwd{dq.dev, dq.dev, dv.dev, out.dev, q.dev, q.dev, v.dev, out.dev, lse.dev,
                                       cu.dev, 0.125};
    CHECK(kernels::cuda_ops::flash_attention_forward_sm90_supported(fwd) == d.expected);
    CHECK(kernels::cuda_ops::flash_attention_backward_sm90_supported(bwd) == d.expected);
    const ScopedEnv env(kAttentionPath, "mma");
    CHECK_FALSE(kernels::cuda_ops::flash_attention_forward_sm90_supported(fwd));
    CHECK_FALSE(kernels::cuda_ops::flash_attention_backward_sm90_supported(bwd));
  }
}

TEST_CASE("cuda attention Hopper path matches the CPU reference over several blocks: BF16 64/64, 128/128, 192/128") {
  // The gradients' absolute tolerance is doubled here: a dq or dk element is a sum of dS k (or
  // dS q) terms with dS rounded to BF16 for the tensor cores (as every BF16 flash attention does),
  // and where the terms cancel, one rounding (2^-9 of a term) is a large part of the result. With
  // ~10^5 elements per gradient, single elements reach 2e-3 of the largest (seen on an H200: 1 of
  // 131072 dq elements at 2.2e-3, 64/64, four 256-token documents); the relative L2 limit is kept.
  uint64_t seed = 900;
  for (const auto& layout : kFlashLayouts) {
    check_attention_case({layout, 2, 64, 64}, DType::kBF16, seed += 10, 2.0);
    check_attention_case({layout, 2, 128, 128}, DType::kBF16, seed += 10, 2.0);
    check_attention_case({layout, 2, 192, 128}, DType::kBF16, seed += 10, 2.0);
  }
}

TEST_CASE("cuda attention Hopper path matches the CPU reference when each CTA takes several works") {
  // The Hopper passes are persistent: a CTA per multiprocessor takes (128-token block, head)
  // works one after another (flash_attention_common_sm90.cuh, WorkRing). 5 blocks x 80 heads =
  // 400 works (more heads on a GPU of over 133 multiprocessors): at least 3 per CTA. The blocks
  // differ in length and in their segments, so consecutive works of one CTA change head, block
  // and mask.
  if (!device_is_sm90()) {
    WARN("not a compute capability 9.0 device: the Hopper path is not taken here");
    return;
  }
  int device = 0, multiprocessors = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) == cudaSuccess);
  const std::vector<int32_t> layout = {0, 97, 300, 301, 520};
  const int64_t heads = std::max<int64_t>(80, (3 * multiprocessors + 4) / 5);
  check_attention_case({layout, heads, 64, 64}, DType::kBF16, 1500, 2.0);
  check_attention_case({layout, heads, 128, 128}, DType::kBF16, 1510, 2.0);
  check_attention_case({layout, heads, 192, 128}, DType::kBF16, 1520, 2.0);
}

TEST_CASE("cuda attention Hopper path: the backward is deterministic and agrees with the mma.sync path") {
  // The second layout has 100 blocks of 128 tokens per head: on a GPU of up to 200
  // multiprocessors (the H100 and H200 have 132) its 5 heads are launched in groups of 4
  // (launch_order_group), so the last group holds one head.
  struct Layout {
    std::vector<int32_t> cu_seqlens;
    int64_t heads;
  };
  const Layout layouts[] = {{{0, 1, 129, 130, 385, 512, 513, 777}, 3}, {{0, 3000, 8229, 12763}, 5}};
  for (const Layout& layout : layouts) {
    const std::vector<int32_t>& cu_seqlens = layout.cu_seqlens;
    const int64_t tokens = cu_seqlens.back(), heads = layout.heads;
    for (const auto& dims : {std::pair<int64_t, int64_t>{64, 64}, std::pair<int64_t, int64_t>{128, 128},
                             std::pair<int64_t, int64_t>{192, 128}}) {
      const int64_t qk_dim = dims.first, v_dim = dims.second;
      INFO("tokens " << tokens << " heads " << heads << " dims " << qk_dim << "/" << v_dim);
      const AttentionInputs in = attention_inputs(cu_seqlens, heads, qk_dim, v_dim, DType::kBF16, 1000 + qk_dim);
      PathOutputs first, second, mma;
      {
        const ScopedEnv env(kAttentionPath, nullptr);
        first = run_gpu_attention(in);
        second = run_gpu_attention(in);
      }
      {
        const ScopedEnv env(kAttentionPath, "mma");
        mma = run_gpu_attention(in);
      }
      // Bit for bit from run to run: no atomics, a fixed order of every sum.
      CHECK_FALSE(differs_somewhere(first.out.view(), second.out.view()));
      CHECK_FALSE(differs_somewhere(first.lse.view(), second.lse.view()));
      CHECK_FALSE(differs_somewhere(first.dq.view(), second.dq.view()));
      CHECK_FALSE(differs_somewhere(first.dk.view(), second.dk.view()));
      CHECK_FALSE(differs_somewhere(first.dv.view(), second.dv.view()));
      // Each path is within tolerance_for(BF16) of the F64 reference, so the two agree within twice
      // that; they tile and round differently, so identical bits would mean no switch happened.
      // With up to 5229 keys in a row, single gradient elements where many dS k terms cancel go
      // further from either path's F64 value (see the case above), so the long layout allows 4x
      // the absolute part; relative L2 and the relative part stay.
      expect_paths_agree(first, mma, tokens > 1000 ? 4 : 2);
      if (device_is_sm90()) CHECK(differs_somewhere(first.dq.view(), mma.dq.view()));
    }
  }
}

}  // namespace
