// KdaAcrossRanks (see kda_context_parallel.h).
#include "core/model/kda_context_parallel.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/base/error.h"

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

// Every rank's M followed by one state (S_local forward, D_local backward), gathered to the host:
// [ranks, M + S]. The tensors are the backend's; the exchange runs where the communicator's
// buffers live, through device copies of the host buffers for a device communicator (the
// backend's allocator), so the folds always read host memory.
Tensor gather(kernels::Backend& backend, Communicator& cp, const TensorView& transition, const TensorView& state) {
  const Tensor m = to_host(backend, transition), s = to_host(backend, state);
  const int64_t per_rank = m.numel() + s.numel();
  Tensor mine({per_rank}, state.dtype);
  std::memcpy(mine.view().data, m.view().data, m.view().nbytes());
  std::memcpy(static_cast<char*>(mine.view().data) + m.view().nbytes(), s.view().data, s.view().nbytes());
  Tensor all({cp.size(), per_rank}, state.dtype);
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

// One step of a fold over the gathered shards: s = 0 where `continues` is false (a document starts
// there), else s = M_j s + local_j (M_j^T with `transpose`), local_j being shard j's state or
// state gradient.
template <typename T>
void fold_step(const T* values, int j, bool continues, const StateDims& d, bool transpose, std::vector<T>& s) {
  if (!continues) {
    std::fill(s.begin(), s.end(), T(0));
    return;
  }
  const int64_t per_rank = d.transition() + d.state();
  const T* m = values + j * per_rank;
  std::vector<T> next(m + d.transition(), m + per_rank);
  apply_transition(m, s.data(), next.data(), d, transpose);
  s.swap(next);
}

// The state entering shard `me`: S(0) = 0, S(j + 1) = M_j S(j) + S_local_j, or 0 where shard j + 1
// starts a document.
template <typename T>
void fold_entering(const Tensor& all, const ContextShards& shards, int me, const StateDims& d, T* entering) {
  std::vector<T> s(d.state(), T(0));
  for (int j = 0; j < me; ++j) fold_step(all.ptr<T>(), j, shards.continues_document(j + 1), d, false, s);
  std::copy(s.begin(), s.end(), entering);
}

// The gradient of the state leaving shard `me`: dS_out(last) = 0, and
// dS_out(j - 1) = M_j^T dS_out(j) + D_local_j, or 0 where shard j starts a document.
template <typename T>
void fold_leaving(const Tensor& all, const ContextShards& shards, int me, const StateDims& d, T* leaving) {
  std::vector<T> ds(d.state(), T(0));
  for (int j = shards.ranks() - 1; j > me; --j) fold_step(all.ptr<T>(), j, shards.continues_document(j), d, true, ds);
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

}  // namespace

KdaAcrossRanks::KdaAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards)
    : backend_(backend), cp_(cp), shards_(shards) {
  MOETRAIN_CHECK(shards.ranks() == cp.size(), ExitCode::kInternal, "KDA across ranks: a shard per rank");
}

void KdaAcrossRanks::forward(const KdaArgs& args, KdaShardState* saved) {
  const StateDims d = state_dims(args.q, args.v);
  const DType accum = args.g.dtype;
  const int64_t tokens = args.q.size(0);

  // S_local: the shard from a zero state (its outputs are overwritten by the last pass).
  Tensor local_final({d.heads, d.kd, d.vd}, accum, backend_.allocator());
  KdaArgs from_zero = args;
  from_zero.final_state = local_final;
  backend_.kda_forward(from_zero);

  // M: the shard applied to the identity, with zero values (zero when a document starts inside).
  Tensor transition = backend_zeros(backend_, {d.heads, d.kd, d.kd}, accum);
  if (shards_.within_one_document(cp_.rank())) {
    Tensor no_values = backend_zeros(backend_, {tokens, d.heads, d.kd}, args.v.dtype);
    Tensor scratch({tokens, d.heads, d.kd}, args.out.dtype, backend_.allocator());
    KdaArgs through = args;
    through.v = no_values;
    through.out = scratch;
    Tensor identity;
    with_accum_type(accum, [&](auto t) { identity = to_backend(backend_, identities<decltype(t)>(d, accum)); });
    through.initial_state = identity;
    through.final_state = transition;
    backend_.kda_forward(through);
  }

  const Tensor all = gather(backend_, cp_, transition.view(), local_final.view());
  Tensor entering({d.heads, d.kd, d.vd}, accum);
  with_accum_type(accum, [&](auto t) {
    using T = decltype(t);
    fold_entering<T>(all, shards_, cp_.rank(), d, entering.ptr<T>());
  });
  saved->entering = to_backend(backend_, entering);
  saved->transition = std::move(transition);

  KdaArgs run = args;
  run.initial_state = saved->entering;
  backend_.kda_forward(run);
}

void KdaAcrossRanks::backward(const KdaBackwardArgs& args, const KdaShardState& saved) {
  const StateDims d = state_dims(args.q, args.v);
  const DType accum = args.g.dtype;

  // D_local: this shard's own outputs' pull on its entering state, nothing arriving at its end
  // (its input gradients are overwritten by the last pass).
  Tensor local_pull({d.heads, d.kd, d.vd}, accum, backend_.allocator());
  KdaBackwardArgs pull = args;
  pull.initial_state = saved.entering;
  pull.dinitial_state = local_pull;
  backend_.kda_backward(pull);

  const Tensor all = gather(backend_, cp_, saved.transition.view(), local_pull.view());
  Tensor leaving({d.heads, d.kd, d.vd}, accum);
  with_accum_type(accum, [&](auto t) {
    using T = decltype(t);
    fold_leaving<T>(all, shards_, cp_.rank(), d, leaving.ptr<T>());
  });
  const Tensor leaving_backend = to_backend(backend_, leaving);

  KdaBackwardArgs run = args;
  run.initial_state = saved.entering;
  run.dfinal_state = leaving_backend;
  backend_.kda_backward(run);
}

