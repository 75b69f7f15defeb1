// The MXFP4 grouped GEMM (kernels/cuda/gemm/grouped_gemm_mxfp4.h) against dequantize-then-BF16-grouped-
// GEMM on the same GPU (the weights decoded by the CPU reference, kernels/cpu/mxfp4.h, rounded to
// BF16, which holds them exactly) and against the CPU reference in F64: the forward x W^T and the
// input gradient dy W, uneven and empty groups, rows not multiples of the tile, k and n tails
// (k % 64 == 32 leaves half of the last K step's scale groups out), skewed counts, BF16 and F32
// operands, beta 0 (poisoned outputs) and 1; shapes the wgmma kernel does not take use the
// fallback. A one-hot A reads every code at scales 2^-125 .. 2^125 back exactly.
// `[.bench]` (run on request: test_cuda_grouped_gemm_mxfp4 "[bench]") times it against the BF16
// grouped GEMM at Kimi K3's expert shapes and prints a table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/cuda/gemm/gemm.h"

namespace moetrain::cuda_test {
namespace {

using kernels::GroupedGemmArgs;
using kernels::GroupedGemmKind;
using kernels::cuda_ops::GroupedGemmPath;

// An MXFP4 weight [G, outer, inner] (packed along inner) on both sides, and its decoded values:
// F64 on the host, BF16 on the device.
struct Mxfp4Weight {
  Tensor packed_host, scales_host, decoded_host;
  Tensor packed, scales, decoded;
};

Mxfp4Weight mxfp4_weight(int64_t groups, int64_t outer, int64_t inner, uint64_t seed, int scale_lo, int scale_hi) {
  Mxfp4Weight w;
  w.packed_host = Tensor({groups, outer, inner / 2}, DType::kU8);
  w.scales_host = Tensor({groups, outer, inner / 32}, DType::kU8);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255), exponent(scale_lo, scale_hi);
  auto* bytes = static_cast<uint8_t*>(w.packed_host.data());
  for (int64_t i = 0; i < w.packed_host.numel(); ++i) bytes[i] = static_cast<uint8_t>(byte(rng));
  auto* exponents = static_cast<uint8_t*>(w.scales_host.data());
  for (int64_t i = 0; i < w.scales_host.numel(); ++i) exponents[i] = static_cast<uint8_t>(exponent(rng));
  w.decoded_host = Tensor({groups, outer, inner}, DType::kF64);
  kernels::cpu::mxfp4_dequantize(w.decoded_host.view(), w.packed_host.view(), w.scales_host.view());
  w.packed = upload(w.packed_host.view(), DType::kU8);
  w.scales = upload(w.scales_host.view(), DType::kU8);
  w.decoded = upload(w.decoded_host.view(), DType::kBF16);
  return w;
}

struct Run {
  DType a, c;
  bool transpose_b;
  double beta;
};

std::string label(const std::string& name, int64_t k, int64_t n, const Run& run) {
  return name + " k" + std::to_string(k) + " n" + std::to_string(n) + " " + dtype_name(run.a) + "->" +
         dtype_name(run.c) + (run.transpose_b ? " x.W^T" : " dy.W") + " beta " + std::to_string(run.beta);
}

// One M-grouped run: the MXFP4 kernel, the BF16 kernel on the decoded weight (the same device
// sums: required equal to 1e-6), and the CPU reference in F64 on the packed weight.
void check_mxfp4(const std::string& name, const std::vector<int32_t>& sizes, int64_t k, int64_t n, const Run& run,
                 bool expect_fast, uint64_t seed) {
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back();
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  const Operand a = gemm_input({rows, k}, run.a, seed + 1);
  const Mxfp4Weight w = run.transpose_b ? mxfp4_weight(groups, n, k, seed + 2, 118, 130)
                                        : mxfp4_weight(groups, k, n, seed + 2, 118, 130);
  Operand c = run.beta == 0.0 ? output_operand({rows, n}, run.c) : random_operand({rows, n}, run.c, seed + 3);
  const Tensor reference_c = upload(download(c.dev).view(), run.c);
  GroupedGemmArgs args;
  args.kind = GroupedGemmKind::kMGrouped;
  args.transpose_b = run.transpose_b;
  args.alpha = 0.75;
  args.beta = run.beta;
  args.a = a.dev;
  args.c = c.dev;
  args.group_offsets = group_offsets.dev;
  const std::string what = label(name, k, n, run);

  // Dequantize, then the BF16 grouped GEMM.
  args.b = w.decoded;
  args.c = reference_c;
  gpu().grouped_gemm(args);

  args.b = w.packed;
  args.b_scale = w.scales;
  args.c = c.dev;
  const bool fast = kernels::cuda_ops::grouped_gemm_path(args) == GroupedGemmPath::kSm90;
  INFO(what << (fast ? ": wgmma kernel" : ": fallback kernel"));
  if (device_is_sm90()) CHECK(fast == expect_fast);
  gpu().grouped_gemm(args);
  const Tensor expected = download(reference_c);
  CUDA_TEST_EXPECT_CLOSE(c.dev, expected.view(), (Tolerance{1e-6, 1e-6, 1e-6}), what + " vs bf16 grouped GEMM");

  args.a = a.host;
  args.b = w.packed_host;
  args.b_scale = w.scales_host;
  args.c = c.host;
  args.group_offsets = group_offsets.host;
  args.host_group_offsets = offsets.data();
  cpu().grouped_gemm(args);
  CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(run.c), what + " vs CPU F64");
}

