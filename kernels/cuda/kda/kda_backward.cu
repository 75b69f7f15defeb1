// The chunk-parallel part of the KDA backward, after the state sweeps (kda_state.cu) have written
// S (entering each chunk), dS (leaving it), v_new and dv_new. Per chunk, with M = (I + A)^-1,
// b = beta v, c = beta k exp(G) (so u = M b, w = M c), P = A without beta:
//
// kda_wy_backward (one CTA per (chunk, head)), through w, u and M:
//   dw = -dv_new S^T,  db = M^T dv_new,  dc = M^T dw
//   dv = beta db,  dkg = beta dc (the gradient of k exp(G), finished by the next kernel),
//   dA = -(db u^T + dc w^T) on the strict lower triangle  (d(I + A)^-1 = -M dA M),
//   dpkk = beta_i dA,  dbeta_i = db_i . v_i + dc_i . (k exp(G))_i + sum_j dA_ij P_ij
//
// kda_intra_backward (one CTA per (chunk, head, half of the key dims): each key dim d is
// independent given the 64 x 64 matrices), through qg, kt, decay, Aqk and P:
//   dAqk = dout v_new^T (j <= i),  dqg = dout S^T,  dkt = v_new dS^T,  ddecay = rowsum(S o dS)
//   dq_i = scale exp(G_i) dqg_i + scale sum_j dAqk_ij k_j exp(G_i - G_j)
//   dk_j = exp(G_j) dkg_j + exp(G_last - G_j) dkt_j + scale sum_i dAqk_ij q_i exp(G_i - G_j)
//          + sum_i dpkk_ij k_i exp(G_i - G_j) + sum_i dpkk_ji k_i exp(G_j - G_i)
//   dG = q o dq + k o (the same k terms with the sign of their exponent's G_j), plus at the last
//        row sum_j k_j o exp(G_last - G_j) dkt_j + exp(G_last) ddecay;
//   dg = the reverse cumulative sum of dG inside the chunk.
// The pair sums split like the forward's: across sub-chunks on tensor cores with factors taken at
// a row between the blocks (<= 1 each), inside a sub-chunk exactly by running products of exp(g).
#include <cuda_bf16.h>

#include "kernels/cuda/kda/kda_common.cuh"

