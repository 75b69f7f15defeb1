// KdaAcrossRanks (see kda_context_parallel.h).
#include "core/model/kda_context_parallel.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/base/error.h"
#include "core/model/attention_context_parallel.h"

namespace moetrain {

using kernels::KdaArgs;
using kernels::KdaBackwardArgs;
using kernels::ShortConvArgs;
using kernels::ShortConvBackwardArgs;

namespace {

struct StateDims {
  int64_t heads = 0, kd = 0, vd = 0;
  int64_t transition() const { return heads * kd * kd; }  // M's elements
  int64_t state() const { return heads * kd * vd; }       // S's elements
};

Tensor zeros(Shape shape, DType dtype) {
  Tensor t(shape, dtype);
  if (t.view().nbytes() > 0) std::memset(t.view().data, 0, t.view().nbytes());
  return t;
}

// Zeros in the backend's memory.
Tensor backend_zeros(kernels::Backend& backend, Shape shape, DType dtype) {
  Tensor t(shape, dtype, backend.allocator());
  backend.fill(t, 0.0);
  return t;
}

// I [k_dim, k_dim] per head.
template <typename T>
Tensor identities(const StateDims& d, DType dtype) {
  Tensor t = zeros({d.heads, d.kd, d.kd}, dtype);
  for (int64_t h = 0; h < d.heads; ++h)
    for (int64_t a = 0; a < d.kd; ++a) t.ptr<T>()[(h * d.kd + a) * d.kd + a] = T(1);
  return t;
}

// A host copy of a tensor the backend holds (host or device; the copy waits for the backend).
Tensor to_host(kernels::Backend& backend, const TensorView& t) {
  Tensor host(t.shape, t.dtype);
  backend.copy(host, t);
  return host;
}

// A tensor of the backend's holding the host tensor's values.
Tensor to_backend(kernels::Backend& backend, const Tensor& host) {
  Tensor t(host.shape(), host.dtype(), backend.allocator());
  backend.copy(t, host);
  return t;
}

// Every rank's M and one state (S_local forward, D_local backward) per span slot, gathered to the
// host: [ranks, slots, M + S]. The tensors are the backend's ([slots, ...] each); the exchange
// runs where the communicator's buffers live, through device copies of the host buffers for a
// device communicator (the backend's allocator), so the folds always read host memory.
Tensor gather(kernels::Backend& backend, Communicator& cp, const TensorView& transitions, const TensorView& states) {
  const Tensor m = to_host(backend, transitions), s = to_host(backend, states);
  const int64_t slots = m.shape()[0], m_size = m.numel() / slots, s_size = s.numel() / slots;
  const size_t elem = dtype_size(states.dtype);
  Tensor mine({slots, m_size + s_size}, states.dtype);
  for (int64_t i = 0; i < slots; ++i) {
    char* row = static_cast<char*>(mine.view().data) + i * (m_size + s_size) * elem;
    std::memcpy(row, static_cast<const char*>(m.view().data) + i * m_size * elem, m_size * elem);
    std::memcpy(row + m_size * elem, static_cast<const char*>(s.view().data) + i * s_size * elem, s_size * elem);
  }
  Tensor all({cp.size(), slots, m_size + s_size}, states.dtype);
  if (cp.device() == Device::kCPU) {
    cp.all_gather(all.view(), mine.view());
    return all;
  }
  const Tensor mine_device = to_backend(backend, mine);
  Tensor all_device(all.shape(), all.dtype(), backend.allocator());
  backend.synchronize();  // the buffer is on the device before the communicator's stream reads it
  cp.all_gather(all_device.view(), mine_device.view());
  cp.synchronize();
  backend.copy(all, all_device);
  return all;
}

// out[h] += m[h] s[h] (m[h]^T with `transpose`): m [kd, kd], s and out [kd, vd].
template <typename T>
void apply_transition(const T* m, const T* s, T* out, const StateDims& d, bool transpose) {
  for (int64_t h = 0; h < d.heads; ++h) {
    const T* mh = m + h * d.kd * d.kd;
    const T* sh = s + h * d.kd * d.vd;
    T* oh = out + h * d.kd * d.vd;
    for (int64_t a = 0; a < d.kd; ++a)
      for (int64_t c = 0; c < d.kd; ++c) {
        const T mac = transpose ? mh[c * d.kd + a] : mh[a * d.kd + c];
        for (int64_t b = 0; b < d.vd; ++b) oh[a * d.vd + b] += mac * sh[c * d.vd + b];
      }
  }
}

// Where span j's (M, state) sits among the gathered slots: its rank's slots, at its place among
// that rank's spans.
std::vector<int64_t> span_slots(const ContextShards& shards) {
  std::vector<int64_t> slot(shards.spans().size());
  for (int r = 0; r < shards.ranks(); ++r) {
    const std::vector<int>& mine = shards.spans_of(r);
    for (size_t i = 0; i < mine.size(); ++i) slot[mine[i]] = r * shards.most_spans() + static_cast<int64_t>(i);
  }
  return slot;
}

// One step of a fold over the gathered spans: s = 0 where `continues` is false (a document starts
// there), else s = M_j s + local_j (M_j^T with `transpose`), local_j being the state or state
// gradient in slot j.
template <typename T>
void fold_step(const T* values, int64_t slot, bool continues, const StateDims& d, bool transpose, std::vector<T>& s) {
  if (!continues) {
    std::fill(s.begin(), s.end(), T(0));
    return;
  }
  const int64_t per_slot = d.transition() + d.state();
  const T* m = values + slot * per_slot;
  std::vector<T> next(m + d.transition(), m + per_slot);
  apply_transition(m, s.data(), next.data(), d, transpose);
  s.swap(next);
}

// The state entering span `me` (in window order): S(0) = 0, S(j + 1) = M_j S(j) + S_local_j, or 0
// where span j + 1 starts a document.
template <typename T>
void fold_entering(const Tensor& all, const ContextShards& shards, int me, const StateDims& d, T* entering) {
  const std::vector<int64_t> slot = span_slots(shards);
  std::vector<T> s(d.state(), T(0));
  for (int j = 0; j < me; ++j) fold_step(all.ptr<T>(), slot[j], shards.continues_document(j + 1), d, false, s);
  std::copy(s.begin(), s.end(), entering);
}

// The gradient of the state leaving span `me`: dS_out(last) = 0, and
// dS_out(j - 1) = M_j^T dS_out(j) + D_local_j, or 0 where span j starts a document.
template <typename T>
void fold_leaving(const Tensor& all, const ContextShards& shards, int me, const StateDims& d, T* leaving) {
  const std::vector<int64_t> slot = span_slots(shards);
  std::vector<T> ds(d.state(), T(0));
  for (int j = static_cast<int>(shards.spans().size()) - 1; j > me; --j)
    fold_step(all.ptr<T>(), slot[j], shards.continues_document(j), d, true, ds);
  std::copy(ds.begin(), ds.end(), leaving);
}

template <typename Body>
void with_accum_type(DType dtype, Body&& body) {
  if (dtype == DType::kF64) return body(double{});
  MOETRAIN_CHECK(dtype == DType::kF32, ExitCode::kInternal,
                 std::string("KDA across ranks: states are F32 or F64, not ") + dtype_name(dtype));
  body(float{});
}

StateDims state_dims(const TensorView& q, const TensorView& v) { return {q.size(1), q.size(2), v.size(2)}; }

// Slot i of a [slots, ...] tensor.
TensorView slot_of(const Tensor& t, int64_t i) {
  TensorView one = t.view().slice_rows(i, i + 1);
  return one.reshaped(Shape(t.shape().begin() + 1, t.shape().end()));
}

// The rows of span `s` of this rank's arguments, with the span's own segments.
struct SpanRows {
  int64_t row = 0, tokens = 0;
  Tensor cu;
  TensorView operator()(const TensorView& t) const { return t.slice_rows(row, row + tokens); }
};

SpanRows span_rows(kernels::Backend& backend, const ContextShards& shards, int s) {
  const ContextShards::Span& span = shards.spans()[s];
  return SpanRows{span.row, span.tokens(), upload_offsets(backend, shards.span_cu(s))};
}

KdaArgs for_span(const KdaArgs& args, const SpanRows& rows) {
  KdaArgs run = args;
  run.out = rows(args.out), run.q = rows(args.q), run.k = rows(args.k), run.v = rows(args.v);
  run.g = rows(args.g), run.beta = rows(args.beta), run.cu_seqlens = rows.cu;
  return run;
}

KdaBackwardArgs for_span(const KdaBackwardArgs& args, const SpanRows& rows) {
  KdaBackwardArgs run = args;
  run.dq = rows(args.dq), run.dk = rows(args.dk), run.dv = rows(args.dv), run.dg = rows(args.dg);
  run.dbeta = rows(args.dbeta), run.dout = rows(args.dout);
  run.q = rows(args.q), run.k = rows(args.k), run.v = rows(args.v), run.g = rows(args.g), run.beta = rows(args.beta);
  run.cu_seqlens = rows.cu;
  return run;
}

}  // namespace

KdaAcrossRanks::KdaAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards)
    : backend_(backend), cp_(cp), shards_(shards) {
  MOETRAIN_CHECK(shards.ranks() == cp.size(), ExitCode::kInternal, "KDA across ranks: a shard per rank");
}

