// Both forms of KDA (see kda.h). Work is done per (segment, head) on copies of that head's rows,
// in T, in a fixed order: results depend on the inputs only.
//
// The chunked backward, per chunk (inputs of the chunk, S0 the state entering it, dout its rows'
// output gradients, dS the gradient of the state leaving it; q below is already scaled,
// K^_j = k_j exp(G_last - G_j), and dG the gradient of the cumulative decay G):
//   dv_new_j = sum_{i >= j} M[i, j] dout_i + dS^T K^_j,         dM[i, j] = dout_i . v_new_j
//   dS0 = Diag(exp(G_last)) dS + (q exp(G))^T dout - w^T dv_new
//   du = dv_new,  dw = -dv_new S0^T
//   db = T^T du,  dc = T^T dw  (b = beta v, c = beta k exp(G): u = T b, w = T c)
//   dA = -(db u^T + dc w^T) on the strict lower triangle  (from d(I + A)^-1 = -T dA T)
// and each product of exp(G_i - G_j) gives its two factors and +-its value to dG_i and dG_j.
// Last, dg = the reverse cumulative sum of dG within the chunk, and dq = scale * d(scaled q).
#include "kernels/cpu/kda.h"

#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace moetrain::kernels::cpu {
namespace {

// Shapes of one call: q, k, g [tokens, heads, kd]; v, out [tokens, heads, vd]; beta [tokens, heads].
struct KdaDims {
  int64_t heads = 0;
  int64_t kd = 0;
  int64_t vd = 0;
};

KdaDims kda_dims(const TensorView& q, const TensorView& v) { return {q.size(1), q.size(2), v.size(2)}; }

// The rows of tokens [start, start + n) of head h, copied contiguous: q (scaled), k, g [n, kd],
// v [n, vd], beta [n].
template <typename T>
struct HeadRows {
  int64_t n = 0;
  std::vector<T> q, k, v, g, beta;
};

template <typename T>
HeadRows<T> load_rows(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                      const TensorView& beta, double scale, const KdaDims& d, int64_t h, int64_t start, int64_t n) {
  HeadRows<T> r;
  r.n = n;
  r.q.resize(n * d.kd);
  r.k.resize(n * d.kd);
  r.g.resize(n * d.kd);
  r.v.resize(n * d.vd);
  r.beta.resize(n);
  const T *qp = q.ptr<T>(), *kp = k.ptr<T>(), *vp = v.ptr<T>(), *gp = g.ptr<T>(), *bp = beta.ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = (start + i) * d.heads + h;
    for (int64_t c = 0; c < d.kd; ++c) {
      r.q[i * d.kd + c] = static_cast<T>(scale) * qp[row * d.kd + c];
      r.k[i * d.kd + c] = kp[row * d.kd + c];
      r.g[i * d.kd + c] = gp[row * d.kd + c];
    }
    for (int64_t c = 0; c < d.vd; ++c) r.v[i * d.vd + c] = vp[row * d.vd + c];
    r.beta[i] = bp[row];
  }
  return r;
}

// Calls body(start, end, edges) for each segment of cu_seqlens; edges says whether it is the
// first and the last (the ones the optional states of KdaArgs belong to).
struct SegmentEdges {
  bool first = false;
  bool last = false;
};

template <typename Body>
void for_each_segment(const TensorView& cu_seqlens, Body&& body) {
  const int32_t* cu = cu_seqlens.ptr<int32_t>();
  const int64_t segments = cu_seqlens.numel() - 1;
  for (int64_t s = 0; s < segments; ++s)
    body(static_cast<int64_t>(cu[s]), static_cast<int64_t>(cu[s + 1]), SegmentEdges{s == 0, s == segments - 1});
}

// body(rows, h, start, edges) for every head of every segment, segments in order and heads in order
// within each, with that head's rows of the segment loaded (KdaArgs or KdaBackwardArgs).
template <typename T, typename Args, typename Body>
void for_each_head(const Args& args, const KdaDims& d, Body&& body) {
  for_each_segment(args.cu_seqlens, [&](int64_t start, int64_t end, SegmentEdges edges) {
    for (int64_t h = 0; h < d.heads; ++h)
      body(load_rows<T>(args.q, args.k, args.v, args.g, args.beta, args.scale, d, h, start, end - start), h, start,
           edges);
  });
}

