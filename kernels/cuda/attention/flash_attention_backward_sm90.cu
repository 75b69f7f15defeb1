// Hopper flash attention backward (see flash_attention_sm90.h; the CPU reference is the spec).
// Deterministic: no atomic adds; each output row is written once, by one work, summed in a fixed
// order (the only atomic hands out works, which does not change what a work computes).
//
// With P = 2^(S scale log2e - lse log2e) (S = Q K^T; lse saved by the forward), dP = dO V^T and
// delta = rowsum(dO * O):  dS = P (dP - delta),  dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K.
// Three launches:
//   prep:  delta and lse log2e, head-major ([heads][tokens], rows padded to 16 bytes) so that the
//          dK/dV kernel can stream them by TMA beside the query tiles.
//   dK/dV: a work per (128 keys, head): warpgroups 1 and 2 own 64 keys each and keep dK, dV in
//          registers; the producer streams tiles of kBlockM queries (96; 48 for qk 192: Q, dO,
//          lse, delta) from the block's first key to the end of its last key's segment. Per tile,
//          per warpgroup:
//            S^T = K Q^T, dP^T = V dO^T   wgmma from shared memory (K-major)
//            P^T, dS^T                    in registers, F32
//            dV += P^T dO, dK += dS^T Q   wgmma with P^T / dS^T from registers, Q / dO MN-major
//   dQ:    a work per (128 queries, head), as the forward: warpgroups own 64 queries, the
//          producer streams tiles of 128 keys (96 for qk 192) of K and V from the segment start
//          of the first query:
//            S = Q K^T, dP = dO V^T       wgmma from shared memory
//            dQ += dS K                   dS from registers, K MN-major
// (dQ recomputes S and dP instead of summing partial dQ of the dK/dV CTAs: 7 matmuls instead of
// 5, but no atomic adds and no F32 partials in memory; see flash_attention_sm90.h for the fused
// 5-matmul alternative. Leaving a step's dV, dK (or dQ) products in flight while the next step's
// S and dP are issued measured slower too: docs/PERF.md.)
// Both passes are persistent, as the forward (WorkRing: a CTA per multiprocessor takes works in
// ordered_block's order, heads in groups, each group's longest blocks first; the producer loads
// the next work's K and V, or Q and dO, while the consumers finish the last).
// Masking is per (query t, key s), visible iff start(t) <= s <= t, equivalently t >= s and
// t < end(s): the dQ pass finds start(t) once per row, the dK/dV pass end(s) once per key; tiles
// wholly inside the visible region skip the mask.
#include <cuda.h>
#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention/flash_attention_sm90.h"
#include "kernels/cuda/attention/flash_attention_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace flash_sm90 {
namespace {

// Head-major F32 rows: [heads][row_stride], row_stride = tokens rounded up to 4 (16 bytes, TMA).
int64_t head_row_stride(int64_t tokens) { return (tokens + 3) / 4 * 4; }

struct BackwardParams {
  bf16* dq = nullptr;
  bf16* dk = nullptr;
  bf16* dv = nullptr;
  const float* lse_log2 = nullptr;  // [heads][row_stride]
  const float* delta = nullptr;     // [heads][row_stride]
  const int32_t* cu_seqlens = nullptr;
  int tokens = 0;
  int heads = 0;
  int num_segments = 0;
  int row_stride = 0;
  float scale = 0.0f;
  float scale_log2 = 0.0f;
  int blocks_per_head = 0;  // of the launch at hand
  int order_group = 1;      // ordered_block's head group
  int works = 0;            // blocks_per_head x heads
  int* work_counter = nullptr;
};

// ---------------------------------------------------------------------------------------------
// prep: one warp per (head, token), consecutive warps on consecutive tokens of a head.

constexpr int kPrepThreads = 256;

// It also zeroes the two passes' work counters.
__global__ void flash_attention_backward_prep_kernel(float* delta, float* lse_log2, int* work_counters,
                                                     const bf16* dout, const bf16* out, const float* lse, int tokens,
                                                     int heads, int v_dim, int row_stride) {
  if (blockIdx.x == 0 && threadIdx.x < 2) work_counters[threadIdx.x] = 0;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= static_cast<int64_t>(tokens) * heads) return;
  const int head = static_cast<int>(w / tokens), t = static_cast<int>(w % tokens);
  const int64_t row = static_cast<int64_t>(t) * heads + head;
  const bf16* g = dout + row * v_dim;
  const bf16* o = out + row * v_dim;
  float sum = 0.0f;
  for (int c = 2 * lane; c < v_dim; c += 64) {  // v_dim is even (64 or 128)
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + c));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + c));
    sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
  }
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    delta[static_cast<int64_t>(head) * row_stride + t] = sum;
    lse_log2[static_cast<int64_t>(head) * row_stride + t] = lse[row] * kLog2e;
  }
}

