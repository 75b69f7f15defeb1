// The device-side grouped GEMM (kernels/cuda/gemm/grouped_gemm.h) against the CPU reference (F64):
// M-grouped (x W^T and dy W) and K-grouped (weight gradients), with empty groups, one group
// holding every row, row counts that are not multiples of the 128-row tile, random skewed
// counts, every size of a group's last tile with 256-column tiles, the thin LoRA shapes (n or k
// of 16 and 32), the second product a2 . op(b2) that folds a LoRA term into the base GEMM, BF16
// and F32 outputs, F32 inputs, beta 0 (outputs poisoned with NaN: every element must be written
// and c never read) and beta 1.
// On a Hopper GPU the aligned shapes must take the wgmma kernel, the others the fallback; every
// M-grouped x W^T case runs with both of its tilings (a group's rows as wgmma's M, and as its N).
// The group offsets go to the GPU alone in half the runs (the kernel never sees a host copy).
#include <functional>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "kernels/cuda/gemm/gemm.h"

namespace moetrain::cuda_test {
namespace {

using kernels::GroupedGemmArgs;
using kernels::GroupedGemmKind;
using kernels::cuda_ops::GroupedGemmPath;
using kernels::cuda_ops::GroupedGemmTiling;

// Forces the wgmma kernel's tiling for its lifetime, then gives the choice back to the shape.
class ForcedTiling {
 public:
  explicit ForcedTiling(GroupedGemmTiling tiling) { kernels::cuda_ops::set_grouped_gemm_tiling(tiling); }
  ~ForcedTiling() { kernels::cuda_ops::set_grouped_gemm_tiling(GroupedGemmTiling::kAuto); }
  ForcedTiling(const ForcedTiling&) = delete;
  ForcedTiling& operator=(const ForcedTiling&) = delete;
};

struct DtypeCase {
  DType a, b, c;
};
const DtypeCase kBf16ToBf16{DType::kBF16, DType::kBF16, DType::kBF16};
const DtypeCase kBf16ToF32{DType::kBF16, DType::kBF16, DType::kF32};
const DtypeCase kF32ToF32{DType::kF32, DType::kF32, DType::kF32};
const DtypeCase kF32ToBf16{DType::kF32, DType::kF32, DType::kBF16};

struct Run {
  DtypeCase dtypes;
  bool transpose_b;
  double beta;
  bool host_offsets;
};

std::string label(const std::string& name, const Run& run) {
  return name + " " + dtype_name(run.dtypes.a) + "/" + dtype_name(run.dtypes.b) + "->" + dtype_name(run.dtypes.c) +
         (run.transpose_b ? " x.W^T" : " dy.W") + " beta " + std::to_string(run.beta) +
         (run.host_offsets ? " (host offsets)" : " (device offsets only)");
}

// The grouped GEMM that `grouped_args` describes, run on both backends; `expect_fast`: the wgmma
// kernel must be the one the GPU takes (checked on a Hopper GPU). Compares c.
void check_on_both(const std::function<GroupedGemmArgs(BackendSide)>& grouped_args, const Operand& c, DType c_dtype,
                   bool expect_fast, const std::string& what) {
  const GroupedGemmArgs on_gpu = grouped_args(kGpu);
  const bool fast = kernels::cuda_ops::grouped_gemm_path(on_gpu) == GroupedGemmPath::kSm90;
  INFO(what << (fast ? ": wgmma kernel" : ": fallback kernel"));
  if (device_is_sm90()) CHECK(fast == expect_fast);
  gpu().grouped_gemm(on_gpu);
  cpu().grouped_gemm(grouped_args(kCpu));
  CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(c_dtype), what);
}

// One M-grouped run on both backends with the wgmma kernel's tiling forced; `expect_fast`: the
// wgmma kernel must be the one taken. k2 > 0 adds the second product a2 [rows, k2] . op(b2)
// (GroupedGemmArgs::a2, b2).
void check_m_grouped_tiled(const std::string& name, const std::vector<int32_t>& sizes, int64_t k, int64_t n,
                           const Run& run, bool expect_fast, uint64_t seed, int64_t k2, GroupedGemmTiling tiling) {
  const ForcedTiling forced(tiling);
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back();
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  const Operand a = gemm_input({rows, k}, run.dtypes.a, seed + 1);
  const Operand b = gemm_input(run.transpose_b ? Shape{groups, n, k} : Shape{groups, k, n}, run.dtypes.b, seed + 2);
  Operand c = run.beta == 0.0 ? output_operand({rows, n}, run.dtypes.c) : random_operand({rows, n}, run.dtypes.c, seed + 3);
  Operand a2, b2;
  if (k2 > 0) {
    a2 = gemm_input({rows, k2}, run.dtypes.a, seed + 4);
    b2 = gemm_input(run.transpose_b ? Shape{groups, n, k2} : Shape{groups, k2, n}, run.dtypes.b, seed + 5);
  }
  const auto grouped_args = [&](BackendSide on) {
    GroupedGemmArgs args;
    args.kind = GroupedGemmKind::kMGrouped;
    args.transpose_b = run.transpose_b;
    args.alpha = 0.75;
    args.beta = run.beta;
    args.a = on(a);
    args.b = on(b);
    args.c = on(c);
    if (k2 > 0) {
      args.a2 = on(a2);
      args.b2 = on(b2);
    }
    args.group_offsets = on(group_offsets);
    // The GPU gets the offsets' host copy only in the runs that pass it; the CPU always reads it.
    args.host_group_offsets = run.host_offsets || !on.device ? offsets.data() : nullptr;
    return args;
  };
  const std::string what =
      label(name + " k" + std::to_string(k) + " n" + std::to_string(n) + (k2 > 0 ? " k2 " + std::to_string(k2) : ""),
            run) +
      (tiling == GroupedGemmTiling::kRowsAsN ? " rows as N" : " rows as M");
  check_on_both(grouped_args, c, run.dtypes.c, expect_fast, what);
}

// The M-grouped run with each tiling it has (the fallback's shapes: rows as M only).
void check_m_grouped(const std::string& name, const std::vector<int32_t>& sizes, int64_t k, int64_t n, const Run& run,
                     bool expect_fast, uint64_t seed, int64_t k2 = 0) {
  check_m_grouped_tiled(name, sizes, k, n, run, expect_fast, seed, k2, GroupedGemmTiling::kRowsAsM);
  if (expect_fast)
    check_m_grouped_tiled(name, sizes, k, n, run, expect_fast, seed, k2, GroupedGemmTiling::kRowsAsN);
}

void check_k_grouped(const std::string& name, const std::vector<int32_t>& sizes, int64_t n_out, int64_t n_in,
                     const Run& run, bool expect_fast, uint64_t seed) {
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back();
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  const Operand a = gemm_input({rows, n_out}, run.dtypes.a, seed + 1);
  const Operand b = gemm_input({rows, n_in}, run.dtypes.b, seed + 2);
  Operand c = run.beta == 0.0 ? output_operand({groups, n_out, n_in}, run.dtypes.c)
                              : random_operand({groups, n_out, n_in}, run.dtypes.c, seed + 3);
  const auto grouped_args = [&](BackendSide on) {
    GroupedGemmArgs args;
    args.kind = GroupedGemmKind::kKGrouped;
    args.alpha = 1.25;
    args.beta = run.beta;
    args.a = on(a);
    args.b = on(b);
    args.c = on(c);
    args.group_offsets = on(group_offsets);
    args.host_group_offsets = run.host_offsets || !on.device ? offsets.data() : nullptr;
    return args;
  };
  const std::string what =
      label(name + " n_out" + std::to_string(n_out) + " n_in" + std::to_string(n_in), Run{run.dtypes, true, run.beta,
                                                                                         run.host_offsets});
  check_on_both(grouped_args, c, run.dtypes.c, expect_fast, what);
}

// Every dtype mix, both layouts of b, beta 0 and 1, with and without the host copy (12 runs).
std::vector<Run> all_runs() {
  std::vector<Run> runs;
  for (const DtypeCase& dt : {kBf16ToBf16, kBf16ToF32, kF32ToBf16})
    for (bool tb : {true, false})
      for (double beta : {0.0, 1.0}) runs.push_back({dt, tb, beta, tb == (beta == 0.0)});
  runs.push_back({kF32ToF32, true, 0.0, false});
  return runs;
}

TEST_CASE("cuda grouped_gemm M-grouped: uneven and empty groups, rows not multiples of the tile, k and n tails") {
  // 879 rows: groups of 300, 129, 1, 64, 257, 128 rows and four empty ones; k = 136 is two K steps
  // and a partial one, n = 272 a full 256-column tile and a partial one.
  const std::vector<int32_t> sizes = {0, 300, 0, 129, 1, 64, 0, 257, 128, 0};
  uint64_t seed = 10;
  for (const Run& run : all_runs()) check_m_grouped("uneven", sizes, 136, 272, run, true, seed += 10);
}

TEST_CASE("cuda grouped_gemm M-grouped: 256-column tiles, every size of a group's last tile, partial n-tiles") {
  // Last tiles of 1 to 128 rows (one warpgroup idle up to 64), whole 128-row tiles, and n = 600
  // (three n-tiles, the last 88 columns: BF16 stores of 16 bytes per lane stop inside a group of
  // four 8-column chunks) or n = 400, with and without the second product. With the rows as N
  // (tiles of up to 288 rows that split a group evenly, wgmma's N in steps of 16, a second wgmma
  // past 256): 288 rows are one tile of N 256 + 32, 289 two of 144 and 145, 385 two of 192 and
  // 193, 582 three of 194.
  const std::vector<int32_t> sizes = {44, 0, 100, 150, 230, 256, 582, 128, 64, 1, 385, 129, 320, 289, 288};
  uint64_t seed = 200;
  for (const Run& run : all_runs()) check_m_grouped("tails", sizes, 136, 600, run, true, seed += 10);
  for (const Run& run : {Run{kBf16ToBf16, true, 0.0, false}, Run{kBf16ToF32, false, 1.0, true}}) {
    check_m_grouped("tails", sizes, 200, 400, run, true, seed += 10);
    check_m_grouped("tails + LoRA", sizes, 136, 600, run, true, seed += 10, 32);
  }
}

TEST_CASE("cuda grouped_gemm M-grouped: the tiling follows the mean rows per group") {
  // The forward at the MoE expert shapes (65,536 rows over 256 experts) takes rows-as-N tiles,
  // its input gradient rows-as-M; the input gradient at K3's (16,384 rows over 112 experts, EP8)
  // rows-as-N. The issue-4 block (131,072 rows over 64) and thin outputs (fewer columns than one
  // 128-column M) take rows-as-M.
  kernels::cuda_ops::GroupedGemmProblem p;
  p.groups = 256;
  p.rows = 65536;
  p.k = 2304;
  p.n = 2048;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsN);
  p.transpose_b = false;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsM);
  p.groups = 112;
  p.rows = 16384;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsN);
  p.groups = 256;
  p.rows = 65536;
  p.transpose_b = true;
  p.n = 16;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsM);
  p.n = 2048;
  p.groups = 64;
  p.rows = 131072;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsM);
  const ForcedTiling forced(GroupedGemmTiling::kRowsAsN);
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsN);
  p.kind = GroupedGemmKind::kKGrouped;  // forcing applies where the kernel has the tiling
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsM);
  p.kind = GroupedGemmKind::kMGrouped;  // and where the group table fits beside its stages
  p.groups = 1023;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsN);
  p.groups = 1024;
  CHECK(kernels::cuda_ops::grouped_gemm_tiling(p) == GroupedGemmTiling::kRowsAsM);
}

