// Host-side tile choice of the grouped GEMMs: the tile sizes the launchers of grouped_gemm_sm90.cu
// and grouped_gemm_mxfp4.cu pick, and the shared-memory limits the choice needs. No device code;
// grouped_gemm_tiling.cpp holds the choice by shape (grouped_gemm_tiling in grouped_gemm.h).
#pragma once

#include <cstdint>

#include "kernels/cuda/gemm/grouped_gemm.h"

namespace moetrain::kernels::cuda_ops::grouped_sm90 {

// The per-group table (two int32 [groups + 1]) shares shared memory with the stages.
constexpr int64_t kTableBudgetBytes = 24 * 1024;

// The table of `groups` (two int32 [groups + 1]) fits `budget` bytes of shared memory.
inline bool group_table_fits(int64_t groups, int64_t budget = kTableBudgetBytes) {
  return groups * 2 * 4 + 8 <= budget;
}

// The BF16 kernel's tile M: two consumer warpgroups x 64 rows.
constexpr int kTileM = 128;

// Rows-as-N tiles (GroupedGemmTiling::kRowsAsN): the most rows of a tile (two wgmmas past 256:
// N = 256 and the rest). 288 is the fastest of the sizes measured (docs/PERF.md): past it the
// shared memory holds only 3 stages.
constexpr int kRowsAsNTileRows = 288;
// Rows-as-N tiles take 4 stages of up to 288 rows beside the epilogue buffers when the group table
// is at most this size (1023 groups); grouped_gemm_tiling keeps larger tables on rows as M.
constexpr int kRowsAsNTableBytes = 8 * 1024;

// The tile N (16, 32, 64, 128 or 256) of a rows-as-M or k-grouped tile over n output columns.
int tile_n(int64_t n);

}  // namespace moetrain::kernels::cuda_ops::grouped_sm90