// The optional states of KdaArgs, [heads, kd, vd]: head h's block, or null when not given.
template <typename T>
T* state_block(const TensorView& state, const KdaDims& d, int64_t h) {
  return state.data == nullptr ? nullptr : state.ptr<std::remove_const_t<T>>() + h * d.kd * d.vd;
}

// The state a segment starts from: `initial` on the first segment when given, else zero.
template <typename T>
std::vector<T> entering_state(const TensorView& initial, const KdaDims& d, int64_t h, const SegmentEdges& edges) {
  const T* block = edges.first ? state_block<const T>(initial, d, h) : nullptr;
  return block == nullptr ? std::vector<T>(d.kd * d.vd, T(0)) : std::vector<T>(block, block + d.kd * d.vd);
}

// Writes a segment's edge state (its final state, or its entering state's gradient) into the
// optional output when the segment is the one it belongs to.
template <typename T>
void store_state(const std::vector<T>& s, const TensorView& out, const KdaDims& d, int64_t h, bool belongs) {
  T* block = belongs ? state_block<T>(out, d, h) : nullptr;
  if (block != nullptr) std::copy(s.begin(), s.end(), block);
}

// An optional state output is overwritten whole, even when no segment writes it (no segments).
template <typename T>
void clear_state(const TensorView& out) {
  if (out.data != nullptr) std::fill(out.ptr<T>(), out.ptr<T>() + out.numel(), T(0));
}

// Gradient outputs of one head's rows, written back to the [tokens, heads, ...] tensors.
template <typename T>
struct HeadGrads {
  std::vector<T> dq, dk, dv, dg, dbeta;
  HeadGrads(int64_t n, const KdaDims& d) : dq(n * d.kd), dk(n * d.kd), dv(n * d.vd), dg(n * d.kd), dbeta(n) {}
};

template <typename T>
void store_grads(const HeadGrads<T>& gr, const KdaBackwardArgs& args, double scale, const KdaDims& d, int64_t h,
                 int64_t start, int64_t n) {
  T *dq = args.dq.ptr<T>(), *dk = args.dk.ptr<T>(), *dv = args.dv.ptr<T>(), *dg = args.dg.ptr<T>();
  T* dbeta = args.dbeta.ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = (start + i) * d.heads + h;
    for (int64_t c = 0; c < d.kd; ++c) {
      dq[row * d.kd + c] = static_cast<T>(scale) * gr.dq[i * d.kd + c];  // gr.dq is d(scaled q)
      dk[row * d.kd + c] = gr.dk[i * d.kd + c];
      dg[row * d.kd + c] = gr.dg[i * d.kd + c];
    }
    for (int64_t c = 0; c < d.vd; ++c) dv[row * d.vd + c] = gr.dv[i * d.vd + c];
    dbeta[row] = gr.dbeta[i];
  }
}