TEST_CASE("cuda grouped_gemm M-grouped: one group holding every row") {
  uint64_t seed = 300;
  for (const Run& run : all_runs()) check_m_grouped("one group", {0, 0, 517, 0}, 64, 64, run, true, seed += 10);
  check_m_grouped("single group", {389}, 96, 200, {kBf16ToBf16, true, 0.0, false}, true, 390);
  // With the rows as N, 21 tiles of 285 or 286 rows (N 256 + 32).
  check_m_grouped("large group", {0, 6001, 0}, 64, 128, {kBf16ToBf16, true, 0.0, false}, true, 395);
}

TEST_CASE("cuda grouped_gemm M-grouped: random skewed counts") {
  const std::vector<int32_t> sizes = skewed_sizes(40, 48, 7);
  uint64_t seed = 500;
  for (const Run& run : {Run{kBf16ToBf16, true, 0.0, false}, Run{kBf16ToBf16, false, 1.0, true},
                         Run{kBf16ToF32, true, 1.0, false}, Run{kF32ToBf16, false, 0.0, false}})
    check_m_grouped("skewed", sizes, 192, 128, run, true, seed += 10);
}

TEST_CASE("cuda grouped_gemm M-grouped: the thin LoRA shapes (n or k of 16 and 32)") {
  const std::vector<int32_t> sizes = {77, 0, 150, 3, 0, 260, 129, 40};
  uint64_t seed = 700;
  for (const Run& run : all_runs()) {
    check_m_grouped("x.A (rank 16)", sizes, 2304, 16, run, true, seed += 10);
    check_m_grouped("(xA).B (rank 16)", sizes, 16, 1024, run, true, seed += 10);
  }
  for (const Run& run : {Run{kBf16ToBf16, true, 0.0, false}, Run{kF32ToBf16, false, 1.0, true}}) {
    check_m_grouped("x.A (rank 32)", sizes, 1024, 32, run, true, seed += 10);
    check_m_grouped("(xA).B (rank 32)", sizes, 32, 2304, run, true, seed += 10);
    check_m_grouped("x.A (rank 8)", sizes, 512, 8, run, true, seed += 10);
    check_m_grouped("n 200", sizes, 88, 200, run, true, seed += 10);
  }
}