void KdaAcrossRanks::forward(const KdaArgs& args, KdaShardState* saved) {
  const StateDims d = state_dims(args.q, args.v);
  const DType accum = args.g.dtype;
  const std::vector<int>& mine = shards_.spans_of(cp_.rank());
  const int64_t slots = shards_.most_spans();

  // Per span, S_local: the span from a zero state (its outputs are overwritten by the last pass);
  // M: the span applied to the identity, with zero values (zero when a document starts inside).
  Tensor local_final = backend_zeros(backend_, {slots, d.heads, d.kd, d.vd}, accum);
  Tensor transition = backend_zeros(backend_, {slots, d.heads, d.kd, d.kd}, accum);
  Tensor identity;
  with_accum_type(accum, [&](auto t) { identity = to_backend(backend_, identities<decltype(t)>(d, accum)); });
  std::vector<SpanRows> rows;
  for (size_t i = 0; i < mine.size(); ++i) {
    rows.push_back(span_rows(backend_, shards_, mine[i]));
    KdaArgs from_zero = for_span(args, rows[i]);
    from_zero.final_state = slot_of(local_final, i);
    backend_.kda_forward(from_zero);
    if (!shards_.within_one_document(mine[i])) continue;
    Tensor no_values = backend_zeros(backend_, {rows[i].tokens, d.heads, d.kd}, args.v.dtype);
    Tensor scratch({rows[i].tokens, d.heads, d.kd}, args.out.dtype, backend_.allocator());
    KdaArgs through = from_zero;
    through.v = no_values;
    through.out = scratch;
    through.initial_state = identity;
    through.final_state = slot_of(transition, i);
    backend_.kda_forward(through);
  }

  const Tensor all = gather(backend_, cp_, transition.view(), local_final.view());
  Tensor entering({slots, d.heads, d.kd, d.vd}, accum);
  with_accum_type(accum, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < mine.size(); ++i)
      fold_entering<T>(all, shards_, mine[i], d, entering.ptr<T>() + i * d.state());
  });
  saved->entering = to_backend(backend_, entering);
  saved->transition = std::move(transition);

  for (size_t i = 0; i < mine.size(); ++i) {
    KdaArgs run = for_span(args, rows[i]);
    run.initial_state = slot_of(saved->entering, i);
    backend_.kda_forward(run);
  }
}

