// The chunk-local part of the KDA forward: everything that needs no state, one CTA (8 warps) per
// (chunk, head), all intermediates in shared memory (the backward's call also writes P, M and
// k exp(G), which its gradient kernels read instead of recomputing). With G the cumulative log decay inside the
// chunk (log2 units in shared memory) and Ga = G - G_a:
//   P[i, j]   = sum_d k_i k_j exp(G_i - G_j)           (j < i)       A = diag(beta) P
//   Aqk[i, j] = scale sum_d q_i k_j exp(G_i - G_j)     (j <= i)
//   M = (I + A)^-1,  w = M diag(beta) (k exp(G)),  u = M diag(beta) v,
//   qg = scale q exp(G),  kt = k exp(G_last - G),  decay = exp(G_last)
// which the state sweep (kda_state.cu) consumes: v_new = u - w S, out = qg S + Aqk v_new,
// S' = diag(decay) S + kt^T v_new.
//
// No exponent is ever positive, so nothing overflows however strong the decay:
//   - pairs in one 16-token sub-chunk: exp(G_i - G_j) = prod_{t = j+1..i} exp(g_t), one multiply
//     per step by the per-token decay (exact up to rounding, no exp per pair);
//   - pairs in different sub-chunks: exp(G_i - G_r) exp(G_r - G_j) with r the last row before
//     the row block (both factors <= 1), as a BF16 tensor-core product over d;
//   - the inverse in F32: the 16 x 16 diagonal blocks by forward substitution, then the blocks
//     below them, M_ij = -M_ii sum_{k = j..i-1} A_ik M_kj.
#include <cuda_bf16.h>

#include "kernels/cuda/kda/kda_common.cuh"