ShortConvAcrossRanks::ShortConvAcrossRanks(kernels::Backend& backend, Communicator& cp, const ContextShards& shards,
                                           int64_t width)
    : backend_(backend), cp_(cp), shards_(shards), reach_(width - 1) {
  MOETRAIN_CHECK(shards.ranks() == cp.size() && width >= 1, ExitCode::kInternal,
                 "short convolution across ranks: a shard per rank and a width of at least 1");
}

int64_t ShortConvAcrossRanks::halo_begin(int r) const {
  return std::max(shards_.document_start(r), shards_.begin(r) - reach_);
}

Tensor ShortConvAcrossRanks::gather_rows(const TensorView& mine) {
  Tensor all({cp_.size() * reach_, mine.size(1)}, mine.dtype, backend_.allocator());
  // A device communicator queues on its own stream (NCCL): the gather starts after the compute
  // that wrote `mine`, and the compute that reads `all` (or reuses either's memory) after it.
  cp_.wait_for(backend_.stream());
  cp_.all_gather(all.view(), mine);
  cp_.release_to(backend_.stream());
  return all;
}

ShortConvAcrossRanks::Extended ShortConvAcrossRanks::extend(const TensorView& x) {
  const int me = cp_.rank();
  const int64_t tokens = x.size(0), channels = x.size(1);
  // Every shard's last rows, aligned to its end: row reach_ - (end - g) holds window token g.
  Tensor tail({reach_, channels}, x.dtype, backend_.allocator());
  backend_.fill(tail, 0.0);
  const int64_t kept = std::min(reach_, tokens);
  if (kept > 0) backend_.copy(tail.view().slice_rows(reach_ - kept, reach_), x.slice_rows(tokens - kept, tokens));
  const Tensor tails = gather_rows(tail);

  Extended e;
  e.halo = shards_.begin(me) - halo_begin(me);
  e.x = Tensor({e.halo + tokens, channels}, x.dtype, backend_.allocator());
  for (int64_t g = halo_begin(me); g < shards_.begin(me); ++g) {
    int q = 0;
    while (!(shards_.begin(q) <= g && g < shards_.end(q))) ++q;  // the owner of token g
    const int64_t row = q * reach_ + reach_ - (shards_.end(q) - g);
    const int64_t at = g - halo_begin(me);
    backend_.copy(e.x.view().slice_rows(at, at + 1), tails.view().slice_rows(row, row + 1));
  }
  backend_.copy(e.x.view().slice_rows(e.halo, e.halo + tokens), x);

  std::vector<int32_t> cu = shards_.local_cu(me);
  for (size_t i = 1; i < cu.size(); ++i) cu[i] += static_cast<int32_t>(e.halo);
  Tensor host({static_cast<int64_t>(cu.size())}, DType::kI32);
  std::copy(cu.begin(), cu.end(), host.ptr<int32_t>());
  e.cu = Tensor(host.shape(), DType::kI32, backend_.allocator());
  backend_.copy(e.cu, host);
  return e;
}

void ShortConvAcrossRanks::forward(const ShortConvArgs& args) {
  const Extended e = extend(args.x);
  const int64_t tokens = args.x.size(0);
  Tensor y({e.halo + tokens, args.y.size(1)}, args.y.dtype, backend_.allocator());
  backend_.short_conv_forward(ShortConvArgs{y, e.x, args.weight, e.cu, args.silu});
  backend_.copy(args.y, y.view().slice_rows(e.halo, e.halo + tokens));
}

void ShortConvAcrossRanks::backward(const ShortConvBackwardArgs& args) {
  const int me = cp_.rank();
  const Extended e = extend(args.x);
  const int64_t tokens = args.x.size(0), channels = args.x.size(1);
  Tensor dy({e.halo + tokens, channels}, args.dy.dtype, backend_.allocator());
  backend_.fill(dy.view().slice_rows(0, e.halo), 0.0);
  backend_.copy(dy.view().slice_rows(e.halo, e.halo + tokens), args.dy);
  Tensor dx({e.halo + tokens, channels}, args.dx.dtype, backend_.allocator());
  backend_.short_conv_backward(ShortConvBackwardArgs{dx, args.dweight, dy, e.x, args.weight, e.cu, args.silu});
  backend_.copy(args.dx, dx.view().slice_rows(e.halo, e.halo + tokens));

  // The halo's gradient, aligned to this shard's start: row reach_ - (begin - g) holds token g's.
  Tensor mine({reach_, channels}, args.dx.dtype, backend_.allocator());
  backend_.fill(mine, 0.0);
  if (e.halo > 0) backend_.copy(mine.view().slice_rows(reach_ - e.halo, reach_), dx.view().slice_rows(0, e.halo));
  const Tensor halos = gather_rows(mine);
  for (int r = me + 1; r < cp_.size(); ++r) {
    const int64_t first = std::max(halo_begin(r), shards_.begin(me)), last = std::min(shards_.begin(r), shards_.end(me));
    for (int64_t g = first; g < last; ++g) {
      const int64_t row = r * reach_ + reach_ - (shards_.begin(r) - g), at = g - shards_.begin(me);
      backend_.axpby(args.dx.slice_rows(at, at + 1), halos.view().slice_rows(row, row + 1), 1.0, 1.0);
    }
  }
}

}  // namespace moetrain