namespace moetrain::kernels::cuda_ops::kda {
namespace {

constexpr int kBackwardThreads = 256;

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------
// kda_wy_backward

template <int kDk, int kDv>
struct WySmem {
  static constexpr int kKStride = kDk + kPad;
  static constexpr int kVStride = kDv + kPad;
  static constexpr int kMStride = kChunk + kPad;
  static constexpr int kPStride = kChunk + kPadF;
  static constexpr size_t kKBytes = sizeof(bf16) * kChunk * kKStride;
  static constexpr size_t kVBytes = sizeof(bf16) * kChunk * kVStride;
  static constexpr size_t kStateBytes = sizeof(bf16) * kDk * kVStride;
  static constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }
  static constexpr size_t kW = 0;
  static constexpr size_t kKg = kW + kKBytes;
  static constexpr size_t kDw = kKg + kKBytes;
  static constexpr size_t kV = kDw + kKBytes;
  static constexpr size_t kU = kV + kVBytes;
  static constexpr size_t kDvnew = kU + kVBytes;
  static constexpr size_t kState = kDvnew + kVBytes;  // S, then db and dc
  static constexpr size_t kDb = kState;
  static constexpr size_t kDc = kState + kVBytes;
  static constexpr size_t kM = kState + cmax(kStateBytes, kVBytes + kKBytes);
  static constexpr size_t kP = kM + sizeof(bf16) * kChunk * kMStride;
  static constexpr size_t kBeta = kP + sizeof(float) * kChunk * kPStride;
  static constexpr size_t kDbeta = kBeta + sizeof(float) * kChunk;  // [4][64] partial sums
  static constexpr size_t kBytes = kDbeta + sizeof(float) * 4 * kChunk;
  static_assert(kBytes <= kMaxSmemBytes, "fits one CTA");
};

template <int kDk, int kDv>
__global__ void __launch_bounds__(kBackwardThreads, 1) kda_wy_backward_sm80_bf16_kernel(KdaParams p) {
  using Smem = WySmem<kDk, kDv>;
  constexpr int kKS = Smem::kKStride, kVS = Smem::kVStride, kMS = Smem::kMStride, kPS = Smem::kPStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* w_st = reinterpret_cast<bf16*>(smem + Smem::kW);
  bf16* kg_st = reinterpret_cast<bf16*>(smem + Smem::kKg);
  bf16* dw_st = reinterpret_cast<bf16*>(smem + Smem::kDw);
  bf16* v_st = reinterpret_cast<bf16*>(smem + Smem::kV);
  bf16* u_st = reinterpret_cast<bf16*>(smem + Smem::kU);
  bf16* dvnew_st = reinterpret_cast<bf16*>(smem + Smem::kDvnew);
  bf16* s_st = reinterpret_cast<bf16*>(smem + Smem::kState);  // [Dk][kVS]
  bf16* db_st = reinterpret_cast<bf16*>(smem + Smem::kDb);
  bf16* dc_st = reinterpret_cast<bf16*>(smem + Smem::kDc);
  bf16* m_st = reinterpret_cast<bf16*>(smem + Smem::kM);
  float* p_st = reinterpret_cast<float*>(smem + Smem::kP);
  float* beta_st = reinterpret_cast<float*>(smem + Smem::kBeta);
  float* dbeta_st = reinterpret_cast<float*>(smem + Smem::kDbeta);

  const int chunk = blockIdx.x, head = blockIdx.y;
  ChunkSpan span;
  if (!find_chunk(p, chunk, span)) return;
  const int t0 = span.begin, len = span.len, heads = p.heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int mb = warp & 3, nh = warp >> 2;  // row block, column half
  const int64_t row0 = static_cast<int64_t>(t0) * heads + head;
  const int64_t k_rows = static_cast<int64_t>(heads) * kDk, v_rows = static_cast<int64_t>(heads) * kDv;

  load_tile_async<bf16, kDk>(w_st, kKS, p.w + row0 * kDk, k_rows, len);
  load_tile_async<bf16, kDv>(v_st, kVS, p.v + row0 * kDv, v_rows, len);
  load_tile_async<bf16, kDv>(u_st, kVS, p.u + row0 * kDv, v_rows, len);
  load_tile_async<bf16, kDv>(dvnew_st, kVS, p.dvnew + row0 * kDv, v_rows, len);
  load_tile_async<bf16, kDv>(s_st, kVS, p.state + (static_cast<int64_t>(chunk) * heads + head) * kDk * kDv, kDv, kDk,
                             kDk);
  load_tile_async<bf16, kChunk>(m_st, kMS, p.minv + row0 * kChunk, static_cast<int64_t>(heads) * kChunk, len);
  load_tile_async<float, kChunk>(p_st, kPS, p.pkk + row0 * kChunk, static_cast<int64_t>(heads) * kChunk, len);
  load_tile_async<bf16, kDk>(kg_st, kKS, p.kg + row0 * kDk, k_rows, len);
  cp_async_commit();
  if (tid < kChunk) beta_st[tid] = tid < len ? p.beta[row0 + static_cast<int64_t>(tid) * heads] : 0.0f;
  cp_async_wait<0>();
  __syncthreads();
  // dw = -dv_new S^T: warp (mb, nh) -> rows 16 mb, key columns nh Dk / 2.
  {
    constexpr int kTiles = kDk / 16;
    float acc[kTiles][4];
    zero_tiles(acc);
    warp_mma<ALayout::kMK, BLayout::kNK, kDv / 16, kTiles>(acc, dvnew_st, kVS, 16 * mb, 0, s_st, kVS,
                                                           nh * (kDk / 2), 0, lane, /*negate=*/true);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        store_bf16x2(dw_st + (16 * mb + g + 8 * h) * kKS + nh * (kDk / 2) + 8 * j + 2 * c, acc[j][2 * h],
                     acc[j][2 * h + 1]);
  }
  __syncthreads();  // dw visible; S no longer read (its space takes db, dc)

  // db = M^T dv_new -> dv = beta db; dc = M^T dw -> dkg = beta dc; their dbeta parts.
  float dbeta_part[2] = {0.0f, 0.0f};  // rows g, g + 8 of the warp's block
  {
    constexpr int kTiles = kDv / 16;
    float acc[kTiles][4];
    zero_tiles(acc);
    warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kTiles>(acc, m_st, kMS, 16 * mb, 0, dvnew_st, kVS,
                                                              nh * (kDv / 2), 0, lane);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mb + g + 8 * h, col = nh * (kDv / 2) + 8 * j + 2 * c;
        const float lo = acc[j][2 * h], hi = acc[j][2 * h + 1];
        const float2 vv = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(v_st + r * kVS + col));
        dbeta_part[h] += lo * vv.x + hi * vv.y;
        store_bf16x2(db_st + r * kVS + col, lo, hi);
        if (r < len) store_pair(p.dv, (row0 + static_cast<int64_t>(r) * heads) * kDv + col, beta_st[r] * lo, beta_st[r] * hi);
      }
  }
  {
    constexpr int kTiles = kDk / 16;
    float acc[kTiles][4];
    zero_tiles(acc);
    warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kTiles>(acc, m_st, kMS, 16 * mb, 0, dw_st, kKS,
                                                              nh * (kDk / 2), 0, lane);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mb + g + 8 * h, col = nh * (kDk / 2) + 8 * j + 2 * c;
        const float lo = acc[j][2 * h], hi = acc[j][2 * h + 1];
        const float2 kg = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(kg_st + r * kKS + col));
        dbeta_part[h] += lo * kg.x + hi * kg.y;
        store_bf16x2(dc_st + r * kKS + col, lo, hi);
        if (r < len)
          *reinterpret_cast<float2*>(p.dkg + (row0 + static_cast<int64_t>(r) * heads) * kDk + col) =
              make_float2(beta_st[r] * lo, beta_st[r] * hi);
      }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float total = quad_sum(dbeta_part[h]);
    if (c == 0) dbeta_st[nh * kChunk + 16 * mb + g + 8 * h] = total;
  }
  __syncthreads();  // db, dc visible

  // dA = -(db u^T + dc w^T), strictly lower and inside the chunk: warp (mb, nh) -> 32 columns.
  {
    float acc[4][4];
    zero_tiles(acc);
    warp_mma<ALayout::kMK, BLayout::kNK, kDv / 16, 4>(acc, db_st, kVS, 16 * mb, 0, u_st, kVS, nh * 32, 0, lane, true);
    warp_mma<ALayout::kMK, BLayout::kNK, kDk / 16, 4>(acc, dc_st, kKS, 16 * mb, 0, w_st, kKS, nh * 32, 0, lane, true);
    float part[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * mb + g + 8 * h, col = nh * 32 + 8 * j + 2 * c;
        const float lo = col < r ? acc[j][2 * h] : 0.0f;
        const float hi = col + 1 < r ? acc[j][2 * h + 1] : 0.0f;
        part[h] += lo * p_st[r * kPS + col] + hi * p_st[r * kPS + col + 1];
        if (r < len)
          *reinterpret_cast<float2*>(p.dpkk + (row0 + static_cast<int64_t>(r) * heads) * kChunk + col) =
              make_float2(beta_st[r] * lo, beta_st[r] * hi);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = quad_sum(part[h]);
      if (c == 0) dbeta_st[(2 + nh) * kChunk + 16 * mb + g + 8 * h] = total;
    }
  }
  __syncthreads();
  if (tid < len) {
    p.dbeta[row0 + static_cast<int64_t>(tid) * heads] =
        (dbeta_st[tid] + dbeta_st[kChunk + tid]) + (dbeta_st[2 * kChunk + tid] + dbeta_st[3 * kChunk + tid]);
  }
}

