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

AttentionAcrossRanks::VisibleKeys AttentionAcrossRanks::gather_keys(const TensorView& k, const TensorView& v) {
  const int me = cp_.rank();
  const int64_t longest = shards_.longest_shard(), from = shards_.document_start(me), to = shards_.end(me);
  VisibleKeys keys{Tensor(with_rows(k, to - from), k.dtype), Tensor(with_rows(v, to - from), v.dtype),
                   Tensor({static_cast<int64_t>(shards_.key_cu(me).size())}, DType::kI32)};
  for (const auto& [own, visible] : {std::make_pair(&k, &keys.k), std::make_pair(&v, &keys.v)}) {
    Tensor padded(with_rows(*own, longest), own->dtype);
    std::memset(padded.view().data, 0, padded.view().nbytes());
    std::memcpy(padded.view().data, own->data, own->nbytes());
    Tensor every(with_rows(*own, longest * cp_.size()), own->dtype);
    cp_.all_gather(every.view(), padded.view());
    const size_t row = row_bytes(*own);
    for_each_part(shards_, from, to, [&](int j, int64_t first, int64_t count) {
      std::memcpy(static_cast<char*>(visible->view().data) + (first - from) * row,
                  static_cast<const char*>(every.view().data) + (j * longest + first - shards_.begin(j)) * row,
                  count * row);
    });
  }
  const std::vector<int32_t> cu = shards_.key_cu(me);
  std::copy(cu.begin(), cu.end(), keys.cu.ptr<int32_t>());
  return keys;
}

void AttentionAcrossRanks::return_gradient(const TensorView& visible, const TensorView& own) {
  const int me = cp_.rank();
  const int64_t longest = shards_.longest_shard(), from = shards_.document_start(me);
  const size_t row = row_bytes(visible);
  Tensor every(with_rows(own, longest * cp_.size()), own.dtype);
  std::memset(every.view().data, 0, every.view().nbytes());
  for_each_part(shards_, from, shards_.end(me), [&](int j, int64_t first, int64_t count) {
    std::memcpy(static_cast<char*>(every.view().data) + (j * longest + first - shards_.begin(j)) * row,
                static_cast<const char*>(visible.data) + (first - from) * row, count * row);
  });
  Tensor mine(with_rows(own, longest), own.dtype);
  cp_.reduce_scatter(mine.view(), every.view());
  std::memcpy(own.data, mine.view().data, own.nbytes());
}

void AttentionAcrossRanks::forward(const AttentionArgs& args) {
  const VisibleKeys keys = gather_keys(args.k, args.v);
  AttentionArgs run = args;
  run.k = keys.k;
  run.v = keys.v;
  run.cu_seqlens_k = keys.cu;
  backend_.attention_forward(run);
}

void AttentionAcrossRanks::backward(const AttentionBackwardArgs& args) {
  const VisibleKeys keys = gather_keys(args.k, args.v);
  Tensor dk(keys.k.shape(), args.dk.dtype), dv(keys.v.shape(), args.dv.dtype);
  AttentionBackwardArgs run = args;
  run.k = keys.k;
  run.v = keys.v;
  run.dk = dk;
  run.dv = dv;
  run.cu_seqlens_k = keys.cu;
  backend_.attention_backward(run);
  return_gradient(dk.view(), args.dk);
  return_gradient(dv.view(), args.dv);
}

}  // namespace moetrain