namespace moetrain::kernels::cuda_ops::kda {
namespace {

constexpr int kIntraThreads = 256;

template <int kDk, int kDv>
struct IntraSmem {
  static constexpr int kKStride = kDk + kPad;      // k, q, kg (BF16)
  static constexpr int kVStride = kDv + kPad;      // v (BF16)
  static constexpr int kGStride = kDk + kPadF;     // G, per-token decay (F32)
  static constexpr int kAStride = kChunk + kPadF;  // P, Aqk, M (F32)
  static constexpr int kTStride = kChunk + kPad;   // M diag(beta) (BF16)
  static constexpr size_t kKBytes = sizeof(bf16) * kChunk * kKStride;
  static constexpr size_t kVBytes = sizeof(bf16) * kChunk * kVStride;
  static constexpr size_t kGBytes = sizeof(float) * kChunk * kGStride;
  static constexpr size_t kABytes = sizeof(float) * kChunk * kAStride;
  static constexpr size_t kTBytes = sizeof(bf16) * kChunk * kTStride;
  static constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }
  // Regions: the per-token decay dies after the diagonal pairs (then M and M diag(beta) live
  // there); Aqk dies once written out (then k exp(G) lives there).
  static constexpr size_t kK = 0;
  static constexpr size_t kQ = kK + kKBytes;
  static constexpr size_t kV = kQ + kKBytes;
  static constexpr size_t kG = kV + kVBytes;
  static constexpr size_t kDecay = kG + kGBytes;  // then M (F32) and T (BF16)
  static constexpr size_t kP = kDecay + cmax(kGBytes, kABytes + kTBytes);
  static constexpr size_t kAqk = kP + kABytes;  // then kg
  static constexpr size_t kBeta = kAqk + cmax(kABytes, kKBytes);
  static constexpr size_t kBytes = kBeta + sizeof(float) * kChunk;
  static_assert(kBytes <= kMaxSmemBytes, "fits one CTA");
};

// Per-thread eight consecutive BF16 of a shared row as floats.
__device__ __forceinline__ void load8(float (&v)[8], const bf16* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = unpack_bf16x2(words[e]);
    v[2 * e] = f.x;
    v[2 * e + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  raw.x = pack_bf16x2(v[0], v[1]);
  raw.y = pack_bf16x2(v[2], v[3]);
  raw.z = pack_bf16x2(v[4], v[5]);
  raw.w = pack_bf16x2(v[6], v[7]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void load8f(float (&v)[8], const float* p) {
  const float4 lo = *reinterpret_cast<const float4*>(p);
  const float4 hi = *reinterpret_cast<const float4*>(p + 4);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

template <int kDk, int kDv, bool kForBackward>
__global__ void __launch_bounds__(kIntraThreads, 1) kda_intra_forward_sm80_bf16_kernel(KdaParams p) {
  using Smem = IntraSmem<kDk, kDv>;
  static_assert(kDk % 32 == 0 && kDv % 16 == 0 && kDk <= 128 && kDv <= 128, "head dims");
  constexpr int kKS = Smem::kKStride, kVS = Smem::kVStride, kGS = Smem::kGStride, kAS = Smem::kAStride,
                kTS = Smem::kTStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* k_st = reinterpret_cast<bf16*>(smem + Smem::kK);
  bf16* q_st = reinterpret_cast<bf16*>(smem + Smem::kQ);
  bf16* v_st = reinterpret_cast<bf16*>(smem + Smem::kV);
  float* g_st = reinterpret_cast<float*>(smem + Smem::kG);        // G, log2 units
  float* decay_st = reinterpret_cast<float*>(smem + Smem::kDecay);  // exp(g) per token
  float* m_st = reinterpret_cast<float*>(smem + Smem::kDecay);      // M, after the diagonal pairs
  bf16* t_st = reinterpret_cast<bf16*>(smem + Smem::kDecay + Smem::kABytes);  // M diag(beta)
  float* p_st = reinterpret_cast<float*>(smem + Smem::kP);
  float* aqk_st = reinterpret_cast<float*>(smem + Smem::kAqk);
  bf16* kg_st = reinterpret_cast<bf16*>(smem + Smem::kAqk);  // k exp(G), after Aqk is written out
  float* beta_st = reinterpret_cast<float*>(smem + Smem::kBeta);

  const int chunk = blockIdx.x, head = blockIdx.y;
  ChunkSpan span;
  if (!find_chunk(p, chunk, span)) return;  // the same for the whole CTA
  const int t0 = span.begin, len = span.len, last = len - 1;
  const int heads = p.heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int64_t row0 = static_cast<int64_t>(t0) * heads + head;  // (token t0, head) row index

  load_tile_async<bf16, kDk>(k_st, kKS, p.k + row0 * kDk, static_cast<int64_t>(heads) * kDk, len);
  load_tile_async<bf16, kDk>(q_st, kKS, p.q + row0 * kDk, static_cast<int64_t>(heads) * kDk, len);
  load_tile_async<bf16, kDv>(v_st, kVS, p.v + row0 * kDv, static_cast<int64_t>(heads) * kDv, len);
  load_tile_async<float, kDk>(g_st, kGS, p.g + row0 * kDk, static_cast<int64_t>(heads) * kDk, len);
  cp_async_commit();
  for (int i = tid; i < kChunk * kAS; i += kIntraThreads) p_st[i] = aqk_st[i] = 0.0f;
  if (tid < kChunk) beta_st[tid] = tid < len ? p.beta[row0 + static_cast<int64_t>(tid) * heads] : 0.0f;
  cp_async_wait<0>();
  __syncthreads();
  if (tid < kDk) {
    // Column tid: g becomes its running sum G in place (rows past the chunk hold 0, so G stays
    // at G_last there) and the per-token decay exp(g).
    float sum = 0.0f;
#pragma unroll 8
    for (int r = 0; r < kChunk; ++r) {
      const float gv = g_st[r * kGS + tid];
      sum += gv;
      g_st[r * kGS + tid] = sum * kLog2e;
      decay_st[r * kGS + tid] = exp2f(gv * kLog2e);
    }
  }
  __syncthreads();

  // ---- Pairs inside a sub-chunk, exactly. Thread: row r = 16 b + i, a quarter of the d axis
  // (interleaved 8-column groups, so the four quarters read one contiguous 64-byte span).
  {
    const int b = tid >> 6, i = (tid >> 2) & 15, part = tid & 3;
    const int r = b * kSub + i;
    float pkk[kSub], pqk[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) pkk[j] = pqk[j] = 0.0f;
#pragma unroll 1
    for (int group = 0; group < kDk / 32; ++group) {
      const int d0 = (group * 4 + part) * 8;
      float kr[8], qr[8], e[8];
      load8(kr, k_st + r * kKS + d0);
      load8(qr, q_st + r * kKS + d0);
#pragma unroll
      for (int x = 0; x < 8; ++x) e[x] = 0.0f;
      // j from i down: e = exp(G_r - G_s) = e(s + 1) * exp(g_{s+1}); it starts at 1 when j == i
      // and is 0 before (j > i), so every row runs the same loop.
#pragma unroll
      for (int j = kSub - 1; j >= 0; --j) {
        const int s = b * kSub + j;
        float dec[8], ks[8];
        load8f(dec, decay_st + min(s + 1, kChunk - 1) * kGS + d0);  // multiplies e = 0 when j == 15
        load8(ks, k_st + s * kKS + d0);
        const float start = j == i ? 1.0f : 0.0f;
        float skk = 0.0f, sqk = 0.0f;
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          e[x] = fmaf(e[x], dec[x], start);
          const float ke = ks[x] * e[x];
          skk = fmaf(kr[x], ke, skk);
          sqk = fmaf(qr[x], ke, sqk);
        }
        pkk[j] += skk;
        pqk[j] += sqk;
      }
    }
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      pkk[j] += __shfl_xor_sync(0xffffffffu, pkk[j], 1);
      pkk[j] += __shfl_xor_sync(0xffffffffu, pkk[j], 2);
      pqk[j] += __shfl_xor_sync(0xffffffffu, pqk[j], 1);
      pqk[j] += __shfl_xor_sync(0xffffffffu, pqk[j], 2);
    }
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if ((j & 3) != part) continue;
      if (j < i) p_st[r * kAS + b * kSub + j] = pkk[j];
      if (j <= i) aqk_st[r * kAS + b * kSub + j] = p.scale * pqk[j];
    }
  }

  // ---- Pairs in different sub-chunks: warp w < 6 takes block (bi, ci), bi > ci, on tensor cores
  // with the factors split at row ref = 16 bi - 1.
  if (warp < 6) {
    const int bi = warp < 1 ? 1 : (warp < 3 ? 2 : 3);
    const int ci = warp - bi * (bi - 1) / 2;
    const int ref = bi * kSub - 1;
    float akk[2][4], aqk[2][4];
    zero_tiles(akk);
    zero_tiles(aqk);
#pragma unroll
    for (int kk = 0; kk < kDk / 16; ++kk) {
      uint32_t fk[4], fq[4];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const int row = bi * kSub + g + 8 * rh, d = 16 * kk + 2 * c + 8 * half;
          const float2 gr = *reinterpret_cast<const float2*>(g_st + row * kGS + d);
          const float2 gf = *reinterpret_cast<const float2*>(g_st + ref * kGS + d);
          const float f0 = exp2f(gr.x - gf.x), f1 = exp2f(gr.y - gf.y);
          const float2 kv = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(k_st + row * kKS + d));
          const float2 qv = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(q_st + row * kKS + d));
          fk[rh + 2 * half] = pack_bf16x2(kv.x * f0, kv.y * f1);
          fq[rh + 2 * half] = pack_bf16x2(qv.x * f0, qv.y * f1);
        }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int s = ci * kSub + 8 * nt + g;
        uint32_t fb[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = 16 * kk + 2 * c + 8 * half;
          const float2 gs = *reinterpret_cast<const float2*>(g_st + s * kGS + d);
          const float2 gf = *reinterpret_cast<const float2*>(g_st + ref * kGS + d);
          const float2 kv = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(k_st + s * kKS + d));
          fb[half] = pack_bf16x2(kv.x * exp2f(gf.x - gs.x), kv.y * exp2f(gf.y - gs.y));
        }
        mma_m16n8k16_bf16_ordered(akk[nt], fk, fb[0], fb[1]);
        mma_m16n8k16_bf16_ordered(aqk[nt], fq, fb[0], fb[1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = bi * kSub + g + 8 * (e >> 1), col = ci * kSub + 8 * nt + 2 * c + (e & 1);
        p_st[row * kAS + col] = akk[nt][e];
        aqk_st[row * kAS + col] = p.scale * aqk[nt][e];
      }
  }
  __syncthreads();

