// KeyChunks and AttentionAcrossRanks (see attention_context_parallel.h).
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

Tensor upload_offsets(kernels::Backend& backend, const std::vector<int32_t>& cu) {
  Tensor host({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), host.ptr<int32_t>());
  if (backend.device() == Device::kCPU) return host;
  Tensor t(host.shape(), DType::kI32, backend.allocator());
  backend.copy(t, host);
  return t;
}

AttentionAcrossRanks::AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                                           int64_t key_chunk)
    : backend_(backend), cp_(cp), shards_(shards), key_chunk_(key_chunk) {
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
  return upload_offsets(backend, shards.key_cu(rank));
}

KeyChunks::KeyChunks(kernels::Backend& backend, const ContextShards& shards, int rank, int64_t chunk_rows)
    : backend_(backend),
      key_cu_(shards.key_cu(rank)),
      visible_rows_(shards.end(rank) - shards.document_start(rank)),
      own_rows_(shards.tokens(rank)),
      chunk_rows_(chunk_rows > 0 ? chunk_rows : std::max<int64_t>(shards.longest_shard(), 1)) {}

template <typename Body>
void KeyChunks::for_each_chunk(Body&& body) const {
  for (int64_t from = 0; from < visible_rows_; from += chunk_rows_) body(from, std::min(from + chunk_rows_, visible_rows_));
}

Tensor KeyChunks::segments(int64_t from, int64_t to) const {
  std::vector<int32_t> cu = key_cu_;
  for (int32_t& c : cu) c = static_cast<int32_t>(std::clamp<int64_t>(c, from, to) - from);
  return upload_offsets(backend_, cu);
}

void KeyChunks::forward(const AttentionArgs& args, const Keys& keys) const {
  for_each_chunk([&](int64_t from, int64_t to) {
    const Chunk chunk = keys(from, to);
    const Tensor cu = segments(from, to);
    AttentionArgs run = args;
    run.k = chunk.k;
    run.v = chunk.v;
    run.cu_seqlens_k = cu;
    run.key_shift = shift(from);
    // The first chunk writes out and lse; each later one is folded in.
    if (from == 0) {
      backend_.attention_forward(run);
      return;
    }
    Tensor out(args.out.shape, args.out.dtype, backend_.allocator());
    Tensor lse(args.lse.shape, args.lse.dtype, backend_.allocator());
    run.out = out;
    run.lse = lse;
    backend_.attention_forward(run);
    backend_.attention_merge(kernels::AttentionMergeArgs{args.out, args.lse, out, lse});
  });
}

void KeyChunks::backward(const AttentionBackwardArgs& args, const Keys& keys, const KeyGradients& key_gradients) const {
  for_each_chunk([&](int64_t from, int64_t to) {
    const Chunk chunk = keys(from, to);
    const Tensor cu = segments(from, to);
    Tensor dk(chunk.k.shape(), args.dq.dtype, backend_.allocator());
    Tensor dv(chunk.v.shape(), args.dq.dtype, backend_.allocator());
    Tensor dq = from == 0 ? Tensor() : Tensor(args.dq.shape, args.dq.dtype, backend_.allocator());
    AttentionBackwardArgs run = args;
    if (from > 0) run.dq = dq;
    run.k = chunk.k;
    run.v = chunk.v;
    run.dk = dk;
    run.dv = dv;
    run.cu_seqlens_k = cu;
    run.key_shift = shift(from);
    backend_.attention_backward(run);
    if (from > 0) backend_.axpby(args.dq, dq, 1.0, 1.0);
    key_gradients(from, to, dk, dv);
  });
}

namespace {

// Rows [from, to) of the gathered keys and values, copied.
KeyChunks::Chunk rows_of(kernels::Backend& backend, const Tensor& k, const Tensor& v, int64_t from, int64_t to) {
  KeyChunks::Chunk chunk{Tensor(with_rows(k, to - from), k.dtype(), backend.allocator()),
                         Tensor(with_rows(v, to - from), v.dtype(), backend.allocator())};
  backend.copy(chunk.k, k.view().slice_rows(from, to));
  backend.copy(chunk.v, v.view().slice_rows(from, to));
  return chunk;
}

}  // namespace

void AttentionAcrossRanks::forward(const AttentionArgs& args) {
  const Tensor k = gather_visible_rows(backend_, cp_, shards_, args.k);
  const Tensor v = gather_visible_rows(backend_, cp_, shards_, args.v);
  KeyChunks(backend_, shards_, cp_.rank(), key_chunk_).forward(args, [&](int64_t from, int64_t to) {
    return rows_of(backend_, k, v, from, to);
  });
}

void AttentionAcrossRanks::backward(const AttentionBackwardArgs& args) {
  const Tensor k = gather_visible_rows(backend_, cp_, shards_, args.k);
  const Tensor v = gather_visible_rows(backend_, cp_, shards_, args.v);
  Tensor dk(k.shape(), args.dk.dtype, backend_.allocator()), dv(v.shape(), args.dv.dtype, backend_.allocator());
  KeyChunks(backend_, shards_, cp_.rank(), key_chunk_)
      .backward(
          args, [&](int64_t from, int64_t to) { return rows_of(backend_, k, v, from, to); },
          [&](int64_t from, int64_t to, const TensorView& chunk_dk, const TensorView& chunk_dv) {
            backend_.copy(dk.view().slice_rows(from, to), chunk_dk);
            backend_.copy(dv.view().slice_rows(from, to), chunk_dv);
          });
  return_visible_gradient(backend_, cp_, shards_, dk.view(), args.dk);
  return_visible_gradient(backend_, cp_, shards_, dv.view(), args.dv);
}

}  // namespace moetrain