template <typename T>
const T* row_of(const std::vector<T>& m, int64_t i, int64_t width) {
  return m.data() + i * width;
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ---------------------------------------------------------------------------------------------
// Recurrent form

// states[t] = the state before token t's decay (t = 0..n-1), from s (the entering state), which
// ends as the state after the last token.
template <typename T>
std::vector<std::vector<T>> recurrent_states(const HeadRows<T>& r, const KdaDims& d, std::vector<T>& s,
                                             std::vector<T>* outputs) {
  std::vector<std::vector<T>> states;
  std::vector<T> delta(d.vd);
  for (int64_t t = 0; t < r.n; ++t) {
    states.push_back(s);
    const T* k = row_of(r.k, t, d.kd);
    for (int64_t a = 0; a < d.kd; ++a) {
      const T decay = std::exp(r.g[t * d.kd + a]);
      for (int64_t b = 0; b < d.vd; ++b) s[a * d.vd + b] *= decay;
    }
    for (int64_t b = 0; b < d.vd; ++b) {
      T p = 0;
      for (int64_t a = 0; a < d.kd; ++a) p += s[a * d.vd + b] * k[a];
      delta[b] = r.beta[t] * (r.v[t * d.vd + b] - p);
    }
    for (int64_t a = 0; a < d.kd; ++a)
      for (int64_t b = 0; b < d.vd; ++b) s[a * d.vd + b] += k[a] * delta[b];
    if (outputs != nullptr) {
      const T* q = row_of(r.q, t, d.kd);
      for (int64_t b = 0; b < d.vd; ++b) {
        T o = 0;
        for (int64_t a = 0; a < d.kd; ++a) o += s[a * d.vd + b] * q[a];
        (*outputs)[t * d.vd + b] = o;
      }
    }
  }
  return states;
}

// ---------------------------------------------------------------------------------------------
// Chunked form

// The intra-chunk quantities of one chunk: everything that does not depend on the state.
template <typename T>
struct Chunk {
  const HeadRows<T>* r = nullptr;
  int64_t first = 0;  // the chunk's first row in r
  int64_t n = 0;
  std::vector<T> gc;    // [n, kd] cumulative log decay G
  std::vector<T> p;     // [n, n] P[i, j] = sum_d k_i k_j exp(G_i - G_j), j < i  (A = Diag(beta) P)
  std::vector<T> tinv;  // [n, n] T = (I + A)^-1
  std::vector<T> u;     // [n, vd]
  std::vector<T> w;     // [n, kd]
  std::vector<T> m;     // [n, n] M[i, j], j <= i

  const T* q(int64_t i, const KdaDims& d) const { return r->q.data() + (first + i) * d.kd; }
  const T* k(int64_t i, const KdaDims& d) const { return r->k.data() + (first + i) * d.kd; }
  const T* v(int64_t i, const KdaDims& d) const { return r->v.data() + (first + i) * d.vd; }
  T beta(int64_t i) const { return r->beta[first + i]; }
};

// sum_c a[c] b[c] exp(G_i[c] - G_j[c]) for j <= i.
template <typename T>
T decayed_dot(const T* a, const T* b, const T* gi, const T* gj, int64_t kd) {
  T s = 0;
  for (int64_t c = 0; c < kd; ++c) s += a[c] * b[c] * std::exp(gi[c] - gj[c]);
  return s;
}

template <typename T>
Chunk<T> make_chunk(const HeadRows<T>& r, const KdaDims& d, int64_t first, int64_t n) {
  Chunk<T> ch;
  ch.r = &r;
  ch.first = first;
  ch.n = n;
  const int64_t kd = d.kd, vd = d.vd;
  ch.gc.resize(n * kd);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < kd; ++c)
      ch.gc[i * kd + c] = (i > 0 ? ch.gc[(i - 1) * kd + c] : T(0)) + r.g[(first + i) * kd + c];
  auto gc = [&](int64_t i) { return ch.gc.data() + i * kd; };

  ch.p.assign(n * n, T(0));
  ch.m.assign(n * n, T(0));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      if (j < i) ch.p[i * n + j] = decayed_dot(ch.k(i, d), ch.k(j, d), gc(i), gc(j), kd);
      ch.m[i * n + j] = decayed_dot(ch.q(i, d), ch.k(j, d), gc(i), gc(j), kd);
    }
  }
  // Forward substitution, row by row: T[i, j] = -sum_{j <= l < i} A[i, l] T[l, j], T[i, i] = 1.
  ch.tinv.assign(n * n, T(0));
  for (int64_t i = 0; i < n; ++i) {
    ch.tinv[i * n + i] = T(1);
    for (int64_t j = 0; j < i; ++j) {
      T s = 0;
      for (int64_t l = j; l < i; ++l) s += ch.beta(i) * ch.p[i * n + l] * ch.tinv[l * n + j];
      ch.tinv[i * n + j] = -s;
    }
  }
  ch.u.assign(n * vd, T(0));
  ch.w.assign(n * kd, T(0));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      const T t = ch.tinv[i * n + j] * ch.beta(j);
      for (int64_t c = 0; c < vd; ++c) ch.u[i * vd + c] += t * ch.v(j, d)[c];
      for (int64_t c = 0; c < kd; ++c) ch.w[i * kd + c] += t * ch.k(j, d)[c] * std::exp(gc(j)[c]);
    }
  }
  return ch;
}