  // ---- Aqk (and P) out, before their space is reused.
  for (int i = tid; i < len * (kChunk / 2); i += kIntraThreads) {
    const int r = i / (kChunk / 2), col = 2 * (i % (kChunk / 2));
    store_bf16x2(p.aqk + (row0 + static_cast<int64_t>(r) * heads) * kChunk + col, aqk_st[r * kAS + col],
                 aqk_st[r * kAS + col + 1]);
    if constexpr (kForBackward) {
      *reinterpret_cast<float2*>(p.pkk + (row0 + static_cast<int64_t>(r) * heads) * kChunk + col) =
          make_float2(p_st[r * kAS + col], p_st[r * kAS + col + 1]);
    }
  }

  // ---- M = (I + diag(beta) P)^-1. Diagonal blocks: thread (b, j) solves column j of block b
  // in registers; it also zeroes the blocks above it in that column.
  if (tid < kChunk) {
    const int b = tid >> 4, j = tid & 15;
    float x[kSub];
#pragma unroll
    for (int r = 0; r < kSub; ++r) {
      const int row = b * kSub + r;
      const float nb = -beta_st[row];
      float acc = r == j ? 1.0f : 0.0f;
#pragma unroll
      for (int s = 0; s < r; ++s) acc = fmaf(nb * p_st[row * kAS + b * kSub + s], x[s], acc);
      x[r] = acc;
    }
#pragma unroll
    for (int r = 0; r < kSub; ++r) m_st[(b * kSub + r) * kAS + b * kSub + j] = x[r];
    for (int r = 0; r < b * kSub; ++r) m_st[r * kAS + b * kSub + j] = 0.0f;
  }
  __syncthreads();
  // Blocks below the diagonal, one diagonal distance at a time: X = sum_k A_ik M_kj is parked in
  // block (i, j) itself (nothing else reads it at this distance), then M_ij = -M_ii X.
#pragma unroll 1
  for (int level = 1; level < kSubs; ++level) {
    const int blocks = kSubs - level;
    float held[kSubs - 1];
#pragma unroll
    for (int n = 0; n < kSubs - 1; ++n) {
      const int e = tid + n * kIntraThreads;
      if (e >= blocks * kSub * kSub) break;
      const int jb = e >> 8, rr = (e >> 4) & 15, cc = e & 15, ib = jb + level;
      const int row = ib * kSub + rr;
      float acc = 0.0f;
      for (int kb = jb; kb < ib; ++kb)
#pragma unroll
        for (int s = 0; s < kSub; ++s)
          acc = fmaf(p_st[row * kAS + kb * kSub + s], m_st[(kb * kSub + s) * kAS + jb * kSub + cc], acc);
      m_st[row * kAS + jb * kSub + cc] = beta_st[row] * acc;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kSubs - 1; ++n) {
      const int e = tid + n * kIntraThreads;
      if (e >= blocks * kSub * kSub) break;
      const int jb = e >> 8, rr = (e >> 4) & 15, cc = e & 15, ib = jb + level;
      float acc = 0.0f;
#pragma unroll
      for (int s = 0; s < kSub; ++s)
        acc = fmaf(m_st[(ib * kSub + rr) * kAS + ib * kSub + s], m_st[(ib * kSub + s) * kAS + jb * kSub + cc], acc);
      held[n] = -acc;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kSubs - 1; ++n) {
      const int e = tid + n * kIntraThreads;
      if (e >= blocks * kSub * kSub) break;
      const int jb = e >> 8, rr = (e >> 4) & 15, cc = e & 15, ib = jb + level;
      m_st[(ib * kSub + rr) * kAS + jb * kSub + cc] = held[n];
    }
    __syncthreads();
  }

