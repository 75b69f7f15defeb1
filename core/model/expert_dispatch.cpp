#include "core/model/expert_dispatch.h"

#include <numeric>

namespace moetrain {
namespace {

// An int32 tensor on the backend's device from host values.
Tensor int32_device(const LayerContext& ctx, const std::vector<int32_t>& values) {
  Tensor host({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), host.ptr<int32_t>());
  Tensor device(host.shape(), DType::kI32, ctx.backend.allocator());
  ctx.backend.copy(device, host);
  return device;
}

AllToAllLayout reversed(const AllToAllLayout& layout) {
  AllToAllLayout r;
  r.send_counts = layout.recv_counts;
  r.send_offsets = layout.recv_offsets;
  r.recv_counts = layout.send_counts;
  r.recv_offsets = layout.send_offsets;
  return r;
}

}  // namespace

Tensor ExpertDispatch::plan(const LayerContext& ctx, const int32_t* expert_offsets_host) {
  const int ranks = ep_.size();
  // counts[p * L + e]: rows this rank sends to EP rank p for its local expert e.
  std::vector<int64_t> send_counts(static_cast<size_t>(num_experts_));
  for (int64_t g = 0; g < num_experts_; ++g) send_counts[g] = expert_offsets_host[g + 1] - expert_offsets_host[g];
  // The exchange goes through the communicator's memory (host for MPI, device for NCCL).
  Tensor send_host({num_experts_}, DType::kI64);
  std::copy(send_counts.begin(), send_counts.end(), send_host.ptr<int64_t>());
  Tensor recv_host({num_experts_}, DType::kI64);
  if (ep_.device() == Device::kCPU) {
    ep_.all_to_all(recv_host.ptr<int64_t>(), send_host.ptr<int64_t>(), local_experts_);
  } else {
    Tensor send_dev(send_host.shape(), DType::kI64, ctx.backend.allocator());
    Tensor recv_dev(recv_host.shape(), DType::kI64, ctx.backend.allocator());
    ctx.backend.copy(send_dev, send_host);
    ep_.all_to_all(recv_dev.ptr<int64_t>(), send_dev.ptr<int64_t>(), local_experts_);
    ep_.synchronize();
    ctx.backend.copy(recv_host, recv_dev);
  }
  const int64_t* recv = recv_host.ptr<int64_t>();  // recv[src * L + e]

  send_rows_.assign(ranks, 0);
  recv_rows_.assign(ranks, 0);
  for (int p = 0; p < ranks; ++p) {
    for (int64_t e = 0; e < local_experts_; ++e) {
      send_rows_[p] += send_counts[p * local_experts_ + e];
      recv_rows_[p] += recv[p * local_experts_ + e];
    }
  }
  local_rows_ = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});

  // Received rows arrive source-major, each source's block sorted by expert. Expert-major order
  // (what the grouped GEMM needs) visits, for each local expert, each source's block of it.
  std::vector<int64_t> source_start(ranks, 0);
  for (int p = 1; p < ranks; ++p) source_start[p] = source_start[p - 1] + recv_rows_[p - 1];
  std::vector<int32_t> regroup, ungroup(static_cast<size_t>(local_rows_));
  std::vector<int32_t>& local_offsets = local_offsets_;
  local_offsets.assign(1, 0);
  std::vector<int64_t> within_source(ranks, 0);
  for (int64_t e = 0; e < local_experts_; ++e) {
    for (int p = 0; p < ranks; ++p) {
      const int64_t count = recv[p * local_experts_ + e];
      for (int64_t i = 0; i < count; ++i) {
        const int64_t received_row = source_start[p] + within_source[p] + i;
        ungroup[received_row] = static_cast<int32_t>(regroup.size());
        regroup.push_back(static_cast<int32_t>(received_row));
      }
      within_source[p] += count;
    }
    local_offsets.push_back(static_cast<int32_t>(regroup.size()));
  }
  regroup_ = int32_device(ctx, regroup);
  ungroup_ = int32_device(ctx, ungroup);
  return int32_device(ctx, local_offsets);
}

void ExpertDispatch::to_experts(const LayerContext& ctx, const TensorView& local, const TensorView& routed) const {
  const int64_t hidden = routed.size(1);
  Tensor received = ctx.alloc({local_rows_, hidden}, routed.dtype);
  ctx.backend.synchronize();  // the rows are final before another stream sends them
  ep_.all_to_all_v(received.view(), routed, AllToAllLayout::packed(send_rows_, recv_rows_, hidden));
  ep_.synchronize();
  ctx.backend.moe_permute(local, received, regroup_, 1);
}

void ExpertDispatch::from_experts(const LayerContext& ctx, const TensorView& routed, const TensorView& local) const {
  const int64_t hidden = local.size(1);
  Tensor source_major = ctx.alloc({local_rows_, hidden}, local.dtype);
  ctx.backend.moe_permute(source_major, local, ungroup_, 1);
  ctx.backend.synchronize();
  ep_.all_to_all_v(routed, source_major.view(),
                   reversed(AllToAllLayout::packed(send_rows_, recv_rows_, hidden)));
  ep_.synchronize();
}

}  // namespace moetrain
