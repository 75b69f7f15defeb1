#include "kernels/cuda/gemm/grouped_gemm_tiling.h"

#include <atomic>

namespace moetrain::kernels::cuda_ops {
namespace {

// kAuto takes rows-as-N tiles when the groups hold at most this many rows on average (and c has
// at least 128 columns: one tile's M). The thresholds are where rows as N stops winning in the
// measurements of docs/PERF.md: the forward wins at the MoE expert shapes' means; the input
// gradient wins clearly at K3's small groups but not at the Kimi-dims mean of 256 rows, which
// the input gradient's lower threshold keeps on rows as M.
constexpr int64_t kRowsAsNMaxMeanRows = 512;
constexpr int64_t kRowsAsNInputGradMaxMeanRows = 192;

}  // namespace

namespace grouped_sm90 {

int tile_n(int64_t n) {
  if (n <= 16) return 16;
  if (n <= 32) return 32;
  if (n <= 64) return 64;
  if (n <= 128) return 128;
  return 256;
}

}  // namespace grouped_sm90

namespace {
std::atomic<GroupedGemmTiling> tiling_override{GroupedGemmTiling::kAuto};
}  // namespace

void set_grouped_gemm_tiling(GroupedGemmTiling tiling) { tiling_override = tiling; }

GroupedGemmTiling grouped_gemm_tiling(const GroupedGemmProblem& p) {
  // Rows as N needs the group table to fit beside its stages (kRowsAsNTableBytes).
  const bool table_fits = grouped_sm90::group_table_fits(p.groups, grouped_sm90::kRowsAsNTableBytes);
  if (p.kind != GroupedGemmKind::kMGrouped || !table_fits) return GroupedGemmTiling::kRowsAsM;
  const GroupedGemmTiling forced = tiling_override;
  if (forced != GroupedGemmTiling::kAuto) return forced;
  // The counts are on the device; the mean rows per group is what the host knows.
  const int64_t max_mean_rows = p.transpose_b ? kRowsAsNMaxMeanRows : kRowsAsNInputGradMaxMeanRows;
  const bool small_groups = p.rows <= max_mean_rows * p.groups;
  return p.n >= grouped_sm90::kTileM && small_groups ? GroupedGemmTiling::kRowsAsN : GroupedGemmTiling::kRowsAsM;
}

}  // namespace moetrain::kernels::cuda_ops
