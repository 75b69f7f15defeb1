// The grouped GEMM of the MoE expert path (kernels/ops.h GroupedGemmArgs) in one launch, with
// the group offsets read on the GPU: no host copy of them and no wait for the stream.
//
//   kMGrouped: c[rows_g, :] = alpha * (a[rows_g, :] . op(b[g]) [+ a2[rows_g, :] . op(b2[g])]) + beta * c[rows_g, :]
//   kKGrouped: c[g] = alpha * a[rows_g, :]^T . b[rows_g, :] + beta * c[g]
//
// Two kernels (grouped_gemm_sm90.cu, grouped_gemm.cu):
//   - sm_90a: a persistent, warp-specialised wgmma kernel. Every CTA derives the same table from
//     the device offsets at its start (per group: rows, and a prefix of its output tiles) and
//     walks the tiles of all groups, so uneven and empty groups cost nothing. One producer warp
//     loads A and B tiles by TMA into a ring of swizzled shared-memory stages; two consumer
//     warpgroups multiply them (wgmma, BF16 in, F32 accumulate) and store their 64 rows each.
//     Taken when the device is compute capability 9.0, a, b and c are 16-byte aligned and the
//     dimensions TMA needs are multiples of 8 (m-grouped: k, k2 and n; k-grouped: both widths).
//   - a plain one-thread-per-output kernel for everything else (any shape, any alignment).
// Offsets are clamped on the device into a non-decreasing sequence inside [0, rows], so wrong
// offsets give wrong sums, never accesses outside a, b or c; the backend checks the caller's host
// copy when it has one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/base/tensor.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// One grouped GEMM on BF16 operands (the caller rounds F32 ones first).
struct GroupedGemmProblem {
  GroupedGemmKind kind = GroupedGemmKind::kMGrouped;
  void* c = nullptr;
  DType c_dtype = DType::kF32;               // kBF16 or kF32
  const void* a = nullptr;                   // BF16 [rows, k] (m-grouped) or [rows, n_out] (k-grouped)
  const void* b = nullptr;                   // BF16 [groups, n, k] / [groups, k, n], or [rows, n_in]
  const int32_t* group_offsets = nullptr;    // on the device, [groups + 1]
  int64_t groups = 0;
  int64_t rows = 0;
  int64_t n = 0, k = 0;                      // m-grouped: c [rows, n]
  int64_t n_out = 0, n_in = 0;               // k-grouped: c [groups, n_out, n_in]
  bool transpose_b = true;                   // m-grouped: b is [groups, n, k]
  // m-grouped, optional (k2 > 0): a second product a2 [rows, k2] . op(b2) (b2 [groups, n, k2] or
  // [groups, k2, n], BF16) summed into the same output: its K steps follow those of a . op(b).
  const void* a2 = nullptr;
  const void* b2 = nullptr;
  int64_t k2 = 0;
  float alpha = 1.0f;
  float beta = 0.0f;                         // c is not read when 0
};

enum class GroupedGemmPath { kSm90, kFallback };

// How the sm_90a kernel tiles an m-grouped problem:
//   kRowsAsM: a group's rows are wgmma's M, in tiles of 128 rows x up to 256 columns of c; a
//     group's last tile costs 64 or 128 rows however few it holds.
//   kRowsAsN (with at most 1023 groups): c^T = op(b)^T . a^T, 128 columns of c as wgmma's M and up
//     to 288 of a group's rows as N, rounded up to 16 (a larger group splits into even tiles): a
//     group of 207 rows costs 208 rows, not 256, and one of 280 rows is one tile. For the input
//     gradient (dy W) the A tile is W's transpose, M-major (chosen for smaller groups than the
//     forward's: grouped_gemm_tiling.cpp, kRowsAsNInputGradMaxMeanRows).
// kAuto (the default) chooses by shape: grouped_gemm_tiling.
enum class GroupedGemmTiling { kAuto, kRowsAsM, kRowsAsN };

// The tiling a problem on the sm_90a path takes (never kAuto; kRowsAsM unless m-grouped with at
// most 1023 groups).
GroupedGemmTiling grouped_gemm_tiling(const GroupedGemmProblem& problem);

// Forces a tiling for every later launch in the process where it applies (tests and the
// benchmark run both); kAuto restores the choice by shape.
void set_grouped_gemm_tiling(GroupedGemmTiling tiling);

// The kernel launch_grouped_gemm would run (tests and the benchmark report it).
GroupedGemmPath grouped_gemm_path(const GroupedGemmProblem& problem);

void launch_grouped_gemm(const GroupedGemmProblem& problem, cudaStream_t stream);

// The sm_90a kernel's launch (grouped_gemm_sm90.cu) in the tiling grouped_gemm_tiling picks;
// launch_grouped_gemm calls it when grouped_gemm_path says kSm90.
void launch_grouped_gemm_sm90(const GroupedGemmProblem& problem, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