void KdaAcrossRanks::backward(const KdaBackwardArgs& args, const KdaShardState& saved) {
  const StateDims d = state_dims(args.q, args.v);
  const DType accum = args.g.dtype;
  const std::vector<int>& mine = shards_.spans_of(cp_.rank());
  const int64_t slots = shards_.most_spans();

  // Per span, D_local: its own outputs' pull on its entering state, nothing arriving at its end
  // (its input gradients are overwritten by the last pass).
  Tensor local_pull = backend_zeros(backend_, {slots, d.heads, d.kd, d.vd}, accum);
  std::vector<SpanRows> rows;
  for (size_t i = 0; i < mine.size(); ++i) {
    rows.push_back(span_rows(backend_, shards_, mine[i]));
    KdaBackwardArgs pull = for_span(args, rows[i]);
    pull.initial_state = slot_of(saved.entering, i);
    pull.dinitial_state = slot_of(local_pull, i);
    backend_.kda_backward(pull);
  }

  const Tensor all = gather(backend_, cp_, saved.transition.view(), local_pull.view());
  Tensor leaving({slots, d.heads, d.kd, d.vd}, accum);
  with_accum_type(accum, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < mine.size(); ++i) fold_leaving<T>(all, shards_, mine[i], d, leaving.ptr<T>() + i * d.state());
  });
  const Tensor leaving_backend = to_backend(backend_, leaving);

  for (size_t i = 0; i < mine.size(); ++i) {
    KdaBackwardArgs run = for_span(args, rows[i]);
    run.initial_state = slot_of(saved.entering, i);
    run.dfinal_state = slot_of(leaving_backend, i);
    backend_.kda_backward(run);
  }
}

