// AttentionAcrossRanks (see attention_context_parallel.h).
#include "core/model/attention_context_parallel.h"

#include <algorithm>
#include <vector>

#include "core/base/error.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;

namespace {

Shape with_rows(const TensorView& t, int64_t rows) {
  Shape shape = t.shape;
  shape[0] = rows;
  return shape;
}

// For every shard j, the part of window tokens [from, to) it holds: body(j, first, count) with
// `first` the window position of its first token there.
template <typename Body>
void for_each_part(const ContextShards& shards, int64_t from, int64_t to, Body&& body) {
  for (int j = 0; j < shards.ranks(); ++j) {
    const int64_t first = std::max(from, shards.begin(j)), last = std::min(to, shards.end(j));
    if (first < last) body(j, first, last - first);
  }
}

}  // namespace

AttentionAcrossRanks::AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards)
    : backend_(backend), cp_(cp), shards_(shards) {
  MOETRAIN_CHECK(shards.ranks() == cp.size(), ExitCode::kInternal, "attention across ranks: a shard per rank");
}

Tensor gather_visible_rows(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                           const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard(), from = shards.document_start(me), to = shards.end(me);
  Tensor visible(with_rows(own, to - from), own.dtype, backend.allocator());
  Tensor padded(with_rows(own, longest), own.dtype, backend.allocator());
  backend.fill(padded, 0.0);
  if (own.size(0) > 0) backend.copy(padded.view().slice_rows(0, own.size(0)), own);
  Tensor every(with_rows(own, longest * cp.size()), own.dtype, backend.allocator());
  // Ordered against the backend's stream both ways, as a device communicator queues on its own
  // (NCCL): after the copies into `padded`, before the copies out of `every`.
  cp.wait_for(backend.stream());
  cp.all_gather(every.view(), padded.view());
  cp.release_to(backend.stream());
  for_each_part(shards, from, to, [&](int j, int64_t first, int64_t count) {
    const int64_t at = j * longest + first - shards.begin(j);
    backend.copy(visible.view().slice_rows(first - from, first - from + count),
                 every.view().slice_rows(at, at + count));
  });
  return visible;
}

void return_visible_gradient(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                             const TensorView& visible, const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard(), from = shards.document_start(me);
  Tensor every(with_rows(own, longest * cp.size()), own.dtype, backend.allocator());
  backend.fill(every, 0.0);
  for_each_part(shards, from, shards.end(me), [&](int j, int64_t first, int64_t count) {
    const int64_t at = j * longest + first - shards.begin(j);
    backend.copy(every.view().slice_rows(at, at + count), visible.slice_rows(first - from, first - from + count));
  });
  Tensor mine(with_rows(own, longest), own.dtype, backend.allocator());
  cp.wait_for(backend.stream());
  cp.reduce_scatter(mine.view(), every.view());
  cp.release_to(backend.stream());
  if (own.size(0) > 0) backend.copy(own, mine.view().slice_rows(0, own.size(0)));
}

Tensor visible_key_segments(kernels::Backend& backend, const ContextShards& shards, int rank) {
  const std::vector<int32_t> cu = shards.key_cu(rank);
  Tensor host({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), host.ptr<int32_t>());
  if (backend.device() == Device::kCPU) return host;
  Tensor t(host.shape(), DType::kI32, backend.allocator());
  backend.copy(t, host);
  return t;
}

void AttentionAcrossRanks::forward(const AttentionArgs& args) {
  const Tensor k = gather_visible_rows(backend_, cp_, shards_, args.k);
  const Tensor v = gather_visible_rows(backend_, cp_, shards_, args.v);
  const Tensor cu = visible_key_segments(backend_, shards_, cp_.rank());
  AttentionArgs run = args;
  run.k = k;
  run.v = v;
  run.cu_seqlens_k = cu;
  backend_.attention_forward(run);
}

void AttentionAcrossRanks::backward(const AttentionBackwardArgs& args) {
  const Tensor k = gather_visible_rows(backend_, cp_, shards_, args.k);
  const Tensor v = gather_visible_rows(backend_, cp_, shards_, args.v);
  const Tensor cu = visible_key_segments(backend_, shards_, cp_.rank());
  Tensor dk(k.shape(), args.dk.dtype, backend_.allocator()), dv(v.shape(), args.dv.dtype, backend_.allocator());
  AttentionBackwardArgs run = args;
  run.k = k;
  run.v = v;
  run.dk = dk;
  run.dv = dv;
  run.cu_seqlens_k = cu;
  backend_.attention_backward(run);
  return_visible_gradient(backend_, cp_, shards_, dk.view(), args.dk);
  return_visible_gradient(backend_, cp_, shards_, dv.view(), args.dv);
}

}  // namespace moetrain