TEST_CASE("cuda grouped_gemm M-grouped: a second product (the LoRA term folded into the base GEMM)") {
  // The expert projections' shapes in small: x W^T + (x A^T) (s B)^T with k2 = the packed rank,
  // and dy W + (dy s B) A; k2 below one K step and past one; k2 = 12 (not a multiple of 8) falls back.
  const std::vector<int32_t> sizes = {77, 0, 150, 3, 0, 260, 129, 40};
  uint64_t seed = 800;
  for (const Run& run : all_runs()) {
    check_m_grouped("gate_up + LoRA", sizes, 256, 272, run, true, seed += 10, 32);
    check_m_grouped("down + LoRA", sizes, 136, 96, run, true, seed += 10, 16);
  }
  for (const Run& run : {Run{kBf16ToBf16, true, 1.0, false}, Run{kF32ToF32, false, 0.0, true}}) {
    check_m_grouped("rank 96", sizes, 64, 128, run, true, seed += 10, 96);
    check_m_grouped("rank 12", sizes, 64, 128, run, false, seed += 10, 12);
  }
  check_m_grouped("one group", {0, 0, 517, 0}, 64, 64, {kBf16ToBf16, true, 0.0, false}, true, seed += 10, 32);
}

TEST_CASE("cuda grouped_gemm M-grouped: shapes the wgmma kernel does not take use the fallback") {
  const std::vector<int32_t> sizes = {0, 7, 0, 13, 1, 0, 140};
  uint64_t seed = 900;
  for (const Run& run : {Run{kBf16ToBf16, true, 0.0, false}, Run{kF32ToF32, false, 1.0, true}}) {
    check_m_grouped("odd k and n", sizes, 37, 29, run, false, seed += 10);
    check_m_grouped("n not a multiple of 8", sizes, 64, 20, run, false, seed += 10);
    check_m_grouped("k not a multiple of 8", sizes, 44, 64, run, false, seed += 10);
  }
  // k = 0: the product is empty, c = beta * c (rows of every group).
  check_m_grouped("k 0", sizes, 0, 16, {kBf16ToF32, true, 1.0, true}, false, 990);
  check_m_grouped("k 0", sizes, 0, 16, {kBf16ToBf16, false, 0.0, false}, false, 995);
}