const Run kRuns[] = {
    {DType::kBF16, DType::kBF16, true, 0.0}, {DType::kBF16, DType::kF32, true, 1.0},
    {DType::kF32, DType::kBF16, true, 1.0},  {DType::kBF16, DType::kBF16, false, 1.0},
    {DType::kBF16, DType::kF32, false, 0.0}, {DType::kF32, DType::kF32, false, 0.0},
};

TEST_CASE("cuda grouped_gemm MXFP4: uneven and empty groups, k and n tails, both layouts") {
  // 879 rows over ten groups (four empty; 300 and 257 rows take two row tiles). Forward: k = 160
  // is two K steps and a half one, n = 272 two full 128-column tiles and one of 16; input
  // gradient: k = 136, n = 288 (the last tile 32 columns).
  const std::vector<int32_t> sizes = {0, 300, 0, 129, 1, 64, 0, 257, 128, 0};
  uint64_t seed = 10;
  for (const Run& run : kRuns) {
    if (run.transpose_b) {
      check_mxfp4("uneven", sizes, 160, 272, run, true, seed += 10);
    } else {
      check_mxfp4("uneven", sizes, 136, 288, run, true, seed += 10);
    }
  }
}

TEST_CASE("cuda grouped_gemm MXFP4: narrow and partial weight tiles") {
  const std::vector<int32_t> sizes = {77, 0, 150, 3, 0, 260, 129, 40};
  uint64_t seed = 200;
  for (const Run& run : {kRuns[0], kRuns[3]}) {
    check_mxfp4("n 40", sizes, 64, run.transpose_b ? 40 : 64, run, true, seed += 10);
    check_mxfp4("n 96", sizes, 96, 96, run, true, seed += 10);
    check_mxfp4("n 128", sizes, 32, 128, run, true, seed += 10);
  }
}

TEST_CASE("cuda grouped_gemm MXFP4: the forward kernel's every N (rows of a group rounded up to 32)") {
  // The forward kernel (x W^T) multiplies up to 256 rows of a group per tile with N = the rows
  // rounded up to 32: these groups take N = 32, 64, ..., 256 (and 513 rows three tiles); k = 96
  // ends on half a K step, n = 136 on a tile of 8 weight rows (one warpgroup idle).
  const std::vector<int32_t> sizes = {20, 50, 70, 100, 0, 130, 170, 200, 230, 256, 513, 1};
  check_mxfp4("every N", sizes, 96, 136, kRuns[0], true, 300);
  check_mxfp4("every N", sizes, 256, 48, kRuns[1], true, 310);
}