// ---------------------------------------------------------------------------------------------
// dK/dV

template <int kQk, int kV>
struct DkdvTiling {
  static constexpr int kBlockN = kConsumerWarpgroups * kWarpgroupRows;  // 128 keys
  // Queries per step: 96, or 48 for qk 192 (dK's 96 and dV's 64 accumulator registers per thread
  // leave room for 2 x 24 score registers only).
  static constexpr int kBlockM = kQk > 128 ? 48 : 96;
  using KTile = SwizzledTile<kBlockN, kQk>;
  using VTile = SwizzledTile<kBlockN, kV>;
  using QTile = SwizzledTile<kBlockM, kQk>;
  using DoTile = SwizzledTile<kBlockM, kV>;
  // lse or delta of one step: what the TMA copy brings, and its slot per stage (128-byte aligned,
  // as TMA destinations must be).
  static constexpr int kRowBytes = kBlockM * static_cast<int>(sizeof(float));
  static constexpr int kRowSlotBytes = (kRowBytes + 127) / 128 * 128;
  static constexpr int kRowSlotFloats = kRowSlotBytes / static_cast<int>(sizeof(float));
  // dP^T is issued with S^T (its product then overlaps the probabilities) when both accumulators
  // fit beside dK and dV. At dim 128 they would spill (ptxas: 576 bytes), so dP^T is issued once
  // P^T is packed and dS takes P from those BF16 fragments (the F32 P^T is gone by then; one more
  // rounding of dS's factor: at dims 192/128 it moved 3 of 115,200 dK values past the test's
  // elementwise bound, so the other dims keep the F32 P^T). On the H200 (A/B in one run) this made
  // forward + backward at dim 128 1.02x faster at T 8192 and 1.03x at T 32768 than 64 queries per
  // step with both issued together; 128 queries per step spilled and ran slower.
  static constexpr bool kSerialScores = kQk == 128;
  // Query stages that fit beside K and V: up to 4.
  static constexpr int kStageBytes = QTile::kBytes + DoTile::kBytes + 2 * kRowSlotBytes;
  static constexpr int kStages =
      std::min(4, (kMaxSmemBytes - 2 * kSmemAlignment - KTile::kBytes - VTile::kBytes) / kStageBytes);
  static constexpr int kVOffset = KTile::kBytes;
  static constexpr int kQOffset = kVOffset + VTile::kBytes;
  static constexpr int kDoOffset = kQOffset + kStages * QTile::kBytes;
  static constexpr int kLseOffset = kDoOffset + kStages * DoTile::kBytes;
  static constexpr int kDeltaOffset = kLseOffset + kStages * kRowSlotBytes;
  static constexpr int kBarrierOffset = kDeltaOffset + kStages * kRowSlotBytes;
  // kv_full, kv_empty, q_full[], do_full[], empty[], the work ring's
  static constexpr int kBarriers = 2 + 3 * kStages + WorkRing::kBarriers;
  static constexpr int kWorkOffset = kBarrierOffset + kBarriers * static_cast<int>(sizeof(uint64_t));
  static constexpr size_t kSmemBytes = kSmemAlignment + kWorkOffset + WorkRing::kBytes;
  static_assert(kSmemBytes <= kMaxSmemBytes, "the dK/dV stages must fit in shared memory");
};