TEST_CASE("cuda grouped_gemm K-grouped: zero-row groups get beta * c, the tails are masked") {
  // Groups of 5, 130, 64, 1 and 257 rows among empty ones: K steps of 64 that end inside a group
  // must not take the next group's rows.
  const std::vector<int32_t> sizes = {5, 0, 130, 0, 64, 1, 257, 0};
  uint64_t seed = 1100;
  for (const DtypeCase& dt : {kBf16ToF32, kBf16ToBf16, kF32ToF32})
    for (double beta : {0.0, 1.0}) {
      const Run run{dt, true, beta, beta == 0.0};
      check_k_grouped("LoRA A grad", sizes, 16, 1024, run, true, seed += 10);
      check_k_grouped("LoRA B grad", sizes, 2304, 16, run, true, seed += 10);
      check_k_grouped("general", sizes, 136, 72, run, true, seed += 10);
    }
  check_k_grouped("rank 32", sizes, 32, 264, {kBf16ToF32, true, 1.0, false}, true, 1300);
  check_k_grouped("wide", skewed_sizes(12, 90, 3), 264, 320, {kBf16ToF32, true, 1.0, false}, true, 1310);
  check_k_grouped("every row in one group", {0, 333, 0}, 48, 40, {kBf16ToBf16, true, 0.0, false}, true, 1320);
}