// v_new = u - w S  [n, vd].
template <typename T>
std::vector<T> corrected_values(const Chunk<T>& ch, const KdaDims& d, const std::vector<T>& s) {
  std::vector<T> v_new(ch.u);
  for (int64_t i = 0; i < ch.n; ++i)
    for (int64_t a = 0; a < d.kd; ++a) {
      const T wa = ch.w[i * d.kd + a];
      for (int64_t b = 0; b < d.vd; ++b) v_new[i * d.vd + b] -= wa * s[a * d.vd + b];
    }
  return v_new;
}

// Writes the chunk's outputs (when `out` is given, rows [n, vd]) and advances the state s.
template <typename T>
void chunk_forward(const Chunk<T>& ch, const KdaDims& d, std::vector<T>& s, T* out) {
  const int64_t n = ch.n, kd = d.kd, vd = d.vd;
  const std::vector<T> v_new = corrected_values(ch, d, s);
  if (out != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      T* o = out + i * vd;
      std::fill(o, o + vd, T(0));
      const T* q = ch.q(i, d);
      for (int64_t a = 0; a < kd; ++a) {
        const T qa = q[a] * std::exp(ch.gc[i * kd + a]);
        for (int64_t b = 0; b < vd; ++b) o[b] += qa * s[a * vd + b];
      }
      for (int64_t j = 0; j <= i; ++j) {
        const T mij = ch.m[i * n + j];
        for (int64_t b = 0; b < vd; ++b) o[b] += mij * v_new[j * vd + b];
      }
    }
  }
  const T* g_last = ch.gc.data() + (n - 1) * kd;
  for (int64_t a = 0; a < kd; ++a) {
    const T decay = std::exp(g_last[a]);
    for (int64_t b = 0; b < vd; ++b) s[a * vd + b] *= decay;
    for (int64_t j = 0; j < n; ++j) {
      const T kj = ch.k(j, d)[a] * std::exp(g_last[a] - ch.gc[j * kd + a]);
      for (int64_t b = 0; b < vd; ++b) s[a * vd + b] += kj * v_new[j * vd + b];
    }
  }
}

// The gradients of one chunk's backward, in stages (the formulas are at the top of the file).
// dq, dk, dbeta point at the chunk's rows of the head's gradients and are summed into; dgc is the
// gradient of the cumulative decay G, turned into dg at the end.
template <typename T>
struct ChunkBackward {
  const Chunk<T>& ch;
  const KdaDims& d;
  const std::vector<T>& s0;  // the state entering the chunk
  const T* dout;             // the chunk's output gradients [n, vd]
  std::vector<T> v_new;      // u - w S0
  std::vector<T> dv_new;     // [n, vd]
  std::vector<T> dgc;        // [n, kd]
  T* dq;
  T* dk;
  T* dbeta;

  ChunkBackward(const Chunk<T>& chunk, const KdaDims& dims, const std::vector<T>& state, const T* dout_rows,
                HeadGrads<T>& grads)
      : ch(chunk), d(dims), s0(state), dout(dout_rows), v_new(corrected_values(chunk, dims, state)),
        dv_new(chunk.n * dims.vd, T(0)), dgc(chunk.n * dims.kd, T(0)),
        dq(grads.dq.data() + chunk.first * dims.kd), dk(grads.dk.data() + chunk.first * dims.kd),
        dbeta(grads.dbeta.data() + chunk.first) {
    std::fill(dq, dq + ch.n * d.kd, T(0));
    std::fill(dk, dk + ch.n * d.kd, T(0));
    std::fill(dbeta, dbeta + ch.n, T(0));
  }