// ---------------------------------------------------------------------------------------------
// kda_intra_backward

template <int kDk, int kDv>
struct IntraBackSmem {
  static constexpr int kDh = kDk / 2;  // key dims per CTA
  static constexpr int kHStride = kDh + kPad;     // q, k halves (BF16)
  static constexpr int kFStride = kDh + kPadF;    // G, decay, accumulators (F32)
  static constexpr int kVStride = kDv + kPad;     // dout, v_new, S and dS rows (BF16)
  static constexpr int kAStride = kChunk + kPadF;  // dAqk, dpkk (F32)
  static constexpr size_t kHalfBytes = sizeof(bf16) * kChunk * kHStride;
  static constexpr size_t kFBytes = sizeof(float) * kChunk * kFStride;
  static constexpr size_t kABytes = sizeof(float) * kChunk * kAStride;
  static constexpr size_t kRowsBytes = sizeof(bf16) * kChunk * kVStride;
  static constexpr size_t kStateBytes = sizeof(bf16) * kDh * kVStride;
  static constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + kHalfBytes;
  static constexpr size_t kG = kK + kHalfBytes;
  static constexpr size_t kDecay = kG + kFBytes;
  static constexpr size_t kDaqk = kDecay + kFBytes;
  static constexpr size_t kDp = kDaqk + kABytes;
  // Region X: dout, v_new, S rows, dS rows first; the three accumulators after them.
  static constexpr size_t kX = kDp + kABytes;
  static constexpr size_t kDout = kX;
  static constexpr size_t kVnew = kDout + kRowsBytes;
  static constexpr size_t kS = kVnew + kRowsBytes;
  static constexpr size_t kDs = kS + kStateBytes;
  static constexpr size_t kAccDq = kX;
  static constexpr size_t kAccDk = kX + kFBytes;
  static constexpr size_t kAccDks = kX + 2 * kFBytes;
  static constexpr size_t kLrow = kX + cmax(2 * kRowsBytes + 2 * kStateBytes, 3 * kFBytes);  // [4][kDh] + [kDh] x 2
  static constexpr size_t kBytes = kLrow + sizeof(float) * 6 * kDh;
  static_assert(kBytes <= kMaxSmemBytes, "fits one CTA");
};