template <int kQk, int kV>
__global__ void __launch_bounds__(kThreads, 1)
    flash_attention_backward_dkdv_sm90_bf16_kernel(const __grid_constant__ CUtensorMap k_map,
                                                   const __grid_constant__ CUtensorMap v_map,
                                                   const __grid_constant__ CUtensorMap q_map,
                                                   const __grid_constant__ CUtensorMap dout_map,
                                                   const __grid_constant__ CUtensorMap lse_map,
                                                   const __grid_constant__ CUtensorMap delta_map,
                                                   const BackwardParams p) {
  using T = DkdvTiling<kQk, kV>;
  using KTile = typename T::KTile;
  using VTile = typename T::VTile;
  using QTile = typename T::QTile;
  using DoTile = typename T::DoTile;
  constexpr int kBlockM = T::kBlockM;
  constexpr bool kSerialScores = T::kSerialScores;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = align_to_swizzle(smem_raw);
  unsigned char* k_st = smem;
  unsigned char* v_st = smem + T::kVOffset;
  unsigned char* q_st = smem + T::kQOffset;    // [kStages]
  unsigned char* do_st = smem + T::kDoOffset;  // [kStages]
  float* lse_st = reinterpret_cast<float*>(smem + T::kLseOffset);      // [kStages][kRowSlotFloats]
  float* delta_st = reinterpret_cast<float*>(smem + T::kDeltaOffset);  // [kStages][kRowSlotFloats]
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem + T::kBarrierOffset);
  uint64_t* kv_empty = kv_full + 1;
  uint64_t* q_full = kv_empty + 1;
  uint64_t* do_full = q_full + T::kStages;
  uint64_t* empty = do_full + T::kStages;
  WorkRing work_ring(empty + T::kStages, smem + T::kWorkOffset);

  if (threadIdx.x == 0) {
    sm90::barrier_init(kv_full, 1);
    sm90::barrier_init(kv_empty, kConsumerWarps);
    for (int s = 0; s < T::kStages; ++s) {
      sm90::barrier_init(&q_full[s], 1);
      sm90::barrier_init(&do_full[s], 1);
      sm90::barrier_init(&empty[s], kConsumerWarps);
    }
    work_ring.init();
    sm90::fence_barrier_init();
  }
  __syncthreads();

  // A work's block: its keys, and the queries that see them, from its first key to the end of its
  // last key's segment.
  struct KeyBlock {
    int head, n0, n_steps;
  };
  auto block_of = [&](int work) {
    const OrderedBlock ob = ordered_block(work, p.blocks_per_head, p.heads, p.order_group);
    KeyBlock b;
    b.head = ob.head;
    b.n0 = ob.rank * T::kBlockN;  // causal: the first key blocks see the most queries
    const int last_key = min(b.n0 + T::kBlockN, p.tokens) - 1;
    const int query_end = segment_end(p.cu_seqlens, p.num_segments, last_key, p.tokens);
    b.n_steps = (query_end - b.n0 + kBlockM - 1) / kBlockM;
    return b;
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    for (const CUtensorMap* map : {&k_map, &v_map, &q_map, &dout_map, &lse_map, &delta_map}) {
      sm90::tma_prefetch_descriptor(map);
    }
    RingPosition<T::kStages> ring;
    for (int w = 0;; ++w) {
      const int work = work_ring.produce(p.work_counter, p.works, w == 0);
      if (work < 0) break;
      const KeyBlock b = block_of(work);
      // K and V's one buffer is free once the last work's steps are done.
      if (w > 0) producer_wait(kv_empty, (w - 1) & 1);
      sm90::barrier_arrive_expect_bytes(kv_full, KTile::kBytes + VTile::kBytes);
      load_tile<KTile>(k_st, &k_map, kv_full, b.head, b.n0);
      load_tile<VTile>(v_st, &v_map, kv_full, b.head, b.n0);
      for (int i = 0; i < b.n_steps; ++i) {
        const int m0 = b.n0 + i * kBlockM;
        const int stage = ring.stage;
        producer_wait(&empty[stage], ring.phase ^ 1);
        sm90::barrier_arrive_expect_bytes(&q_full[stage], QTile::kBytes + T::kRowBytes);
        load_tile<QTile>(q_st + stage * QTile::kBytes, &q_map, &q_full[stage], b.head, m0);
        sm90::tma_load_2d(lse_st + stage * T::kRowSlotFloats, &lse_map, &q_full[stage], m0, b.head);
        sm90::barrier_arrive_expect_bytes(&do_full[stage], DoTile::kBytes + T::kRowBytes);
        load_tile<DoTile>(do_st + stage * DoTile::kBytes, &dout_map, &do_full[stage], b.head, m0);
        sm90::tma_load_2d(delta_st + stage * T::kRowSlotFloats, &delta_map, &do_full[stage], m0, b.head);
        ring.advance();
      }
    }
    drain_ring(empty, ring);
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int wg = warp / 4 - 1;
  const int quad = lane % 4;
  const uint32_t k_base = sm90::smem_address(k_st);
  const uint32_t v_base = sm90::smem_address(v_st);
  const uint32_t q_base = sm90::smem_address(q_st);
  const uint32_t do_base = sm90::smem_address(do_st);

  float dk[kQk / 2], dv[kV / 2];
  float pt[kBlockM / 2], dpt[kBlockM / 2];  // P^T and dP^T (then dS^T): keys x queries
  uint32_t pf[kBlockM / 16][4], dsf[kBlockM / 16][4];

  RingPosition<T::kStages> ring;
  for (int w = 0;; ++w) {
    const int work = work_ring.consume(lane);
    if (work < 0) break;
    const KeyBlock b = block_of(work);
    const int wg_key0 = b.n0 + wg * kWarpgroupRows;
    // This thread's keys (rows g and g + 8 of its warp's 16) and the ends of their segments: query
    // t sees key s iff s <= t < end(s). Keys past the tokens see nothing (end = the key).
    int key[2], key_end[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      key[h] = wg_key0 + (warp % 4) * 16 + lane / 4 + 8 * h;
      key_end[h] = key[h] < p.tokens ? segment_end(p.cu_seqlens, p.num_segments, key[h], p.tokens) : key[h];
    }
    // Ends are monotone in s: the warpgroup's first key has the earliest.
    const int wg_min_key_end =
        wg_key0 < p.tokens ? segment_end(p.cu_seqlens, p.num_segments, wg_key0, p.tokens) : wg_key0;
    auto needs_mask = [&](int m0) { return !(m0 >= wg_key0 + kWarpgroupRows - 1 && m0 + kBlockM <= wg_min_key_end); };
    zero(dk);
    zero(dv);

    sm90::barrier_wait(kv_full, w & 1);
    for (int i = 0; i < b.n_steps; ++i) {
      const int m0 = b.n0 + i * kBlockM;
      const int stage = ring.stage;
      const uint32_t q_stage = q_base + stage * QTile::kBytes;
      const uint32_t do_stage = do_base + stage * DoTile::kBytes;
      const float* lse_row = lse_st + stage * T::kRowSlotFloats;
      const float* delta_row = delta_st + stage * T::kRowSlotFloats;

      sm90::barrier_wait(&q_full[stage], ring.phase);
      sm90::fence_registers(pt);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQk / 16; ++kk) {
        sm90::Wgmma<kBlockM>::template mma<0, 0>(pt, KTile::k_major(k_base, wg * kWarpgroupRows, kk),
                                                 QTile::k_major(q_stage, 0, kk), kk > 0 ? 1 : 0);
      }
      sm90::wgmma_commit();
      auto issue_dp = [&] {
        sm90::barrier_wait(&do_full[stage], ring.phase);
        sm90::fence_registers(dpt);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kV / 16; ++kk) {
          sm90::Wgmma<kBlockM>::template mma<0, 0>(dpt, VTile::k_major(v_base, wg * kWarpgroupRows, kk),
                                                   DoTile::k_major(do_stage, 0, kk), kk > 0 ? 1 : 0);
        }
        sm90::wgmma_commit();
      };
      if constexpr (!kSerialScores) issue_dp();

      sm90::wgmma_wait<kSerialScores ? 0 : 1>();  // S^T is done
      sm90::fence_registers(pt);
      // P^T = 2^(S^T scale log2e - lse log2e); column 8j + 2c + e is query m0 + 8j + 2c + e.
      auto probabilities = [&](auto masked) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_row + 8 * j + 2 * quad);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = pt[4 * j + 2 * h + e];
              x = fast_exp2(fmaf(x, p.scale_log2, -(e == 0 ? lse.x : lse.y)));
              if constexpr (decltype(masked)::value) {
                const int t = m0 + 8 * j + 2 * quad + e;
                if (t < key[h] || t >= key_end[h]) x = 0.0f;
              }
            }
          }
        }
      };
      if (needs_mask(m0)) {
        probabilities(std::true_type{});
      } else {
        probabilities(std::false_type{});
      }
      accumulator_to_fragments<kBlockM>(pf, pt);
      if constexpr (kSerialScores) issue_dp();

      sm90::wgmma_wait<0>();  // dP^T is done
      sm90::fence_registers(dpt);
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 delta = *reinterpret_cast<const float2*>(delta_row + 8 * j + 2 * quad);
#pragma unroll
        for (int i2 = 0; i2 < 4; ++i2) {
          const int idx = 4 * j + i2;
          const float probability = kSerialScores ? fragment_value(pf, idx) : pt[idx];
          dpt[idx] = probability * (dpt[idx] - ((i2 & 1) == 0 ? delta.x : delta.y));
        }
      }
      accumulator_to_fragments<kBlockM>(dsf, dpt);

      // dV += P^T dO and dK += dS^T Q, the step's queries as the contraction (Q, dO MN-major).
      sm90::fence_registers(dv);
      sm90::fence_registers(dk);
      fence_fragments(pf);
      fence_fragments(dsf);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        sm90::WgmmaRegisterA<kV>::template mma<1>(dv, pf[kk], DoTile::mn_major(do_stage, kk), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        sm90::WgmmaRegisterA<kQk>::template mma<1>(dk, dsf[kk], QTile::mn_major(q_stage, kk), 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dv);
      sm90::fence_registers(dk);
      fence_fragments(pf);
      fence_fragments(dsf);
      release_stage(&empty[stage], lane);
      ring.advance();
    }
    // K and V's last reads of this work are done (a release inside the step loop, after the last
    // dP^T, made ptxas spill the accumulators): the next work's may load while dK and dV are stored.
    release_stage(kv_empty, lane);

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (key[h] >= p.tokens) continue;
      const int64_t row = static_cast<int64_t>(key[h]) * p.heads + b.head;
      store_row_bf16<kQk>(p.dk + row * kQk, dk, h, p.scale, quad);
      store_row_bf16<kV>(p.dv + row * kV, dv, h, 1.0f, quad);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dQ