TEST_CASE("cuda grouped_gemm MXFP4: the input gradient's every N, k and n tails") {
  // dy W, as the forward: N = 32, 64, ..., 256 and three tiles for 513 rows; k = 136 ends on a K
  // step of 8 rows, k = 72 on one of 8 after a full one; n = 160 and 800 end on 32 columns of a
  // 128-column tile (one warpgroup idle, half of the other's warps storing nothing). n = 1536 and
  // 512 (n % 512 == 0) take the scales by TMA in boxes of 16 groups: 1536 has three boxes, each
  // shared by four tiles (the tile's groups at 0, 4, 8, 12 of the box); k = 136 and 200 end on
  // boxes of 8 k rows inside the group (the rest arrive as zeros, not the next group's scales).
  const std::vector<int32_t> sizes = {20, 50, 70, 100, 0, 130, 170, 200, 230, 256, 513, 1};
  check_mxfp4("every N", sizes, 136, 256, kRuns[3], true, 340);
  check_mxfp4("every N", sizes, 64, 800, kRuns[4], true, 350);
  check_mxfp4("every N", sizes, 72, 160, kRuns[5], true, 360);
  check_mxfp4("every N, TMA scales", sizes, 136, 1536, kRuns[3], true, 370);
  check_mxfp4("every N, TMA scales", sizes, 200, 512, kRuns[4], true, 380);
}

TEST_CASE("cuda grouped_gemm MXFP4: the kimi_k3_mxfp4_bf16 golden fixture's expert shapes") {
  // That fixture (tests/cuda/test_cuda_golden_model.cpp) routes each of its 140 tokens to all 8
  // experts of latent width 32 and expert width 64: forward gate_up k = 32 (half a K step),
  // n = 128; down k = 64, n = 32 (one warpgroup idle); input gradient gate_up k = 128, n = 32 (one
  // scale group per k row, packed rows of 16 bytes: the only shape here no other case has), down
  // k = 32, n = 64.
  const std::vector<int32_t> sizes(8, 140);
  uint64_t seed = 500;
  for (const Run& run : kRuns) {
    if (run.transpose_b) {
      check_mxfp4("K3 fixture gate_up", sizes, 32, 128, run, true, seed += 10);
      check_mxfp4("K3 fixture down", sizes, 64, 32, run, true, seed += 10);
    } else {
      check_mxfp4("K3 fixture gate_up", sizes, 128, 32, run, true, seed += 10);
      check_mxfp4("K3 fixture down", sizes, 32, 64, run, true, seed += 10);
    }
  }
}

TEST_CASE("cuda grouped_gemm MXFP4: random skewed counts, one group holding every row") {
  uint64_t seed = 400;
  const std::vector<int32_t> sizes = skewed_sizes(40, 48, 7);
  check_mxfp4("skewed", sizes, 256, 128, kRuns[0], true, seed += 10);
  check_mxfp4("skewed", sizes, 128, 256, kRuns[4], true, seed += 10);
  check_mxfp4("one group", {0, 0, 517, 0}, 320, 512, kRuns[1], true, seed += 10);
  check_mxfp4("one group", {0, 0, 517, 0}, 320, 512, kRuns[3], true, seed += 10);
}

TEST_CASE("cuda grouped_gemm MXFP4: shapes the wgmma kernel does not take use the fallback") {
  const std::vector<int32_t> sizes = {0, 7, 0, 13, 1, 0, 140};
  check_mxfp4("n not a multiple of 8", sizes, 64, 20, kRuns[0], false, 600);
  check_mxfp4("k not a multiple of 8", sizes, 44, 64, kRuns[3], false, 610);
  check_mxfp4("k not a multiple of 8", sizes, 44, 64, kRuns[5], false, 620);
}