template <int kDk, int kDv>
__global__ void __launch_bounds__(kBackwardThreads, 1) kda_intra_backward_sm80_bf16_kernel(KdaParams p) {
  using Smem = IntraBackSmem<kDk, kDv>;
  constexpr int kDh = Smem::kDh;
  constexpr int kHS = Smem::kHStride, kFS = Smem::kFStride, kVS = Smem::kVStride, kAS = Smem::kAStride;
  constexpr int kNTiles = kDh / 16;  // n-tiles of a warp's kDh / 2 columns
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_st = reinterpret_cast<bf16*>(smem + Smem::kQ);
  bf16* k_st = reinterpret_cast<bf16*>(smem + Smem::kK);
  float* g_st = reinterpret_cast<float*>(smem + Smem::kG);  // log2 units
  float* decay_st = reinterpret_cast<float*>(smem + Smem::kDecay);
  float* daqk_st = reinterpret_cast<float*>(smem + Smem::kDaqk);
  float* dp_st = reinterpret_cast<float*>(smem + Smem::kDp);
  bf16* dout_st = reinterpret_cast<bf16*>(smem + Smem::kDout);
  bf16* vnew_st = reinterpret_cast<bf16*>(smem + Smem::kVnew);
  bf16* s_st = reinterpret_cast<bf16*>(smem + Smem::kS);
  bf16* ds_st = reinterpret_cast<bf16*>(smem + Smem::kDs);
  float* acc_dq = reinterpret_cast<float*>(smem + Smem::kAccDq);
  float* acc_dk = reinterpret_cast<float*>(smem + Smem::kAccDk);
  float* acc_dks = reinterpret_cast<float*>(smem + Smem::kAccDks);  // the dG weights of k
  float* lrow_part = reinterpret_cast<float*>(smem + Smem::kLrow);  // [4][kDh]
  float* ddecay_st = lrow_part + 4 * kDh;                           // [kDh]
  float* lrow_st = ddecay_st + kDh;                                 // [kDh]

  const int chunk = blockIdx.x, head = blockIdx.y, d_base = blockIdx.z * kDh;
  ChunkSpan span;
  if (!find_chunk(p, chunk, span)) return;
  const int t0 = span.begin, len = span.len, last = len - 1, heads = p.heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int mb = warp & 3, nh = warp >> 2;
  const int64_t row0 = static_cast<int64_t>(t0) * heads + head;
  const int64_t k_rows = static_cast<int64_t>(heads) * kDk, v_rows = static_cast<int64_t>(heads) * kDv;
  const int64_t state0 = (static_cast<int64_t>(chunk) * heads + head) * kDk * kDv + static_cast<int64_t>(d_base) * kDv;
  const float scale = p.scale;

  load_tile_async<bf16, kDh>(q_st, kHS, p.q + row0 * kDk + d_base, k_rows, len);
  load_tile_async<bf16, kDh>(k_st, kHS, p.k + row0 * kDk + d_base, k_rows, len);
  load_tile_async<bf16, kDv>(dout_st, kVS, p.dout + row0 * kDv, v_rows, len);
  load_tile_async<bf16, kDv>(vnew_st, kVS, p.vnew + row0 * kDv, v_rows, len);
  load_tile_async<bf16, kDv>(s_st, kVS, p.state + state0, kDv, kDh, kDh);
  load_tile_async<bf16, kDv>(ds_st, kVS, p.dstate + state0, kDv, kDh, kDh);
  load_tile_async<float, kChunk>(dp_st, kAS, p.dpkk + row0 * kChunk, static_cast<int64_t>(heads) * kChunk, len);
  load_tile_async<float, kDh>(g_st, kFS, p.g + row0 * kDk + d_base, k_rows, len);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  if (tid < kDh) {
    // g -> its running sum G in place (log2 units) and the per-token decay exp(g).
    float sum = 0.0f;
#pragma unroll 8
    for (int r = 0; r < kChunk; ++r) {
      const float gv = g_st[r * kFS + tid];
      sum += gv;
      g_st[r * kFS + tid] = sum * kLog2e;
      decay_st[r * kFS + tid] = exp2f(gv * kLog2e);
    }
  }
  __syncthreads();

  // ---- Products with the states (K = the value dims). Warp (mb, nh).
  // dAqk = dout v_new^T on and below the diagonal: 32 columns per warp.
  {
    float acc[4][4];
    zero_tiles(acc);
    warp_mma<ALayout::kMK, BLayout::kNK, kDv / 16, 4>(acc, dout_st, kVS, 16 * mb, 0, vnew_st, kVS, nh * 32, 0, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * mb + g + 8 * (e >> 1), col = nh * 32 + 8 * j + 2 * c + (e & 1);
        daqk_st[r * kAS + col] = col <= r ? acc[j][e] : 0.0f;
      }
  }
  // dqg = dout S^T -> dq = scale exp(G) dqg;  dkt = v_new dS^T -> exp(G_last - G) dkt.
  const int n0 = nh * (kDh / 2);  // the warp's key columns (within the half)
  float dq_reg[kNTiles][4], dkt_reg[kNTiles][4];
  zero_tiles(dq_reg);
  zero_tiles(dkt_reg);
  warp_mma<ALayout::kMK, BLayout::kNK, kDv / 16, kNTiles>(dq_reg, dout_st, kVS, 16 * mb, 0, s_st, kVS, n0, 0, lane);
  warp_mma<ALayout::kMK, BLayout::kNK, kDv / 16, kNTiles>(dkt_reg, vnew_st, kVS, 16 * mb, 0, ds_st, kVS, n0, 0, lane);
  {
    float col_sum[kNTiles][2];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int x = 0; x < 2; ++x) col_sum[j][x] = 0.0f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * mb + g + 8 * (e >> 1), d = n0 + 8 * j + 2 * c + (e & 1);
        const float gr = g_st[r * kFS + d];
        dq_reg[j][e] *= scale * exp2f(gr);
        dkt_reg[j][e] *= exp2f(g_st[last * kFS + d] - gr);
        col_sum[j][e & 1] += __bfloat162float(k_st[r * kHS + d]) * dkt_reg[j][e];
      }
    // Sum over the warp's 16 rows (lanes with equal c), then one row of partials per row block.
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        float v = col_sum[j][x];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) lrow_part[mb * kDh + n0 + 8 * j + 2 * c + x] = v;
      }
  }
  // ddecay[d] = sum_v S[d, v] dS[d, v]: four threads per key row.
  if (tid < 4 * kDh) {
    const int d = tid >> 2, part = tid & 3;
    float sum = 0.0f;
    for (int v = part * 2; v < kDv; v += 8) {
      const float2 a = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(s_st + d * kVS + v));
      const float2 b = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(ds_st + d * kVS + v));
      sum += a.x * b.x + a.y * b.y;
    }
    sum = quad_sum(sum);
    if (part == 0) ddecay_st[d] = sum;
  }
  __syncthreads();  // region X's inputs are dead from here

  // Accumulators: dq, dk and the k-weights of dG start from the state terms and the w terms.
