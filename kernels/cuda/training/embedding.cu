#include "kernels/cuda/training/embedding.h"

#include <algorithm>
#include <numeric>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

template <int kChunk>
__global__ void embedding_forward_kernel(MutOperand out, ConstOperand table, const int32_t* __restrict__ ids,
                                         int64_t tokens, int64_t dim) {
  const int64_t chunks_per_row = dim / kChunk;
  const int64_t total = tokens * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks_per_row, d = (i % chunks_per_row) * kChunk;
    float v[kChunk];
    load_chunk<kChunk>(v, table, static_cast<int64_t>(ids[t]) * dim + d);
    store_chunk<kChunk>(out, t * dim + d, v);
  }
}

// csr: [distinct] ids, [distinct + 1] offsets into positions, [tokens] positions.
template <int kChunk>
__global__ void embedding_backward_kernel(MutOperand dtable, ConstOperand dout, const int32_t* __restrict__ unique_ids,
                                          const int32_t* __restrict__ offsets, const int32_t* __restrict__ positions,
                                          int64_t distinct, int64_t dim) {
  const int64_t chunks_per_row = dim / kChunk;
  const int64_t total = distinct * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = i / chunks_per_row, d = (i % chunks_per_row) * kChunk;
    const int64_t row = static_cast<int64_t>(unique_ids[u]) * dim + d;
    float acc[kChunk];
    load_chunk<kChunk>(acc, dtable, row);
    for (int32_t p = offsets[u]; p < offsets[u + 1]; ++p) {
      float g[kChunk];
      load_chunk<kChunk>(g, dout, static_cast<int64_t>(positions[p]) * dim + d);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) acc[e] += g[e];
    }
    store_chunk<kChunk>(dtable, row, acc);
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids, cudaStream_t stream) {
  const int64_t tokens = ids.numel(), dim = table.size(1);
  if (tokens == 0 || dim == 0) return;
  const MutOperand o{out.data, kind_of(out.dtype)};
  const ConstOperand tab{table.data, kind_of(table.dtype)};
  const auto* id = static_cast<const int32_t*>(ids.data);
  if (dim % 8 == 0 && aligned16(out.data) && aligned16(table.data)) {
    embedding_forward_kernel<8><<<grid_for(tokens * dim / 8, kThreads), kThreads, 0, stream>>>(o, tab, id, tokens, dim);
  } else {
    embedding_forward_kernel<1><<<grid_for(tokens * dim, kThreads), kThreads, 0, stream>>>(o, tab, id, tokens, dim);
  }
  CUDA_CHECK_LAUNCH();
}

void embedding_backward(const TensorView& dtable, const TensorView& dout, const std::vector<int32_t>& host_ids,
                        DeviceScratch& scratch, cudaStream_t stream) {
  const int64_t tokens = static_cast<int64_t>(host_ids.size()), dim = dtable.size(1);
  if (tokens == 0 || dim == 0) return;
  // Token positions stably sorted by id: equal ids keep token order.
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  std::iota(positions.begin(), positions.end(), 0);
  std::stable_sort(positions.begin(), positions.end(),
                   [&](int32_t x, int32_t y) { return host_ids[static_cast<size_t>(x)] < host_ids[static_cast<size_t>(y)]; });
  std::vector<int32_t> table;  // [distinct ids | offsets (distinct + 1) | positions]
  std::vector<int32_t> offsets{0};
  for (int64_t p = 0; p < tokens; ++p) {
    const int32_t id = host_ids[static_cast<size_t>(positions[static_cast<size_t>(p)])];
    if (p == 0 || id != table.back()) {
      if (p > 0) offsets.push_back(static_cast<int32_t>(p));
      table.push_back(id);
    }
  }
  offsets.push_back(static_cast<int32_t>(tokens));
  const int64_t distinct = static_cast<int64_t>(table.size());
  table.insert(table.end(), offsets.begin(), offsets.end());
  table.insert(table.end(), positions.begin(), positions.end());

  auto* device_table = static_cast<int32_t*>(scratch.reserve(table.size() * sizeof(int32_t)));
  // From pageable memory: the call returns once the host buffer has been staged, so `table`
  // may go out of scope afterwards; stream order puts the copy before the kernel.
  CUDA_CHECK(cudaMemcpyAsync(device_table, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  const int32_t* unique_ids = device_table;
  const int32_t* device_offsets = device_table + distinct;
  const int32_t* device_positions = device_offsets + distinct + 1;

  const MutOperand dt{dtable.data, kind_of(dtable.dtype)};
  const ConstOperand dy{dout.data, kind_of(dout.dtype)};
  if (dim % 8 == 0 && aligned16(dtable.data) && aligned16(dout.data)) {
    embedding_backward_kernel<8><<<grid_for(distinct * dim / 8, kThreads), kThreads, 0, stream>>>(
        dt, dy, unique_ids, device_offsets, device_positions, distinct, dim);
  } else {
    embedding_backward_kernel<1><<<grid_for(distinct * dim, kThreads), kThreads, 0, stream>>>(
        dt, dy, unique_ids, device_offsets, device_positions, distinct, dim);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
