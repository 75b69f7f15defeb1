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

// For every span of the window, the part of window tokens [from, to) it holds: body(span, first,
// count) with `first` the window position of its first token there.
template <typename Body>
void for_each_part(const ContextShards& shards, int64_t from, int64_t to, Body&& body) {
  for (const ContextShards::Span& span : shards.spans()) {
    const int64_t first = std::max(from, span.begin), last = std::min(to, span.end);
    if (first < last) body(span, first, last - first);
  }
}

// For every visible row of rank `me` and the span holding it: body(at_visible, at_gathered, count)
// for `count` rows from visible row at_visible, at row at_gathered of every rank's rows gathered
// (`longest` rows a rank).
template <typename Body>
void for_each_visible_part(const ContextShards& shards, int me, int64_t longest, Body&& body) {
  int64_t at_visible = 0;
  for (const ContextShards::Range& range : shards.visible_ranges(me)) {
    for_each_part(shards, range.begin, range.end, [&](const ContextShards::Span& span, int64_t first, int64_t count) {
      body(at_visible + first - range.begin, span.rank * longest + span.row + first - span.begin, count);
    });
    at_visible += range.end - range.begin;
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

std::vector<SpanQueries> span_queries(kernels::Backend& backend, const ContextShards& shards, int rank) {
  std::vector<SpanQueries> out;
  for (int s : shards.spans_of(rank)) {
    const ContextShards::Span& span = shards.spans()[s];
    if (span.tokens() == 0) continue;
    SpanQueries p;
    p.row = span.row;
    p.tokens = span.tokens();
    p.key_from = shards.visible_row(rank, shards.document_start(s));
    p.key_to = shards.visible_row(rank, span.end - 1) + 1;
    p.key_cu = shards.key_cu(s);
    p.cu = upload_offsets(backend, shards.span_cu(s));
    out.push_back(std::move(p));
  }
  return out;
}

AttentionAcrossRanks::AttentionAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                                           int64_t key_chunk)
    : backend_(backend), cp_(cp), shards_(shards), key_chunk_(key_chunk) {
  MOETRAIN_CHECK(shards.ranks() == cp.size(), ExitCode::kInternal, "attention across ranks: a shard per rank");
}

Tensor gather_visible_rows(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                           const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard();
  Tensor visible(with_rows(own, shards.visible_rows(me)), own.dtype, backend.allocator());
  Tensor padded(with_rows(own, longest), own.dtype, backend.allocator());
  backend.fill(padded, 0.0);
  if (own.size(0) > 0) backend.copy(padded.view().slice_rows(0, own.size(0)), own);
  Tensor every(with_rows(own, longest * cp.size()), own.dtype, backend.allocator());
  // Ordered against the backend's stream both ways, as a device communicator queues on its own
  // (NCCL): after the copies into `padded`, before the copies out of `every`.
  cp.wait_for(backend.stream());
  cp.all_gather(every.view(), padded.view());
  cp.release_to(backend.stream());
  for_each_visible_part(shards, me, longest, [&](int64_t at_visible, int64_t at, int64_t count) {
    backend.copy(visible.view().slice_rows(at_visible, at_visible + count), every.view().slice_rows(at, at + count));
  });
  return visible;
}

void return_visible_gradient(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                             const TensorView& visible, const TensorView& own) {
  const int me = cp.rank();
  const int64_t longest = shards.longest_shard();
  Tensor every(with_rows(own, longest * cp.size()), own.dtype, backend.allocator());
  backend.fill(every, 0.0);
  for_each_visible_part(shards, me, longest, [&](int64_t at_visible, int64_t at, int64_t count) {
    backend.copy(every.view().slice_rows(at, at + count), visible.slice_rows(at_visible, at_visible + count));
  });
  Tensor mine(with_rows(own, longest), own.dtype, backend.allocator());
  cp.wait_for(backend.stream());
  cp.reduce_scatter(mine.view(), every.view());
  cp.release_to(backend.stream());
  if (own.size(0) > 0) backend.copy(own, mine.view().slice_rows(0, own.size(0)));
}

KeyChunks::KeyChunks(kernels::Backend& backend, const ContextShards& shards, int rank, int64_t chunk_rows)
    : backend_(backend),
      spans_(span_queries(backend, shards, rank)),
      visible_rows_(shards.visible_rows(rank)),
      chunk_rows_(chunk_rows > 0 ? chunk_rows : std::max<int64_t>(shards.longest_shard(), 1)) {}

template <typename Body>
void KeyChunks::for_each_chunk(Body&& body) const {
  for (int64_t from = 0; from < visible_rows_; from += chunk_rows_) body(from, std::min(from + chunk_rows_, visible_rows_));
}

Tensor KeyChunks::segments(const SpanQueries& p, int64_t from, int64_t to) const {
  std::vector<int32_t> cu = p.key_cu;
  for (int32_t& c : cu) c = static_cast<int32_t>(std::clamp<int64_t>(p.key_from + c, from, to) - from);
  return upload_offsets(backend_, cu);
}

void KeyChunks::forward(const AttentionArgs& args, const Keys& keys) const {
  std::vector<bool> started(spans_.size(), false);
  for_each_chunk([&](int64_t from, int64_t to) {
    const Chunk chunk = keys(from, to);
    for (size_t i = 0; i < spans_.size(); ++i) {
      const SpanQueries& p = spans_[i];
      const int64_t first = std::max(from, p.key_from), last = std::min(to, p.key_to);
      if (first >= last) continue;
      const Tensor cu = segments(p, first, last);
      const TensorView out = args.out.slice_rows(p.row, p.row + p.tokens);
      const TensorView lse = args.lse.slice_rows(p.row, p.row + p.tokens);
      AttentionArgs run = args;
      run.q = args.q.slice_rows(p.row, p.row + p.tokens);
      run.k = chunk.k.view().slice_rows(first - from, last - from);
      run.v = chunk.v.view().slice_rows(first - from, last - from);
      run.cu_seqlens = p.cu;
      run.cu_seqlens_k = cu;
      // The span's queries are the last of its keys: query i sits at key row key_to - tokens + i.
      run.key_shift = p.key_to - p.tokens - first;
      // The first chunk a span sees writes its out and lse; each later one is folded in.
      if (!started[i]) {
        run.out = out;
        run.lse = lse;
        backend_.attention_forward(run);
        started[i] = true;
        continue;
      }
      Tensor chunk_out(out.shape, out.dtype, backend_.allocator());
      Tensor chunk_lse(lse.shape, lse.dtype, backend_.allocator());
      run.out = chunk_out;
      run.lse = chunk_lse;
      backend_.attention_forward(run);
      backend_.attention_merge(kernels::AttentionMergeArgs{out, lse, chunk_out, chunk_lse});
    }
  });
}

void KeyChunks::backward(const AttentionBackwardArgs& args, const Keys& keys, const KeyGradients& key_gradients) const {
  std::vector<bool> started(spans_.size(), false);
  for_each_chunk([&](int64_t from, int64_t to) {
    const Chunk chunk = keys(from, to);
    Tensor dk(chunk.k.shape(), args.dq.dtype, backend_.allocator());
    Tensor dv(chunk.v.shape(), args.dq.dtype, backend_.allocator());
    backend_.fill(dk, 0.0);
    backend_.fill(dv, 0.0);
    for (size_t i = 0; i < spans_.size(); ++i) {
      const SpanQueries& p = spans_[i];
      const int64_t first = std::max(from, p.key_from), last = std::min(to, p.key_to);
      if (first >= last) continue;
      const Tensor cu = segments(p, first, last);
      const TensorView dq = args.dq.slice_rows(p.row, p.row + p.tokens);
      Shape dk_shape = chunk.k.shape(), dv_shape = chunk.v.shape();
      dk_shape[0] = dv_shape[0] = last - first;
      Tensor span_dk(dk_shape, args.dq.dtype, backend_.allocator()), span_dv(dv_shape, args.dq.dtype, backend_.allocator());
      Tensor span_dq = started[i] ? Tensor(dq.shape, dq.dtype, backend_.allocator()) : Tensor();
      AttentionBackwardArgs run = args;
      run.dq = started[i] ? span_dq.view() : dq;
      run.dk = span_dk;
      run.dv = span_dv;
      run.dout = args.dout.slice_rows(p.row, p.row + p.tokens);
      run.q = args.q.slice_rows(p.row, p.row + p.tokens);
      run.out = args.out.slice_rows(p.row, p.row + p.tokens);
      run.lse = args.lse.slice_rows(p.row, p.row + p.tokens);
      run.k = chunk.k.view().slice_rows(first - from, last - from);
      run.v = chunk.v.view().slice_rows(first - from, last - from);
      run.cu_seqlens = p.cu;
      run.cu_seqlens_k = cu;
      run.key_shift = p.key_to - p.tokens - first;
      backend_.attention_backward(run);
      if (started[i]) backend_.axpby(dq, span_dq, 1.0, 1.0);
      started[i] = true;
      backend_.axpby(dk.view().slice_rows(first - from, last - from), span_dk, 1.0, 1.0);
      backend_.axpby(dv.view().slice_rows(first - from, last - from), span_dv, 1.0, 1.0);
    }
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