ShortConvAcrossRanks::ShortConvAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                                           int64_t width)
    : backend_(backend), cp_(cp), shards_(shards), reach_(width - 1) {
  MOETRAIN_CHECK(shards.ranks() == cp.size() && width >= 1, ExitCode::kInternal,
                 "short convolution across ranks: a shard per rank and a width of at least 1");
}

int64_t ShortConvAcrossRanks::halo_begin(int s) const {
  return std::max(shards_.document_start(s), shards_.spans()[s].begin - reach_);
}

Tensor ShortConvAcrossRanks::gather_rows(const TensorView& mine) {
  Tensor all({cp_.size() * mine.size(0), mine.size(1)}, mine.dtype, backend_.allocator());
  // A device communicator queues on its own stream (NCCL): the gather starts after the compute
  // that wrote `mine`, and the compute that reads `all` (or reuses either's memory) after it.
  cp_.wait_for(backend_.stream());
  cp_.all_gather(all.view(), mine);
  cp_.release_to(backend_.stream());
  return all;
}

ShortConvAcrossRanks::Extended ShortConvAcrossRanks::extend(const TensorView& x) {
  const int me = cp_.rank();
  const std::vector<int>& mine = shards_.spans_of(me);
  const std::vector<int64_t> slot = span_slots(shards_);
  const int64_t channels = x.size(1);
  // Every span's last rows, aligned to its end: row slot * reach_ + reach_ - (end - g) holds
  // window token g.
  Tensor tail({shards_.most_spans() * reach_, channels}, x.dtype, backend_.allocator());
  backend_.fill(tail, 0.0);
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextShards::Span& span = shards_.spans()[mine[i]];
    const int64_t kept = std::min(reach_, span.tokens()), at = static_cast<int64_t>(i) * reach_;
    if (kept > 0)
      backend_.copy(tail.view().slice_rows(at + reach_ - kept, at + reach_),
                    x.slice_rows(span.row + span.tokens() - kept, span.row + span.tokens()));
  }
  const Tensor tails = gather_rows(tail);

  // Each span after its halo: [halo, span] after [halo, span] of the spans before it.
  Extended e;
  std::vector<int32_t> cu = {0};
  for (int s : mine) {
    const ContextShards::Span& span = shards_.spans()[s];
    e.halo.push_back(span.begin - halo_begin(s));
    e.at.push_back(cu.back());
    const std::vector<int32_t> own = shards_.span_cu(s);
    for (size_t i = 1; i < own.size(); ++i) cu.push_back(static_cast<int32_t>(e.at.back() + e.halo.back() + own[i]));
  }
  e.x = Tensor({cu.back(), channels}, x.dtype, backend_.allocator());
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextShards::Span& span = shards_.spans()[mine[i]];
    for (int64_t g = halo_begin(mine[i]); g < span.begin; ++g) {
      int q = mine[i] - 1;
      while (shards_.spans()[q].begin > g) --q;  // the span holding token g
      const int64_t row = slot[q] * reach_ + reach_ - (shards_.spans()[q].end - g);
      const int64_t at = e.at[i] + g - halo_begin(mine[i]);
      backend_.copy(e.x.view().slice_rows(at, at + 1), tails.view().slice_rows(row, row + 1));
    }
    const int64_t own = e.at[i] + e.halo[i];
    backend_.copy(e.x.view().slice_rows(own, own + span.tokens()), x.slice_rows(span.row, span.row + span.tokens()));
  }
  e.cu = upload_offsets(backend_, cu);
  return e;
}