TEST_CASE("cuda grouped_gemm K-grouped: odd widths and no rows at all use the fallback") {
  const std::vector<int32_t> sizes = {5, 0, 11, 0, 70};
  check_k_grouped("odd", sizes, 19, 27, {kBf16ToF32, true, 1.0, false}, false, 1400);
  check_k_grouped("odd", sizes, 24, 27, {kF32ToF32, true, 0.0, true}, false, 1410);
  check_k_grouped("no rows", {0, 0, 0}, 16, 32, {kBf16ToF32, true, 1.0, false}, false, 1420);
  check_k_grouped("no rows", {0, 0}, 16, 32, {kBf16ToBf16, true, 0.0, true}, false, 1430);
}

TEST_CASE("cuda grouped_gemm with wrong device offsets stays inside the tensors") {
  // Decreasing and past-the-end offsets, no host copy: the sums are unspecified, but the kernels
  // clamp the offsets, so nothing outside a, b or c is touched and the stream stays healthy.
  const Operand group_offsets = int_operand({0, 90, 20, 100000, -5}, {5});
  for (bool k_grouped : {false, true}) {
    const Operand a = gemm_input({100, 64}, DType::kBF16, 1);
    const Operand b = gemm_input(k_grouped ? Shape{100, 64} : Shape{4, 64, 64}, DType::kBF16, 2);
    Operand c = output_operand(k_grouped ? Shape{4, 64, 64} : Shape{100, 64}, DType::kF32);
    GroupedGemmArgs args;
    args.kind = k_grouped ? GroupedGemmKind::kKGrouped : GroupedGemmKind::kMGrouped;
    args.a = a.dev;
    args.b = b.dev;
    args.c = c.dev;
    args.group_offsets = group_offsets.dev;
    gpu().grouped_gemm(args);
    gpu().synchronize();  // a fault would surface here
    CHECK(download(c.dev).numel() == c.dev.numel());
  }
}

}  // namespace
}  // namespace moetrain::cuda_test