template <int kQk, int kV>
struct DqTiling {
  static constexpr int kBlockM = kConsumerWarpgroups * kWarpgroupRows;  // 128 queries
  // Keys per tile: 128, or 96 for qk 192 (dQ's 96 accumulator registers per thread leave room for
  // 2 x 48 score registers only).
  static constexpr int kBlockN = kQk > 128 ? 96 : 128;
  using QTile = SwizzledTile<kBlockM, kQk>;
  using DoTile = SwizzledTile<kBlockM, kV>;
  using KTile = SwizzledTile<kBlockN, kQk>;
  using VTile = SwizzledTile<kBlockN, kV>;
  // K and V stages that fit beside Q and dO (and the alignment slack and barriers): 3, or 2 for
  // 128 keys of dim 128.
  static constexpr int kStages =
      QTile::kBytes + DoTile::kBytes + 3 * (KTile::kBytes + VTile::kBytes) + 2 * kSmemAlignment <= kMaxSmemBytes
          ? 3
          : 2;
  static constexpr int kDoOffset = QTile::kBytes;
  static constexpr int kKOffset = kDoOffset + DoTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KTile::kBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * VTile::kBytes;
  // q_full (Q and dO), q_empty, k_full[], v_full[], empty[], the work ring's
  static constexpr int kBarriers = 2 + 3 * kStages + WorkRing::kBarriers;
  static constexpr int kWorkOffset = kBarrierOffset + kBarriers * static_cast<int>(sizeof(uint64_t));
  static constexpr size_t kSmemBytes = kSmemAlignment + kWorkOffset + WorkRing::kBytes;
  static_assert(kSmemBytes <= kMaxSmemBytes, "the dQ stages must fit in shared memory");
};