void ShortConvAcrossRanks::forward(const ShortConvArgs& args) {
  const Extended e = extend(args.x);
  Tensor y({e.x.shape()[0], args.y.size(1)}, args.y.dtype, backend_.allocator());
  backend_.short_conv_forward(ShortConvArgs{y, e.x, args.weight, e.cu, args.silu});
  const std::vector<int>& mine = shards_.spans_of(cp_.rank());
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextShards::Span& span = shards_.spans()[mine[i]];
    const int64_t own = e.at[i] + e.halo[i];
    backend_.copy(args.y.slice_rows(span.row, span.row + span.tokens()), y.view().slice_rows(own, own + span.tokens()));
  }
}

void ShortConvAcrossRanks::backward(const ShortConvBackwardArgs& args) {
  const int me = cp_.rank();
  const std::vector<int>& mine = shards_.spans_of(me);
  const std::vector<int64_t> slot = span_slots(shards_);
  const Extended e = extend(args.x);
  const int64_t channels = args.x.size(1);
  Tensor dy({e.x.shape()[0], channels}, args.dy.dtype, backend_.allocator());
  backend_.fill(dy, 0.0);
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextShards::Span& span = shards_.spans()[mine[i]];
    const int64_t own = e.at[i] + e.halo[i];
    backend_.copy(dy.view().slice_rows(own, own + span.tokens()), args.dy.slice_rows(span.row, span.row + span.tokens()));
  }
  Tensor dx({e.x.shape()[0], channels}, args.dx.dtype, backend_.allocator());
  backend_.short_conv_backward(ShortConvBackwardArgs{dx, args.dweight, dy, e.x, args.weight, e.cu, args.silu});

  // Each span's own rows, and its halo's gradient aligned to its start in its slot: row
  // slot * reach_ + reach_ - (begin - g) holds token g's.
  Tensor halo_grad({shards_.most_spans() * reach_, channels}, args.dx.dtype, backend_.allocator());
  backend_.fill(halo_grad, 0.0);
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextShards::Span& span = shards_.spans()[mine[i]];
    const int64_t own = e.at[i] + e.halo[i], at = static_cast<int64_t>(i) * reach_;
    backend_.copy(args.dx.slice_rows(span.row, span.row + span.tokens()), dx.view().slice_rows(own, own + span.tokens()));
    if (e.halo[i] > 0)
      backend_.copy(halo_grad.view().slice_rows(at + reach_ - e.halo[i], at + reach_),
                    dx.view().slice_rows(e.at[i], own));
  }
  const Tensor halos = gather_rows(halo_grad);
  // Every later span's halo rows that this rank's spans hold.
  for (int m : mine) {
    const ContextShards::Span& held = shards_.spans()[m];
    for (int s = m + 1; s < static_cast<int>(shards_.spans().size()); ++s) {
      const ContextShards::Span& later = shards_.spans()[s];
      const int64_t first = std::max(halo_begin(s), held.begin), last = std::min(later.begin, held.end);
      for (int64_t g = first; g < last; ++g) {
        const int64_t row = slot[s] * reach_ + reach_ - (later.begin - g), at = held.row + g - held.begin;
        backend_.axpby(args.dx.slice_rows(at, at + 1), halos.view().slice_rows(row, row + 1), 1.0, 1.0);
      }
    }
  }
}

}  // namespace moetrain