TEST_CASE("cuda grouped_gemm MXFP4: every code at extreme scales decodes exactly (one-hot rows)") {
  // Row r of group g is the unit vector e_(r % k): c[r] is column (or row) r % k of W[g], exact in
  // F32. Scales 2..252 keep every weight a normal BF16 number. The input gradient with n = 512
  // takes its scales by TMA (n = 256 by the converters' loads).
  struct OneHotShape {
    bool transpose_b;
    int64_t n;
  };
  for (const OneHotShape& shape : {OneHotShape{true, 256}, OneHotShape{false, 256}, OneHotShape{false, 512}}) {
    const bool transpose_b = shape.transpose_b;
    const int64_t groups = 2, k = 128, n = shape.n;
    const std::vector<int32_t> offsets = {0, static_cast<int32_t>(k), static_cast<int32_t>(2 * k)};
    const Operand group_offsets = int_operand(offsets, {groups + 1});
    Tensor a_host = Tensor::zeros({groups * k, k}, DType::kF64);
    for (int64_t r = 0; r < groups * k; ++r) a_host.ptr<double>()[r * k + r % k] = 1.0;
    const Tensor a = upload(a_host.view(), DType::kBF16);
    const Mxfp4Weight w = transpose_b ? mxfp4_weight(groups, n, k, 77, 2, 252) : mxfp4_weight(groups, k, n, 78, 2, 252);
    Tensor c = poisoned({groups * k, n}, DType::kF32);
    GroupedGemmArgs args;
    args.a = a;
    args.b = w.packed;
    args.b_scale = w.scales;
    args.c = c;
    args.group_offsets = group_offsets.dev;
    args.transpose_b = transpose_b;
    gpu().grouped_gemm(args);
    const Tensor got = download(c);
    int64_t mismatches = 0, first = -1;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t q = 0; q < k; ++q)
        for (int64_t j = 0; j < n; ++j) {
          const double expected = transpose_b ? w.decoded_host.ptr<double>()[(g * n + j) * k + q]
                                              : w.decoded_host.ptr<double>()[(g * k + q) * n + j];
          if (got.ptr<double>()[(g * k + q) * n + j] != expected) {
            if (first < 0) first = (g * k + q) * n + j;
            ++mismatches;
          }
        }
    INFO((transpose_b ? "x.W^T" : "dy.W") << " n " << n << ": " << mismatches << " of " << got.numel()
                                          << " differ, first at " << first);
    CHECK(mismatches == 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Timing at K3's expert shapes: one expert-parallel rank of eight, 112 of the 896 experts and the
// 16384 rows that 8192 tokens x top-16 send it on average, routed uniformly at random. Also checks
// the output against the BF16 kernel's on the decoded weight.

double median_ms(const std::function<void()>& op, int reps) {
  cudaStream_t stream = static_cast<cudaStream_t>(gpu().stream());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  op();  // warm-up (and the kernels' one-time attributes)
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(start, stream);
    op();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A device tensor of `shape` whose first slice [0] (random bytes from `fill`) is copied into every
// slice: no host array of the whole size, and every slice still a separate read.
Tensor replicated(Shape shape, DType dtype, const std::function<void(Tensor&)>& fill) {
  Shape first_shape = shape;
  first_shape[0] = 1;
  Tensor first(first_shape, dtype);
  fill(first);
  Tensor slice = upload(first.view(), dtype);
  Tensor all(shape, dtype, cuda::device_allocator());
  for (int64_t g = 0; g < shape[0]; ++g) gpu().copy(all.view().slice_rows(g, g + 1), slice.view());
  return all;
}

TEST_CASE("cuda grouped_gemm MXFP4 timing at Kimi K3 expert shapes", "[.bench]") {
  const int64_t experts = 112, tokens_per_rank = 1024, top_k = 16, rows = tokens_per_rank * top_k;
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0);
  std::mt19937_64 rng(1);
  for (int64_t i = 0; i < rows; ++i) ++counts[static_cast<size_t>(rng() % experts)];
  const std::vector<int32_t> offsets = prefix_sums(counts);
  const Operand group_offsets = int_operand(offsets, {experts + 1});
  struct Shape2 {
    const char* name;
    int64_t out, in;  // the weight [out, in]
  };
  std::printf("\nMXFP4 vs BF16 grouped GEMM, %lld experts, %lld rows (K3: 8192 tokens x top-16 over EP8)\n",
              static_cast<long long>(experts), static_cast<long long>(rows));
  std::printf("%-34s %9s %9s %7s %9s %9s %9s %9s\n", "projection", "bf16 ms", "mxfp4 ms", "ratio", "bf16 TF/s",
              "mxfp4 TF/s", "bf16 GB/s", "mxfp4 GB/s");
  for (const Shape2 s : {Shape2{"gate_up 3584 -> 2x3072", 2 * 3072, 3584}, Shape2{"down 3072 -> 3584", 3584, 3072}}) {
    // One expert's packed weight, replicated; the BF16 kernel multiplies its exact decoding, so
    // the two outputs must agree (at K3's sizes every CTA runs dozens of tiles).
    Tensor packed_slice({1, s.out, s.in / 2}, DType::kU8), scales_slice({1, s.out, s.in / 32}, DType::kU8);
    std::mt19937_64 r(7);
    auto* bytes = static_cast<uint8_t*>(packed_slice.data());
    for (int64_t i = 0; i < packed_slice.numel(); ++i) bytes[i] = static_cast<uint8_t>(r());
    auto* exponents = static_cast<uint8_t*>(scales_slice.data());
    for (int64_t i = 0; i < scales_slice.numel(); ++i) exponents[i] = static_cast<uint8_t>(117 + r() % 6);
    Tensor decoded_slice({1, s.out, s.in}, DType::kF64);
    kernels::cpu::mxfp4_dequantize(decoded_slice.view(), packed_slice.view(), scales_slice.view());
    auto copy_of = [](const Tensor* slice) {
      return [slice](Tensor& t) {
        if (t.dtype() == slice->dtype()) {
          std::copy_n(static_cast<const uint8_t*>(slice->data()), t.nbytes(), static_cast<uint8_t*>(t.data()));
        } else {
          convert_host(t.view(), slice->view());
        }
      };
    };
    const Tensor packed = replicated({experts, s.out, s.in / 2}, DType::kU8, copy_of(&packed_slice));
    const Tensor scales = replicated({experts, s.out, s.in / 32}, DType::kU8, copy_of(&scales_slice));
    const Tensor dense = replicated({experts, s.out, s.in}, DType::kBF16, copy_of(&decoded_slice));
    const Operand x = random_operand({rows, s.in}, DType::kBF16, 10);
    const Operand dy = random_operand({rows, s.out}, DType::kBF16, 11);
    Tensor y({rows, s.out}, DType::kBF16, cuda::device_allocator());
    Tensor y_bf16({rows, s.out}, DType::kBF16, cuda::device_allocator());
    Tensor dx({rows, s.in}, DType::kBF16, cuda::device_allocator());
    Tensor dx_bf16({rows, s.in}, DType::kBF16, cuda::device_allocator());
    for (bool forward : {true, false}) {
      GroupedGemmArgs args;
      args.a = forward ? x.dev : dy.dev;
      args.c = forward ? y_bf16 : dx_bf16;
      args.transpose_b = forward;
      args.group_offsets = group_offsets.dev;
      args.b = dense;
      const double bf16_ms = median_ms([&] { gpu().grouped_gemm(args); }, 20);
      args.c = forward ? y : dx;
      args.b = packed;
      args.b_scale = scales;
      const bool fast = kernels::cuda_ops::grouped_gemm_path(args) == GroupedGemmPath::kSm90;
      const double mxfp4_ms = median_ms([&] { gpu().grouped_gemm(args); }, 20);
      const double flops = 2.0 * static_cast<double>(rows) * s.out * s.in;
      const double bf16_bytes = static_cast<double>(dense.nbytes());
      const double mxfp4_bytes = static_cast<double>(packed.nbytes() + scales.nbytes());
      const std::string name = std::string(s.name) + (forward ? " fwd x.W^T" : " igrad dy.W");
      std::printf("%-34s %9.3f %9.3f %7.3f %9.1f %9.1f %9.1f %9.1f%s\n", name.c_str(), bf16_ms, mxfp4_ms,
                  bf16_ms / mxfp4_ms, flops / bf16_ms / 1e9, flops / mxfp4_ms / 1e9, bf16_bytes / bf16_ms / 1e6,
                  mxfp4_bytes / mxfp4_ms / 1e6, fast ? "" : "  (fallback kernel!)");
      CHECK(fast);
      const Tensor expected = download(forward ? y_bf16 : dx_bf16);
      CUDA_TEST_EXPECT_CLOSE(forward ? y : dx, expected.view(), (Tolerance{1e-6, 1e-6, 1e-6}),
                             name + " vs bf16 grouped GEMM of the decoded weight");
    }
  }
  std::printf("ratio = bf16 ms / mxfp4 ms (target >= 0.9); GB/s = weight bytes read once / time\n");
}

}  // namespace
}  // namespace moetrain::cuda_test