  T gc(int64_t i, int64_t a) const { return ch.gc[i * d.kd + a]; }

  // S1 = Diag(exp(G_last)) S0 + sum_j K^_j v_new_j^T, K^_j = k_j exp(G_last - G_j).
  void through_state_update(const std::vector<T>& ds) {
    const int64_t n = ch.n, kd = d.kd, vd = d.vd, last = n - 1;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t a = 0; a < kd; ++a) {
        const T e = std::exp(gc(last, a) - gc(j, a));
        const T khat = ch.k(j, d)[a] * e;
        const T* dsa = ds.data() + a * vd;
        T dkhat = 0;  // (dS v_new_j)[a]
        for (int64_t b = 0; b < vd; ++b) {
          dv_new[j * vd + b] += khat * dsa[b];
          dkhat += dsa[b] * v_new[j * vd + b];
        }
        dk[j * kd + a] += dkhat * e;
        dgc[last * kd + a] += dkhat * khat;
        dgc[j * kd + a] -= dkhat * khat;
      }
    }
    for (int64_t a = 0; a < kd; ++a)
      dgc[last * kd + a] += std::exp(gc(last, a)) * dot(ds.data() + a * vd, s0.data() + a * vd, vd);
  }

  // out_i = (q_i exp(G_i)) S0 + sum_{j <= i} M[i, j] v_new_j.
  void through_outputs() {
    const int64_t n = ch.n, kd = d.kd, vd = d.vd;
    for (int64_t i = 0; i < n; ++i) {
      const T* q = ch.q(i, d);
      const T* doi = dout + i * vd;
      for (int64_t a = 0; a < kd; ++a) {
        const T e = std::exp(gc(i, a));
        const T r = dot(doi, s0.data() + a * vd, vd);
        dq[i * kd + a] += r * e;
        dgc[i * kd + a] += q[a] * e * r;
      }
      for (int64_t j = 0; j <= i; ++j) {
        const T dm = dot(doi, v_new.data() + j * vd, vd);
        const T mij = ch.m[i * n + j];
        for (int64_t b = 0; b < vd; ++b) dv_new[j * vd + b] += mij * doi[b];
        const T* k = ch.k(j, d);
        for (int64_t a = 0; a < kd; ++a) {
          const T x = dm * std::exp(gc(i, a) - gc(j, a));
          dq[i * kd + a] += x * k[a];
          dk[j * kd + a] += x * q[a];
          dgc[i * kd + a] += x * q[a] * k[a];
          dgc[j * kd + a] -= x * q[a] * k[a];
        }
      }
    }
  }

  // dS0 = Diag(exp(G_last)) dS + (q exp(G))^T dout - w^T dv_new  (after the two stages above).
  std::vector<T> entering_state_gradient(const std::vector<T>& ds) const {
    const int64_t kd = d.kd, vd = d.vd, last = ch.n - 1;
    std::vector<T> ds0(kd * vd);
    for (int64_t a = 0; a < kd; ++a)
      for (int64_t b = 0; b < vd; ++b) ds0[a * vd + b] = std::exp(gc(last, a)) * ds[a * vd + b];
    for (int64_t i = 0; i < ch.n; ++i) {
      const T* q = ch.q(i, d);
      for (int64_t a = 0; a < kd; ++a) {
        const T qa = q[a] * std::exp(gc(i, a));
        const T wa = ch.w[i * kd + a];
        for (int64_t b = 0; b < vd; ++b) ds0[a * vd + b] += qa * dout[i * vd + b] - wa * dv_new[i * vd + b];
      }
    }
    return ds0;
  }

  // v_new = u - w S0 with u = T b, w = T c (b = beta v, c = beta k exp(G)), T = (I + A)^-1:
  // du = dv_new, dw = -dv_new S0^T, db = T^T du, dc = T^T dw, dA = -(db u^T + dc w^T).
  void through_ut_transform(T* dv) {
    const int64_t n = ch.n, kd = d.kd, vd = d.vd;
    std::vector<T> dw(n * kd);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t a = 0; a < kd; ++a) dw[i * kd + a] = -dot(dv_new.data() + i * vd, s0.data() + a * vd, vd);
    std::vector<T> db(n * vd, T(0)), dc(n * kd, T(0));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = j; i < n; ++i) {
        const T t = ch.tinv[i * n + j];
        for (int64_t b = 0; b < vd; ++b) db[j * vd + b] += t * dv_new[i * vd + b];
        for (int64_t a = 0; a < kd; ++a) dc[j * kd + a] += t * dw[i * kd + a];
      }
    for (int64_t j = 0; j < n; ++j) {
      const T beta = ch.beta(j);
      const T* k = ch.k(j, d);
      for (int64_t b = 0; b < vd; ++b) dv[j * vd + b] = beta * db[j * vd + b];
      dbeta[j] += dot(db.data() + j * vd, ch.v(j, d), vd);
      for (int64_t a = 0; a < kd; ++a) {
        const T e = std::exp(gc(j, a));
        dbeta[j] += dc[j * kd + a] * k[a] * e;
        dk[j * kd + a] += beta * dc[j * kd + a] * e;
        dgc[j * kd + a] += dc[j * kd + a] * beta * k[a] * e;
      }
    }
    // A[i, j] = beta_i P[i, j] for j < i.
    for (int64_t i = 0; i < n; ++i) {
      const T* ki = ch.k(i, d);
      for (int64_t j = 0; j < i; ++j) {
        const T da = -(dot(db.data() + i * vd, ch.u.data() + j * vd, vd) +
                       dot(dc.data() + i * kd, ch.w.data() + j * kd, kd));
        dbeta[i] += da * ch.p[i * n + j];
        const T* kj = ch.k(j, d);
        for (int64_t a = 0; a < kd; ++a) {
          const T x = da * ch.beta(i) * std::exp(gc(i, a) - gc(j, a));
          dk[i * kd + a] += x * kj[a];
          dk[j * kd + a] += x * ki[a];
          dgc[i * kd + a] += x * ki[a] * kj[a];
          dgc[j * kd + a] -= x * ki[a] * kj[a];
        }
      }
    }
  }

  // G_i = sum_{j <= i} g_j: dg_j = sum_{i >= j} dG_i.
  void cumulative_decay_to_dg(T* dg) const {
    for (int64_t a = 0; a < d.kd; ++a) {
      T s = 0;
      for (int64_t i = ch.n - 1; i >= 0; --i) {
        s += dgc[i * d.kd + a];
        dg[i * d.kd + a] = s;
      }
    }
  }
};