template <int kQk, int kV>
__global__ void __launch_bounds__(kThreads, 1)
    flash_attention_backward_dq_sm90_bf16_kernel(const __grid_constant__ CUtensorMap q_map,
                                                 const __grid_constant__ CUtensorMap dout_map,
                                                 const __grid_constant__ CUtensorMap k_map,
                                                 const __grid_constant__ CUtensorMap v_map, const BackwardParams p) {
  using T = DqTiling<kQk, kV>;
  using QTile = typename T::QTile;
  using DoTile = typename T::DoTile;
  using KTile = typename T::KTile;
  using VTile = typename T::VTile;
  constexpr int kBlockN = T::kBlockN;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = align_to_swizzle(smem_raw);
  unsigned char* q_st = smem;
  unsigned char* do_st = smem + T::kDoOffset;
  unsigned char* k_st = smem + T::kKOffset;  // [kStages]
  unsigned char* v_st = smem + T::kVOffset;  // [kStages]
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + T::kBarrierOffset);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* v_full = k_full + T::kStages;
  uint64_t* empty = v_full + T::kStages;
  WorkRing work_ring(empty + T::kStages, smem + T::kWorkOffset);

  if (threadIdx.x == 0) {
    sm90::barrier_init(q_full, 1);
    sm90::barrier_init(q_empty, kConsumerWarps);
    for (int s = 0; s < T::kStages; ++s) {
      sm90::barrier_init(&k_full[s], 1);
      sm90::barrier_init(&v_full[s], 1);
      sm90::barrier_init(&empty[s], kConsumerWarps);
    }
    work_ring.init();
    sm90::fence_barrier_init();
  }
  __syncthreads();

  auto block_of = [&](int work) { return query_block<T::kBlockM, kBlockN>(work, p); };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    for (const CUtensorMap* map : {&q_map, &dout_map, &k_map, &v_map}) sm90::tma_prefetch_descriptor(map);
    RingPosition<T::kStages> ring;
    for (int w = 0;; ++w) {
      const int work = work_ring.produce(p.work_counter, p.works, w == 0);
      if (work < 0) break;
      const QueryBlock b = block_of(work);
      // Q and dO's one buffer is free once the last work's S and dP are done.
      if (w > 0) producer_wait(q_empty, (w - 1) & 1);
      sm90::barrier_arrive_expect_bytes(q_full, QTile::kBytes + DoTile::kBytes);
      load_tile<QTile>(q_st, &q_map, q_full, b.head, b.m0);
      load_tile<DoTile>(do_st, &dout_map, q_full, b.head, b.m0);
      for (int j = 0; j < b.n_tiles; ++j) {
        const int n0 = b.kv_begin + j * kBlockN;
        producer_wait(&empty[ring.stage], ring.phase ^ 1);
        sm90::barrier_arrive_expect_bytes(&k_full[ring.stage], KTile::kBytes);
        load_tile<KTile>(k_st + ring.stage * KTile::kBytes, &k_map, &k_full[ring.stage], b.head, n0);
        sm90::barrier_arrive_expect_bytes(&v_full[ring.stage], VTile::kBytes);
        load_tile<VTile>(v_st + ring.stage * VTile::kBytes, &v_map, &v_full[ring.stage], b.head, n0);
        ring.advance();
      }
    }
    drain_ring(empty, ring);
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int wg = warp / 4 - 1;
  const int quad = lane % 4;
  const int last_valid = p.tokens - 1;
  const uint32_t q_base = sm90::smem_address(q_st);
  const uint32_t do_base = sm90::smem_address(do_st);
  const uint32_t k_base = sm90::smem_address(k_st);
  const uint32_t v_base = sm90::smem_address(v_st);

  float dq[kQk / 2];
  float s[kBlockN / 2], dp[kBlockN / 2];
  uint32_t dsf[kBlockN / 16][4];

  RingPosition<T::kStages> ring;
  for (int w = 0;; ++w) {
    const int work = work_ring.consume(lane);
    if (work < 0) break;
    const QueryBlock b = block_of(work);
    const int wg_m0 = b.m0 + wg * kWarpgroupRows;
    int row[2], row_start[2];
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = wg_m0 + (warp % 4) * 16 + lane / 4 + 8 * h;
      row_start[h] = segment_start(p.cu_seqlens, p.num_segments, min(row[h], last_valid));
      // Rows past the tokens are computed but never stored.
      const bool valid = row[h] < p.tokens;
      const int64_t at = static_cast<int64_t>(b.head) * p.row_stride + row[h];
      row_lse[h] = valid ? p.lse_log2[at] : 0.0f;
      row_delta[h] = valid ? p.delta[at] : 0.0f;
    }
    const int wg_last_row_start =
        segment_start(p.cu_seqlens, p.num_segments, min(wg_m0 + kWarpgroupRows - 1, last_valid));
    auto needs_mask = [&](int n0) { return !(n0 + kBlockN - 1 <= wg_m0 && n0 >= wg_last_row_start); };
    zero(dq);

    sm90::barrier_wait(q_full, w & 1);
    for (int j = 0; j < b.n_tiles; ++j) {
      const int n0 = b.kv_begin + j * kBlockN;
      const int stage = ring.stage;
      const uint32_t k_stage = k_base + stage * KTile::kBytes;
      const uint32_t v_stage = v_base + stage * VTile::kBytes;

      sm90::barrier_wait(&k_full[stage], ring.phase);
      sm90::fence_registers(s);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQk / 16; ++kk) {
        sm90::Wgmma<kBlockN>::template mma<0, 0>(s, QTile::k_major(q_base, wg * kWarpgroupRows, kk),
                                                 KTile::k_major(k_stage, 0, kk), kk > 0 ? 1 : 0);
      }
      sm90::wgmma_commit();
      sm90::barrier_wait(&v_full[stage], ring.phase);
      sm90::fence_registers(dp);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kV / 16; ++kk) {
        sm90::Wgmma<kBlockN>::template mma<0, 0>(dp, DoTile::k_major(do_base, wg * kWarpgroupRows, kk),
                                                 VTile::k_major(v_stage, 0, kk), kk > 0 ? 1 : 0);
      }
      sm90::wgmma_commit();

      sm90::wgmma_wait<1>();  // S is done
      sm90::fence_registers(s);
      auto probabilities = [&](auto masked) {
#pragma unroll
        for (int j2 = 0; j2 < kBlockN / 8; ++j2) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[4 * j2 + 2 * h + e];
              x = fast_exp2(fmaf(x, p.scale_log2, -row_lse[h]));
              if constexpr (decltype(masked)::value) {
                const int key = n0 + 8 * j2 + 2 * quad + e;
                if (key > row[h] || key < row_start[h]) x = 0.0f;
              }
            }
          }
        }
      };
      if (needs_mask(n0)) {
        probabilities(std::true_type{});
      } else {
        probabilities(std::false_type{});
      }

      sm90::wgmma_wait<0>();  // dP is done
      sm90::fence_registers(dp);
      // Q and dO's last reads of this work are done: the next work's may load.
      if (j == b.n_tiles - 1) release_stage(q_empty, lane);
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) dp[i] = s[i] * (dp[i] - row_delta[(i >> 1) & 1]);
      accumulator_to_fragments<kBlockN>(dsf, dp);

      // dQ += dS K, the tile's keys as the contraction (K MN-major).
      sm90::fence_registers(dq);
      fence_fragments(dsf);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        sm90::WgmmaRegisterA<kQk>::template mma<1>(dq, dsf[kk], KTile::mn_major(k_stage, kk), 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(dq);
      fence_fragments(dsf);
      release_stage(&empty[stage], lane);
      ring.advance();
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] >= p.tokens) continue;
      const int64_t at = static_cast<int64_t>(row[h]) * p.heads + b.head;
      store_row_bf16<kQk>(p.dq + at * kQk, dq, h, p.scale, quad);
    }
  }
}

}  // namespace
}  // namespace flash_sm90