  // ---- T = M diag(beta) in BF16 for the products; M itself out for the backward.
  for (int i = tid; i < kChunk * kChunk / 2; i += kIntraThreads) {
    const int r = i / (kChunk / 2), s = 2 * (i % (kChunk / 2));
    const float m0 = m_st[r * kAS + s], m1 = m_st[r * kAS + s + 1];
    store_bf16x2(t_st + r * kTS + s, m0 * beta_st[s], m1 * beta_st[s + 1]);
    if constexpr (kForBackward) {
      if (r < len) store_bf16x2(p.minv + (row0 + static_cast<int64_t>(r) * heads) * kChunk + s, m0, m1);
    }
  }
  // ---- kg = k exp(G) (shared, for w), qg and kt (out), decay = exp(G_last) (out).
  for (int i = tid; i < kChunk * (kDk / 8); i += kIntraThreads) {
    const int r = i / (kDk / 8), d0 = 8 * (i % (kDk / 8));
    float kv[8], qv[8], gr[8], gl[8], kg[8], qg[8], kt[8];
    load8(kv, k_st + r * kKS + d0);
    load8(qv, q_st + r * kKS + d0);
    load8f(gr, g_st + r * kGS + d0);
    load8f(gl, g_st + last * kGS + d0);
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const float eg = exp2f(gr[x]);
      kg[x] = kv[x] * eg;
      qg[x] = p.scale * qv[x] * eg;
      kt[x] = kv[x] * exp2f(gl[x] - gr[x]);
    }
    store8(kg_st + r * kKS + d0, kg);
    if (r < len) {
      const int64_t at = (row0 + static_cast<int64_t>(r) * heads) * kDk + d0;
      store8(p.qg + at, qg);
      store8(p.kt + at, kt);
      if constexpr (kForBackward) store8(p.kg + at, kg);
    }
  }
  if (tid < kDk) p.decay[(static_cast<int64_t>(chunk) * heads + head) * kDk + tid] = exp2f(g_st[last * kGS + tid]);
  __syncthreads();

  // ---- w = T kg, u = T v: warp (row block w % 4, column half w / 4).
  const int mb = warp & 3, nh = warp >> 2;
  {
    constexpr int kTiles = kDk / 16;
    float acc[kTiles][4];
    zero_tiles(acc);
    warp_mma<ALayout::kMK, BLayout::kKN, kChunk / 16, kTiles>(acc, t_st, kTS, 16 * mb, 0, kg_st, kKS,
                                                              nh * (kDk / 2), 0, lane);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mb + g + 8 * h;
        if (r < len)
          store_bf16x2(p.w + (row0 + static_cast<int64_t>(r) * heads) * kDk + nh * (kDk / 2) + 8 * j + 2 * c,
                       acc[j][2 * h], acc[j][2 * h + 1]);
      }
  }
  {
    constexpr int kTiles = kDv / 16;
    float acc[kTiles][4];
    zero_tiles(acc);
    warp_mma<ALayout::kMK, BLayout::kKN, kChunk / 16, kTiles>(acc, t_st, kTS, 16 * mb, 0, v_st, kVS,
                                                              nh * (kDv / 2), 0, lane);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mb + g + 8 * h;
        if (r < len)
          store_bf16x2(p.u + (row0 + static_cast<int64_t>(r) * heads) * kDv + nh * (kDv / 2) + 8 * j + 2 * c,
                       acc[j][2 * h], acc[j][2 * h + 1]);
      }
  }
}

}  // namespace

void launch_kda_intra(const KdaParams& p, int dk, int dv, bool for_backward, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.capacity), static_cast<unsigned>(p.heads));
  dispatch_head_dims(dk, dv, [&](auto k_dim, auto v_dim) {
    constexpr int kDk = decltype(k_dim)::value, kDv = decltype(v_dim)::value;
    const size_t bytes = IntraSmem<kDk, kDv>::kBytes;
    if (for_backward) {
      launch_kda_kernel(kda_intra_forward_sm80_bf16_kernel<kDk, kDv, true>, grid, kIntraThreads, bytes, stream, p);
    } else {
      launch_kda_kernel(kda_intra_forward_sm80_bf16_kernel<kDk, kDv, false>, grid, kIntraThreads, bytes, stream, p);
    }
  });
}

}  // namespace moetrain::kernels::cuda_ops::kda