// The chunk's input gradients (its rows of `grads`, overwritten) from dout (its rows [n, vd]) and
// ds, the gradient of the state leaving it; ds becomes that of the state s0 entering it.
template <typename T>
void chunk_backward(const Chunk<T>& ch, const KdaDims& d, const std::vector<T>& s0, const T* dout,
                    std::vector<T>& ds, HeadGrads<T>& grads) {
  ChunkBackward<T> b(ch, d, s0, dout, grads);
  b.through_state_update(ds);
  b.through_outputs();
  std::vector<T> ds0 = b.entering_state_gradient(ds);
  b.through_ut_transform(grads.dv.data() + ch.first * d.vd);
  b.cumulative_decay_to_dg(grads.dg.data() + ch.first * d.kd);
  ds.swap(ds0);
}

// Row offsets of the chunks of a segment of `length` tokens.
std::vector<int64_t> chunk_starts(int64_t length, int64_t chunk) {
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < length; s += chunk) starts.push_back(s);
  return starts;
}

}  // namespace

template <typename T>
void kda_recurrent_forward(const KdaArgs& args) {
  const KdaDims d = kda_dims(args.q, args.v);
  T* out = args.out.ptr<T>();
  clear_state<T>(args.final_state);
  for_each_head<T>(args, d, [&](const HeadRows<T>& r, int64_t h, int64_t start, SegmentEdges edges) {
    std::vector<T> o(r.n * d.vd), s = entering_state<T>(args.initial_state, d, h, edges);
    recurrent_states(r, d, s, &o);
    store_state(s, args.final_state, d, h, edges.last);
    for (int64_t t = 0; t < r.n; ++t)
      std::copy(o.begin() + t * d.vd, o.begin() + (t + 1) * d.vd, out + ((start + t) * d.heads + h) * d.vd);
  });
}