#pragma unroll
  for (int j = 0; j < kNTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * mb + g + 8 * (e >> 1), d = n0 + 8 * j + 2 * c + (e & 1);
      const float kg = r < len ? p.dkg[(row0 + static_cast<int64_t>(r) * heads) * kDk + d_base + d] *
                                     exp2f(g_st[r * kFS + d])
                               : 0.0f;
      acc_dq[r * kFS + d] = dq_reg[j][e];
      acc_dk[r * kFS + d] = kg + dkt_reg[j][e];
      acc_dks[r * kFS + d] = kg - dkt_reg[j][e];
    }
  if (tid < kDh) {
    lrow_st[tid] = (lrow_part[tid] + lrow_part[kDh + tid]) + (lrow_part[2 * kDh + tid] + lrow_part[3 * kDh + tid]) +
                   ddecay_st[tid] * exp2f(g_st[last * kFS + tid]);
  }
  __syncthreads();

  // ---- Pairs across sub-chunks on tensor cores; warp (row block b = mb, key columns n0...).
  const int b = mb;
  if (b >= 1) {
    // Row side: rows of block b against every earlier column; factors split at row ref.
    const int ref = b * kSub - 1;
    float xq[kNTiles][4], xk[kNTiles][4];
    zero_tiles(xq);
    zero_tiles(xk);
    for (int cb = 0; cb < b; ++cb) {
      uint32_t aq[4], ak[4];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const int r = b * kSub + g + 8 * rh, s = cb * kSub + 2 * c + 8 * half;
          aq[rh + 2 * half] = pack_bf16x2(scale * daqk_st[r * kAS + s], scale * daqk_st[r * kAS + s + 1]);
          ak[rh + 2 * half] = pack_bf16x2(dp_st[r * kAS + s], dp_st[r * kAS + s + 1]);
        }
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const int d = n0 + 8 * j + g;
        const float gref = g_st[ref * kFS + d];
        uint32_t fb[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int s = cb * kSub + 2 * c + 8 * half;
          fb[half] = pack_bf16x2(__bfloat162float(k_st[s * kHS + d]) * exp2f(gref - g_st[s * kFS + d]),
                                 __bfloat162float(k_st[(s + 1) * kHS + d]) * exp2f(gref - g_st[(s + 1) * kFS + d]));
        }
        mma_m16n8k16_bf16_ordered(xq[j], aq, fb[0], fb[1]);
        mma_m16n8k16_bf16_ordered(xk[j], ak, fb[0], fb[1]);
      }
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = b * kSub + g + 8 * (e >> 1), d = n0 + 8 * j + 2 * c + (e & 1);
        const float f = exp2f(g_st[r * kFS + d] - g_st[ref * kFS + d]);
        acc_dq[r * kFS + d] += xq[j][e] * f;
        acc_dk[r * kFS + d] += xk[j][e] * f;
        acc_dks[r * kFS + d] += xk[j][e] * f;
      }
  }
  if (b < kSubs - 1) {
    // Column side: keys of block b against every later row; factors split at row ref.
    const int ref = b * kSub + kSub - 1;
    float y[kNTiles][4];
    zero_tiles(y);
    for (int rb = b + 1; rb < kSubs; ++rb) {
      // A = (scale dAqk)^T and dpkk^T: element (m = key s, k = row r).
      uint32_t aq[4], ak[4];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int sh = 0; sh < 2; ++sh) {
          const int s = b * kSub + g + 8 * sh, r = rb * kSub + 2 * c + 8 * half;
          aq[sh + 2 * half] = pack_bf16x2(scale * daqk_st[r * kAS + s], scale * daqk_st[(r + 1) * kAS + s]);
          ak[sh + 2 * half] = pack_bf16x2(dp_st[r * kAS + s], dp_st[(r + 1) * kAS + s]);
        }
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const int d = n0 + 8 * j + g;
        const float gref = g_st[ref * kFS + d];
        uint32_t fq[2], fk[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = rb * kSub + 2 * c + 8 * half;
          const float f0 = exp2f(g_st[r * kFS + d] - gref), f1 = exp2f(g_st[(r + 1) * kFS + d] - gref);
          fq[half] = pack_bf16x2(__bfloat162float(q_st[r * kHS + d]) * f0, __bfloat162float(q_st[(r + 1) * kHS + d]) * f1);
          fk[half] = pack_bf16x2(__bfloat162float(k_st[r * kHS + d]) * f0, __bfloat162float(k_st[(r + 1) * kHS + d]) * f1);
        }
        mma_m16n8k16_bf16_ordered(y[j], aq, fq[0], fq[1]);
        mma_m16n8k16_bf16_ordered(y[j], ak, fk[0], fk[1]);
      }
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int s = b * kSub + g + 8 * (e >> 1), d = n0 + 8 * j + 2 * c + (e & 1);
        const float f = exp2f(g_st[ref * kFS + d] - g_st[s * kFS + d]);
        acc_dk[s * kFS + d] += y[j][e] * f;
        acc_dks[s * kFS + d] -= y[j][e] * f;
      }
  }
  __syncthreads();

  // ---- Pairs inside a sub-chunk, exactly. Thread: row r = 16 sb + i, columns in groups of four
  // (group x covers 16 x + 4 part .. + 3, so the four parts read 64 contiguous bytes).
  {
    const int sb = tid >> 6, i = (tid >> 2) & 15, part = tid & 3;
    const int r = sb * kSub + i;
#pragma unroll 1
    for (int group = 0; group < kDh / 16; ++group) {
      const int d0 = 16 * group + 4 * part;
      float e[4], dq[4], dk_row[4], dk_col[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) e[x] = dq[x] = dk_row[x] = dk_col[x] = 0.0f;
      // Row side: j from i down, e = exp(G_r - G_s).
#pragma unroll
      for (int j = kSub - 1; j >= 0; --j) {
        const int s = sb * kSub + j;
        const float4 dec = *reinterpret_cast<const float4*>(decay_st + min(s + 1, kChunk - 1) * kFS + d0);
        const uint2 kraw = *reinterpret_cast<const uint2*>(k_st + s * kHS + d0);
        const float2 k01 = unpack_bf16x2(kraw.x), k23 = unpack_bf16x2(kraw.y);
        const float ks[4] = {k01.x, k01.y, k23.x, k23.y}, dv[4] = {dec.x, dec.y, dec.z, dec.w};
        const float start = j == i ? 1.0f : 0.0f;
        const float wq = scale * daqk_st[r * kAS + s], wk = dp_st[r * kAS + s];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          e[x] = fmaf(e[x], dv[x], start);
          const float ke = ks[x] * e[x];
          dq[x] = fmaf(wq, ke, dq[x]);
          dk_row[x] = fmaf(wk, ke, dk_row[x]);
        }
      }
      // Column side (r is now the key): j from i up, e = exp(G_t - G_r) for t = 16 sb + j.
#pragma unroll
      for (int x = 0; x < 4; ++x) e[x] = 0.0f;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int t = sb * kSub + j;
        const float4 dec = *reinterpret_cast<const float4*>(decay_st + t * kFS + d0);
        const uint2 qraw = *reinterpret_cast<const uint2*>(q_st + t * kHS + d0);
        const uint2 kraw = *reinterpret_cast<const uint2*>(k_st + t * kHS + d0);
        const float2 q01 = unpack_bf16x2(qraw.x), q23 = unpack_bf16x2(qraw.y);
        const float2 k01 = unpack_bf16x2(kraw.x), k23 = unpack_bf16x2(kraw.y);
        const float qt[4] = {q01.x, q01.y, q23.x, q23.y}, kt[4] = {k01.x, k01.y, k23.x, k23.y};
        const float dv[4] = {dec.x, dec.y, dec.z, dec.w};
        const float start = j == i ? 1.0f : 0.0f;
        const float wq = scale * daqk_st[t * kAS + r], wk = dp_st[t * kAS + r];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          e[x] = fmaf(e[x], dv[x], start);
          dk_col[x] = fmaf(fmaf(wq, qt[x], wk * kt[x]), e[x], dk_col[x]);
        }
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        acc_dq[r * kFS + d0 + x] += dq[x];
        acc_dk[r * kFS + d0 + x] += dk_row[x] + dk_col[x];
        acc_dks[r * kFS + d0 + x] += dk_row[x] - dk_col[x];
      }
    }
  }
  __syncthreads();

  // ---- Out: dq, dk; dG and its reverse cumulative sum per key column.
  for (int i = tid; i < len * (kDh / 2); i += kBackwardThreads) {
    const int r = i / (kDh / 2), d = 2 * (i % (kDh / 2));
    const int64_t at = (row0 + static_cast<int64_t>(r) * heads) * kDk + d_base + d;
    store_pair(p.dq, at, acc_dq[r * kFS + d], acc_dq[r * kFS + d + 1]);
    store_pair(p.dk, at, acc_dk[r * kFS + d], acc_dk[r * kFS + d + 1]);
  }
  if (tid < kDh) {
    float run = 0.0f;
    for (int r = last; r >= 0; --r) {
      float dg = __bfloat162float(q_st[r * kHS + tid]) * acc_dq[r * kFS + tid] +
                 __bfloat162float(k_st[r * kHS + tid]) * acc_dks[r * kFS + tid];
      if (r == last) dg += lrow_st[tid];
      run += dg;
      p.dg[(row0 + static_cast<int64_t>(r) * heads) * kDk + d_base + tid] = run;
    }
  }
}

}  // namespace

void launch_kda_wy_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.capacity), static_cast<unsigned>(p.heads));
  dispatch_head_dims(dk, dv, [&](auto k_dim, auto v_dim) {
    constexpr int kDk = decltype(k_dim)::value, kDv = decltype(v_dim)::value;
    launch_kda_kernel(kda_wy_backward_sm80_bf16_kernel<kDk, kDv>, grid, kBackwardThreads, WySmem<kDk, kDv>::kBytes,
                      stream, p);
  });
}

void launch_kda_intra_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.capacity), static_cast<unsigned>(p.heads), 2);
  dispatch_head_dims(dk, dv, [&](auto k_dim, auto v_dim) {
    constexpr int kDk = decltype(k_dim)::value, kDv = decltype(v_dim)::value;
    launch_kda_kernel(kda_intra_backward_sm80_bf16_kernel<kDk, kDv>, grid, kBackwardThreads,
                      IntraBackSmem<kDk, kDv>::kBytes, stream, p);
  });
}

}  // namespace moetrain::kernels::cuda_ops::kda