bool flash_attention_backward_sm90_supported(const AttentionBackwardArgs& args) {
  using namespace flash_sm90;
  if (!flash_enabled_by_environment()) return false;
  for (const TensorView* t : {&args.q, &args.k, &args.v, &args.out, &args.dout, &args.dq, &args.dk, &args.dv}) {
    if (!flash_bf16_operand(*t)) return false;
  }
  if (!flash_head_dims(args.q, args.v) || !flash_shape_fits(args.q, args.scale)) return false;
  static const bool runs = sm90_kernel_runs_here(flash_attention_backward_dq_sm90_bf16_kernel<128, 128>);
  return runs;
}

void flash_attention_backward_sm90(const AttentionBackwardArgs& args, cudaStream_t stream) {
  using namespace flash_sm90;
  const int64_t tokens = args.q.size(0), heads = args.q.size(1), qk_dim = args.q.size(2), v_dim = args.v.size(2);
  if (tokens == 0) return;
  const int64_t row_stride = head_row_stride(tokens);
  // lse log2e, delta and the two passes' work counters live in stream-ordered scratch, freed on
  // the stream after the passes.
  float* rows = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&rows), 2 * heads * row_stride * sizeof(float) + 2 * sizeof(int),
                             stream));
  float* lse_log2 = rows;
  float* delta = rows + heads * row_stride;
  int* work_counters = reinterpret_cast<int*>(rows + 2 * heads * row_stride);
  const int64_t warps = tokens * heads;
  const unsigned prep_blocks = static_cast<unsigned>((warps * 32 + kPrepThreads - 1) / kPrepThreads);
  flash_attention_backward_prep_kernel<<<prep_blocks, kPrepThreads, 0, stream>>>(
      delta, lse_log2, work_counters, static_cast<const bf16*>(args.dout.data), static_cast<const bf16*>(args.out.data),
      static_cast<const float*>(args.lse.data), static_cast<int>(tokens), static_cast<int>(heads),
      static_cast<int>(v_dim), static_cast<int>(row_stride));
  CUDA_CHECK_LAUNCH();

  BackwardParams p;
  p.dq = static_cast<bf16*>(args.dq.data);
  p.dk = static_cast<bf16*>(args.dk.data);
  p.dv = static_cast<bf16*>(args.dv.data);
  p.lse_log2 = lse_log2;
  p.delta = delta;
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  p.tokens = static_cast<int>(tokens);
  p.heads = static_cast<int>(heads);
  p.num_segments = static_cast<int>(args.cu_seqlens.numel() - 1);
  p.row_stride = static_cast<int>(row_stride);
  p.scale = static_cast<float>(args.scale);
  p.scale_log2 = p.scale * kLog2e;
  dispatch_dims(static_cast<int>(qk_dim), [&](auto qk, auto v) {
    constexpr int kQk = decltype(qk)::value, kV = decltype(v)::value;
    {
      using T = DkdvTiling<kQk, kV>;
      const CUtensorMap k_map = token_tile_map(args.k.data, tokens, heads, qk_dim, T::kBlockN);
      const CUtensorMap v_map = token_tile_map(args.v.data, tokens, heads, v_dim, T::kBlockN);
      const CUtensorMap q_map = token_tile_map(args.q.data, tokens, heads, qk_dim, T::kBlockM);
      const CUtensorMap dout_map = token_tile_map(args.dout.data, tokens, heads, v_dim, T::kBlockM);
      const CUtensorMap lse_map = head_row_map(lse_log2, tokens, heads, row_stride, T::kBlockM);
      const CUtensorMap delta_map = head_row_map(delta, tokens, heads, row_stride, T::kBlockM);
      launch_persistent<flash_attention_backward_dkdv_sm90_bf16_kernel<kQk, kV>>(
          T::kSmemBytes, T::kBlockN, &work_counters[0], p, stream, k_map, v_map, q_map, dout_map, lse_map, delta_map);
    }
    {
      using T = DqTiling<kQk, kV>;
      const CUtensorMap q_map = token_tile_map(args.q.data, tokens, heads, qk_dim, T::kBlockM);
      const CUtensorMap dout_map = token_tile_map(args.dout.data, tokens, heads, v_dim, T::kBlockM);
      const CUtensorMap k_map = token_tile_map(args.k.data, tokens, heads, qk_dim, T::kBlockN);
      const CUtensorMap v_map = token_tile_map(args.v.data, tokens, heads, v_dim, T::kBlockN);
      launch_persistent<flash_attention_backward_dq_sm90_bf16_kernel<kQk, kV>>(
          T::kSmemBytes, T::kBlockM, &work_counters[1], p, stream, q_map, dout_map, k_map, v_map);
    }
  });
  CUDA_CHECK(cudaFreeAsync(rows, stream));
}

}  // namespace moetrain::kernels::cuda_ops