template <typename T>
void kda_recurrent_backward(const KdaBackwardArgs& args) {
  const KdaDims d = kda_dims(args.q, args.v);
  const int64_t kd = d.kd, vd = d.vd;
  const T* dout = args.dout.ptr<T>();
  clear_state<T>(args.dinitial_state);
  for_each_head<T>(args, d, [&](const HeadRows<T>& r, int64_t h, int64_t start, SegmentEdges edges) {
    std::vector<T> s = entering_state<T>(args.initial_state, d, h, edges);
    const std::vector<std::vector<T>> states = recurrent_states<T>(r, d, s, nullptr);
    HeadGrads<T> gr(r.n, d);
    // The final state's gradient: what arrives from beyond the call on the last segment, else 0.
    std::vector<T> ds = entering_state<T>(args.dfinal_state, d, h, SegmentEdges{edges.last, edges.last});
    std::vector<T> dec(kd * vd), p(vd), delta(vd), dp(vd), s1(kd * vd);
    for (int64_t t = r.n - 1; t >= 0; --t) {
      // Recompute the step: D = Diag(exp(g)) S_prev, p = D^T k, delta = beta (v - p), S = D + k delta^T.
      const T* k = row_of(r.k, t, kd);
      const T* q = row_of(r.q, t, kd);
      const T* v = row_of(r.v, t, vd);
      const T* g = row_of(r.g, t, kd);
      const T beta = r.beta[t];
      const T* doi = dout + ((start + t) * d.heads + h) * vd;
      for (int64_t a = 0; a < kd; ++a)
        for (int64_t b = 0; b < vd; ++b) dec[a * vd + b] = std::exp(g[a]) * states[t][a * vd + b];
      for (int64_t b = 0; b < vd; ++b) {
        p[b] = 0;
        for (int64_t a = 0; a < kd; ++a) p[b] += dec[a * vd + b] * k[a];
        delta[b] = beta * (v[b] - p[b]);
      }
      for (int64_t a = 0; a < kd; ++a)
        for (int64_t b = 0; b < vd; ++b) s1[a * vd + b] = dec[a * vd + b] + k[a] * delta[b];
      // out = S^T q: dS += q dout^T, dq = S dout.
      for (int64_t a = 0; a < kd; ++a) {
        gr.dq[t * kd + a] = dot(s1.data() + a * vd, doi, vd);
        for (int64_t b = 0; b < vd; ++b) ds[a * vd + b] += q[a] * doi[b];
      }
      // S = D + k delta^T: dk = dS delta, ddelta = dS^T k; delta = beta (v - p).
      T dbeta = 0;
      for (int64_t b = 0; b < vd; ++b) {
        T ddelta = 0;
        for (int64_t a = 0; a < kd; ++a) ddelta += ds[a * vd + b] * k[a];
        dbeta += ddelta * (v[b] - p[b]);
        gr.dv[t * vd + b] = beta * ddelta;
        dp[b] = -beta * ddelta;
      }
      gr.dbeta[t] = dbeta;
      // p = D^T k: dD = dS + k dp^T, dk += D dp; D = Diag(exp(g)) S_prev.
      for (int64_t a = 0; a < kd; ++a) {
        gr.dk[t * kd + a] = dot(ds.data() + a * vd, delta.data(), vd) + dot(dec.data() + a * vd, dp.data(), vd);
        T dga = 0;
        const T e = std::exp(g[a]);
        for (int64_t b = 0; b < vd; ++b) {
          const T ddab = ds[a * vd + b] + k[a] * dp[b];
          dga += ddab * dec[a * vd + b];
          ds[a * vd + b] = e * ddab;
        }
        gr.dg[t * kd + a] = dga;
      }
    }
    store_state(ds, args.dinitial_state, d, h, edges.first);
    store_grads(gr, args, args.scale, d, h, start, r.n);
  });
}

