// AttentionAcrossRanks (see attention_context_parallel.h).
#include "core/model/attention_context_parallel.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/base/error.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::AttentionBackwardArgs;

namespace {

// The bytes of one token's row of a [tokens, ...] tensor.
size_t row_bytes(const TensorView& t) { return t.size(0) == 0 ? 0 : t.nbytes() / static_cast<size_t>(t.size(0)); }

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
  MOETRAIN_CHECK(backend.device() == Device::kCPU, ExitCode::kBadConfig,
                 "context parallelism over attention layers runs on the CPU backend only: the CUDA attention "
                 "takes no key segments yet");
}

Tensor gather_visible_rows(Communicator& cp, const ContextShards& shards, const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard(), from = shards.document_start(me), to = shards.end(me);
  Tensor visible(with_rows(own, to - from), own.dtype);
  Tensor padded(with_rows(own, longest), own.dtype);
  std::memset(padded.view().data, 0, padded.view().nbytes());
  std::memcpy(padded.view().data, own.data, own.nbytes());
  Tensor every(with_rows(own, longest * cp.size()), own.dtype);
  cp.all_gather(every.view(), padded.view());
  const size_t row = row_bytes(own);
  for_each_part(shards, from, to, [&](int j, int64_t first, int64_t count) {
    std::memcpy(static_cast<char*>(visible.view().data) + (first - from) * row,
                static_cast<const char*>(every.view().data) + (j * longest + first - shards.begin(j)) * row,
                count * row);
  });
  return visible;
}

void return_visible_gradient(Communicator& cp, const ContextShards& shards, const TensorView& visible,
                             const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard(), from = shards.document_start(me);
  const size_t row = row_bytes(visible);
  Tensor every(with_rows(own, longest * cp.size()), own.dtype);
  std::memset(every.view().data, 0, every.view().nbytes());
  for_each_part(shards, from, shards.end(me), [&](int j, int64_t first, int64_t count) {
    std::memcpy(static_cast<char*>(every.view().data) + (j * longest + first - shards.begin(j)) * row,
                static_cast<const char*>(visible.data) + (first - from) * row, count * row);
  });
  Tensor mine(with_rows(own, longest), own.dtype);
  cp.reduce_scatter(mine.view(), every.view());
  std::memcpy(own.data, mine.view().data, own.nbytes());
}

Tensor visible_key_segments(const ContextShards& shards, int rank) {
  const std::vector<int32_t> cu = shards.key_cu(rank);
  Tensor t({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), t.ptr<int32_t>());
  return t;
}

void AttentionAcrossRanks::forward(const AttentionArgs& args) {
  const Tensor k = gather_visible_rows(cp_, shards_, args.k), v = gather_visible_rows(cp_, shards_, args.v);
  const Tensor cu = visible_key_segments(shards_, cp_.rank());
  AttentionArgs run = args;
  run.k = k;
  run.v = v;
  run.cu_seqlens_k = cu;
  backend_.attention_forward(run);
}

void AttentionAcrossRanks::backward(const AttentionBackwardArgs& args) {
  const Tensor k = gather_visible_rows(cp_, shards_, args.k), v = gather_visible_rows(cp_, shards_, args.v);
  const Tensor cu = visible_key_segments(shards_, cp_.rank());
  Tensor dk(k.shape(), args.dk.dtype), dv(v.shape(), args.dv.dtype);
  AttentionBackwardArgs run = args;
  run.k = k;
  run.v = v;
  run.dk = dk;
  run.dv = dv;
  run.cu_seqlens_k = cu;
  backend_.attention_backward(run);
  return_visible_gradient(cp_, shards_, dk.view(), args.dk);
  return_visible_gradient(cp_, shards_, dv.view(), args.dv);
}

}  // namespace moetrain
