// `ep`: expert-parallel dispatch + combine across the job's GPUs against NCCL's all-to-all.
#include <mpi.h>

#include <cstdio>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "core/model/expert_dispatch.h"
#include "parallel/comm.h"
#include "parallel/nccl_comm.h"

namespace moetrain::bench {

// Expert-parallel token exchange across the job's GPUs (run under mpirun, one rank per GPU):
// ExpertDispatch's dispatch (to_experts) + combine (from_experts) of `mib` MiB of bf16 rows per
// rank and direction, routed evenly over every rank's experts, against NCCL's own all-to-all of
// the same bytes timed in the same run. Bandwidth as nccl-tests' bus bandwidth: bytes per rank
// x (ranks - 1) / ranks / time, per direction.
int bench_ep(Runtime& runtime, int mib, int reps) {
  MOETRAIN_CHECK(runtime.world() >= 2, ExitCode::kBadConfig,
                 "moetrain-bench ep needs 2 or more ranks, one per GPU: mpirun -np 2 moetrain-bench ep");
  auto backend = kernels::make_cuda_backend();
  NcclCommunicator ep(MPI_COMM_WORLD);
  const int ranks = ep.size();
  constexpr int64_t kHidden = 7168;  // Kimi K3 / DeepSeek-V3's hidden size: 14 KiB bf16 rows
  constexpr int64_t kExpertsPerRank = 8;
  const int64_t rows = (int64_t{mib} << 20) / (kHidden * 2) / (ranks * kExpertsPerRank) * (ranks * kExpertsPerRank);
  const int64_t experts = kExpertsPerRank * ranks;
  // Every expert gets the same share of this rank's rows (sorted by expert, as MoeFfn sends them).
  std::vector<int32_t> offsets(static_cast<size_t>(experts + 1));
  for (int64_t e = 0; e <= experts; ++e) offsets[e] = static_cast<int32_t>(rows / experts * e);

  BatchTensors no_batch;
  LayerContext ctx{*backend, DType::kBF16, no_batch};
  ExpertDispatch dispatch(ep, experts, kExpertsPerRank);
  Tensor local_offsets = dispatch.plan(ctx, offsets.data());
  Tensor routed({rows, kHidden}, DType::kBF16, backend->allocator());
  Tensor back({rows, kHidden}, DType::kBF16, backend->allocator());
  Tensor local({dispatch.local_rows(), kHidden}, DType::kBF16, backend->allocator());
  backend->fill(routed, 0.5);
  Tensor received({rows, kHidden}, DType::kBF16, backend->allocator());

  const double bytes = static_cast<double>(rows * kHidden * 2);
  const double bus_bytes = bytes * (ranks - 1) / ranks;
  const double nccl_ms = median_ms(*backend, [&] {
    ep.all_to_all(static_cast<Bf16Bits*>(received.data()), static_cast<const Bf16Bits*>(routed.data()),
                  rows * kHidden / ranks);
    ep.synchronize();
  }, reps);
  const double dispatch_ms = median_ms(*backend, [&] { dispatch.to_experts(ctx, local, routed); }, reps);
  const double combine_ms = median_ms(*backend, [&] { dispatch.from_experts(ctx, back, local); }, reps);
  const double nccl_busbw = bus_bytes / (nccl_ms * 1e-3) / 1e9;
  const double ours_busbw = 2 * bus_bytes / ((dispatch_ms + combine_ms) * 1e-3) / 1e9;
  if (runtime.is_root()) {
    std::printf("\nep: %d ranks, %.0f MiB per rank and direction (%lld rows x %lld bf16), %lld experts per rank\n",
                ranks, bytes / (1 << 20), static_cast<long long>(rows), static_cast<long long>(kHidden),
                static_cast<long long>(kExpertsPerRank));
    std::printf("ep: NCCL all-to-all %.3f ms, %.1f GB/s bus bandwidth (GPU.md: 243 GB/s at 256 MiB on 2 x H200)\n",
                nccl_ms, nccl_busbw);
    std::printf("ep: dispatch %.3f ms + combine %.3f ms, %.1f GB/s bus bandwidth per direction: %.2fx NCCL's "
                "(target >= 0.80)\n",
                dispatch_ms, combine_ms, ours_busbw, ours_busbw / nccl_busbw);
  }
  (void)local_offsets;
  return 0;
}

}  // namespace moetrain::bench