template <typename T>
void kda_chunked_forward(const KdaArgs& args, int64_t chunk) {
  const KdaDims d = kda_dims(args.q, args.v);
  T* out = args.out.ptr<T>();
  clear_state<T>(args.final_state);
  for_each_head<T>(args, d, [&](const HeadRows<T>& r, int64_t h, int64_t start, SegmentEdges edges) {
    std::vector<T> s = entering_state<T>(args.initial_state, d, h, edges), o;
    for (int64_t first : chunk_starts(r.n, chunk)) {
      const Chunk<T> ch = make_chunk(r, d, first, std::min(chunk, r.n - first));
      o.resize(ch.n * d.vd);
      chunk_forward(ch, d, s, o.data());
      for (int64_t i = 0; i < ch.n; ++i)
        std::copy(o.begin() + i * d.vd, o.begin() + (i + 1) * d.vd,
                  out + ((start + first + i) * d.heads + h) * d.vd);
    }
    store_state(s, args.final_state, d, h, edges.last);
  });
}

template <typename T>
void kda_chunked_backward(const KdaBackwardArgs& args, int64_t chunk) {
  const KdaDims d = kda_dims(args.q, args.v);
  const T* dout = args.dout.ptr<T>();
  clear_state<T>(args.dinitial_state);
  for_each_head<T>(args, d, [&](const HeadRows<T>& r, int64_t h, int64_t start, SegmentEdges edges) {
    const std::vector<int64_t> firsts = chunk_starts(r.n, chunk);
    // Forward sweep: the state entering each chunk.
    std::vector<std::vector<T>> entering;
    std::vector<T> s = entering_state<T>(args.initial_state, d, h, edges);
    for (int64_t first : firsts) {
      entering.push_back(s);
      chunk_forward(make_chunk(r, d, first, std::min(chunk, r.n - first)), d, s, static_cast<T*>(nullptr));
    }
    // Reverse sweep, from the final state's gradient: what arrives from beyond the call on the
    // last segment, else zero (the final state is no output).
    HeadGrads<T> gr(r.n, d);
    std::vector<T> ds = entering_state<T>(args.dfinal_state, d, h, SegmentEdges{edges.last, edges.last}), dout_rows;
    for (int64_t c = static_cast<int64_t>(firsts.size()) - 1; c >= 0; --c) {
      const Chunk<T> ch = make_chunk(r, d, firsts[c], std::min(chunk, r.n - firsts[c]));
      dout_rows.resize(ch.n * d.vd);
      for (int64_t i = 0; i < ch.n; ++i) {
        const T* src = dout + ((start + ch.first + i) * d.heads + h) * d.vd;
        std::copy(src, src + d.vd, dout_rows.begin() + i * d.vd);
      }
      chunk_backward(ch, d, entering[c], dout_rows.data(), ds, gr);
    }
    store_state(ds, args.dinitial_state, d, h, edges.first);
    store_grads(gr, args, args.scale, d, h, start, r.n);
  });
}

// The backend's KDA is the chunked form, which the GPU kernels compute too (the recurrent one is
// the tests' oracle).
template <typename T>
void kda_forward(const KdaArgs& args) {
  kda_chunked_forward<T>(args);
}

template <typename T>
void kda_backward(const KdaBackwardArgs& args) {
  kda_chunked_backward<T>(args);
}

MOETRAIN_CPU_INSTANTIATE(kda_forward, const KdaArgs&)
MOETRAIN_CPU_INSTANTIATE(kda_backward, const KdaBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(kda_recurrent_forward, const KdaArgs&)
MOETRAIN_CPU_INSTANTIATE(kda_recurrent_backward, const KdaBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(kda_chunked_forward, const KdaArgs&, int64_t)
MOETRAIN_CPU_INSTANTIATE(kda_chunked_backward, const KdaBackwardArgs&, int64_t)

}  // namespace moetrain::kernels::cpu
