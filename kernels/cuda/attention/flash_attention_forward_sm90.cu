// Hopper flash attention forward (see flash_attention_sm90.h; the CPU reference is the spec).
//
// Persistent (WorkRing, flash_attention_common_sm90.cuh): a CTA per multiprocessor takes works of
// (128 queries, head) in ordered_block's order: heads in groups of at least 4, each group's
// blocks last-first, since causal blocks further down see more keys, so that the pass ends on
// short blocks and a group's K and V stay in L2.
// Warpgroup 0 produces: one thread takes the works, loads each work's Q block (one buffer, given
// back once the work's last scores are done, so the next work's Q and first K and V tiles load
// while the consumers finish the last) and streams 128-key tiles of K and V by TMA through two
// rings of stages that run on from work to work, K and V apart (a 'full' and an 'empty' mbarrier
// per stage each; the 8 consumer warps arrive on 'empty'), so that the scores can start before V
// lands and a K stage is given back as soon as its scores are done. Warpgroups 1 and 2 own 64
// queries each:
//   S = Q K^T           wgmma, both from shared memory (K-major), F32 in registers
//   online softmax      per row: running max m and sum l in F32, P = 2^(S scale log2e - m')
//   O += P V            wgmma with P from registers (the S accumulator packed to BF16 is the A
//                       fragment) and V from shared memory (MN-major)
// Overlap, as in FlashAttention-3: within a warpgroup, tile j's S = Q K_j^T and tile j-1's
// O += P V are issued together and the softmax of S_j runs while P V is in flight (O is rescaled
// once that completes); between the two warpgroups, named barriers make them take turns issuing
// their matmuls ("ping-pong"), so that one's softmax runs while the other's matmuls hold the
// tensor cores. At the end O / l is stored (BF16) and lse = m scale + ln l (natural log).
//
// Keys: from the segment start of the block's first query to its last query, in tiles that start
// there (so a packed document costs what it costs alone). Masking is per (query t, key s):
// start(t) <= s <= t, with start(t) found once per row; a warpgroup skips the mask on tiles that
// lie wholly before its first row and after its last row's segment start.
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

template <int kQk, int kV>
struct ForwardTiling {
  static constexpr int kBlockM = kConsumerWarpgroups * kWarpgroupRows;  // 128 queries
  static constexpr int kBlockN = 128;                                   // keys per tile
  // K and V stages that fit beside Q in 227 KB: 3 up to 128/128, 2 for 192/128 (with the K and V
  // rings apart, 2 still leave a whole tile's time to each load).
  static constexpr int kStages = kQk + kV <= 256 ? 3 : 2;
  using QTile = SwizzledTile<kBlockM, kQk>;
  using KTile = SwizzledTile<kBlockN, kQk>;
  using VTile = SwizzledTile<kBlockN, kV>;
  static constexpr int kKOffset = QTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KTile::kBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * VTile::kBytes;
  // q_full, q_empty, k_full[], v_full[], k_empty[], v_empty[], the work ring's
  static constexpr int kBarriers = 2 + 4 * kStages + WorkRing::kBarriers;
  static constexpr int kWorkOffset = kBarrierOffset + kBarriers * static_cast<int>(sizeof(uint64_t));
  static constexpr size_t kSmemBytes = kSmemAlignment + kWorkOffset + WorkRing::kBytes;
  static_assert(kSmemBytes <= kMaxSmemBytes, "the forward's stages must fit in shared memory");
  static_assert(kBlockN % 16 == 0 && kQk % 16 == 0, "whole wgmma k-steps");
};

struct ForwardParams {
  bf16* out = nullptr;
  float* lse = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int tokens = 0;
  int heads = 0;
  int num_segments = 0;
  float scale_log2 = 0.0f;  // scale * log2(e), > 0
  int blocks_per_head = 0;
  int order_group = 1;  // ordered_block's head group
  int works = 0;        // blocks_per_head x heads
  int* work_counter = nullptr;
};

// The warpgroup's rows and what masking them needs.
struct RowInfo {
  int row[2];        // this thread's two query rows (g and g + 8 of its warp's 16)
  int row_start[2];  // their segment starts
  int wg_first_row;
  int wg_last_row_start;  // the latest segment start among the warpgroup's (valid) rows
};

__device__ __forceinline__ RowInfo row_info(const ForwardParams& p, int wg_m0, int warp_in_wg, int lane) {
  RowInfo r;
  r.wg_first_row = wg_m0;
  const int last_valid = p.tokens - 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    r.row[h] = wg_m0 + warp_in_wg * 16 + lane / 4 + 8 * h;
    // Rows past the tokens are computed but never stored; any start keeps them finite.
    r.row_start[h] = segment_start(p.cu_seqlens, p.num_segments, min(r.row[h], last_valid));
  }
  r.wg_last_row_start = segment_start(p.cu_seqlens, p.num_segments, min(wg_m0 + kWarpgroupRows - 1, last_valid));
  return r;
}

// Masks the scores of key tile n0 (if kMasked), then the online-softmax step: new running max,
// S -> P = 2^(S scale log2e - m') in place, the factor the old O and l are scaled by, l updated with
// this thread's part of the row sums (the quad's parts are added at the end).
template <bool kMasked, int kN>
__device__ __forceinline__ void softmax_step(float (&s)[kN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&correction)[2], const RowInfo& rows, int n0, int quad,
                                             float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        if constexpr (kMasked) {
          const int key = n0 + 8 * j + 2 * quad + e;
          if (key > rows.row[h] || key < rows.row_start[h]) x = -INFINITY;
        }
        tile_max = fmaxf(tile_max, x);
      }
    }
    tile_max = quad_max(tile_max);
    const float new_max = fmaxf(row_max[h], tile_max);
    // A row that has seen no visible key yet keeps max -inf: exponents are then taken against 0
    // so that 2^(-inf) = 0, never NaN.
    const float base = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
    correction[h] = fast_exp2(row_max[h] * scale_log2 - base);
    row_max[h] = new_max;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = fast_exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    }
    row_sum[h] = row_sum[h] * correction[h] + sum;
  }
}

// Ping-pong between the consumer warpgroups: warpgroup w waits on named barrier kTurnBarrier + w
// before issuing its matmuls and, once issued, arrives on the other's. Warpgroup 0 goes first
// (warpgroup 1 arrives once up front), then they alternate; both issue the same number of times,
// and warpgroup 0 waits once more at the end (for warpgroup 1's last arrival), so every barrier
// phase gets its 256 threads (128 waiting, 128 arriving).
constexpr uint32_t kTurnBarrier = 1;  // ids 1 and 2 (0 is __syncthreads)
constexpr uint32_t kTurnThreads = 2 * kWarpgroupThreads;

__device__ __forceinline__ void wait_for_turn(int wg) { sm90::named_barrier_sync(kTurnBarrier + wg, kTurnThreads); }
__device__ __forceinline__ void pass_turn(int wg) { named_barrier_arrive(kTurnBarrier + (1 - wg), kTurnThreads); }

template <int kQk, int kV>
__global__ void __launch_bounds__(kThreads, 1)
    flash_attention_forward_sm90_bf16_kernel(const __grid_constant__ CUtensorMap q_map,
                                             const __grid_constant__ CUtensorMap k_map,
                                             const __grid_constant__ CUtensorMap v_map, const ForwardParams p) {
  using T = ForwardTiling<kQk, kV>;
  using QTile = typename T::QTile;
  using KTile = typename T::KTile;
  using VTile = typename T::VTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = align_to_swizzle(smem_raw);
  unsigned char* q_st = smem;
  unsigned char* k_st = smem + T::kKOffset;  // [kStages]
  unsigned char* v_st = smem + T::kVOffset;  // [kStages]
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + T::kBarrierOffset);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* v_full = k_full + T::kStages;
  uint64_t* k_empty = v_full + T::kStages;
  uint64_t* v_empty = k_empty + T::kStages;
  WorkRing work_ring(v_empty + T::kStages, smem + T::kWorkOffset);

  if (threadIdx.x == 0) {
    sm90::barrier_init(q_full, 1);
    sm90::barrier_init(q_empty, kConsumerWarps);
    for (int s = 0; s < T::kStages; ++s) {
      sm90::barrier_init(&k_full[s], 1);
      sm90::barrier_init(&v_full[s], 1);
      sm90::barrier_init(&k_empty[s], kConsumerWarps);
      sm90::barrier_init(&v_empty[s], kConsumerWarps);
    }
    work_ring.init();
    sm90::fence_barrier_init();
  }
  __syncthreads();

  auto block_of = [&](int work) { return query_block<T::kBlockM, T::kBlockN>(work, p); };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    sm90::registers_release<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::tma_prefetch_descriptor(&q_map);
    sm90::tma_prefetch_descriptor(&k_map);
    sm90::tma_prefetch_descriptor(&v_map);
    RingPosition<T::kStages> ring;
    for (int w = 0;; ++w) {
      const int work = work_ring.produce(p.work_counter, p.works, w == 0);
      if (work < 0) break;
      const QueryBlock b = block_of(work);
      // Q's one buffer is free once the last work's scores are done.
      if (w > 0) producer_wait(q_empty, (w - 1) & 1);
      sm90::barrier_arrive_expect_bytes(q_full, QTile::kBytes);
      load_tile<QTile>(q_st, &q_map, q_full, b.head, b.m0);
      for (int j = 0; j < b.n_tiles; ++j) {
        const int n0 = b.kv_begin + j * T::kBlockN;
        producer_wait(&k_empty[ring.stage], ring.phase ^ 1);
        sm90::barrier_arrive_expect_bytes(&k_full[ring.stage], KTile::kBytes);
        load_tile<KTile>(k_st + ring.stage * KTile::kBytes, &k_map, &k_full[ring.stage], b.head, n0);
        producer_wait(&v_empty[ring.stage], ring.phase ^ 1);
        sm90::barrier_arrive_expect_bytes(&v_full[ring.stage], VTile::kBytes);
        load_tile<VTile>(v_st + ring.stage * VTile::kBytes, &v_map, &v_full[ring.stage], b.head, n0);
        ring.advance();
      }
    }
    drain_ring(k_empty, ring);
    drain_ring(v_empty, ring);
    return;
  }

  sm90::registers_claim<kConsumerRegisters>();
  const int wg = warp / 4 - 1;
  const int quad = lane % 4;
  const uint32_t q_base = sm90::smem_address(q_st);
  const uint32_t k_base = sm90::smem_address(k_st);
  const uint32_t v_base = sm90::smem_address(v_st);

  float s[T::kBlockN / 2];
  float o[kV / 2];
  uint32_t pf[T::kBlockN / 16][4];

  auto issue_scores = [&](int stage) {
    const uint32_t k_stage = k_base + stage * KTile::kBytes;
    sm90::fence_registers(s);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQk / 16; ++kk) {
      sm90::Wgmma<T::kBlockN>::template mma<0, 0>(s, QTile::k_major(q_base, wg * kWarpgroupRows, kk),
                                                   KTile::k_major(k_stage, 0, kk), kk > 0 ? 1 : 0);
    }
    sm90::wgmma_commit();
  };
  auto issue_pv = [&](int stage) {
    const uint32_t v_stage = v_base + stage * VTile::kBytes;
    sm90::fence_registers(o);
    fence_fragments(pf);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < T::kBlockN / 16; ++kk) {
      sm90::WgmmaRegisterA<kV>::template mma<1>(o, pf[kk], VTile::mn_major(v_stage, kk), 1);
    }
    sm90::wgmma_commit();
  };

  if (wg == 1) pass_turn(wg);  // warpgroup 0 issues first
  RingPosition<T::kStages> ring;
  for (int w = 0;; ++w) {
    const int work = work_ring.consume(lane);
    if (work < 0) break;
    const QueryBlock b = block_of(work);
    const RowInfo rows = row_info(p, b.m0 + wg * kWarpgroupRows, warp % 4, lane);
    zero(o);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, correction[2];
    // A tile needs no mask when every key precedes the warpgroup's first row and follows its last
    // row's segment start (rows past the tokens are never stored, so they do not count).
    auto softmax = [&](int n0) {
      if (!(n0 + T::kBlockN - 1 <= rows.wg_first_row && n0 >= rows.wg_last_row_start)) {
        softmax_step<true, T::kBlockN>(s, row_max, row_sum, correction, rows, n0, quad, p.scale_log2);
      } else {
        softmax_step<false, T::kBlockN>(s, row_max, row_sum, correction, rows, n0, quad, p.scale_log2);
      }
    };
    // Q's buffer is given back as soon as the work's last scores are done.
    auto scores_done = [&](int j) {
      if (j == b.n_tiles - 1) release_stage(q_empty, lane);
    };

    sm90::barrier_wait(q_full, w & 1);
    // Tile 0: scores and softmax only (O is zero, so its correction does not matter).
    sm90::barrier_wait(&k_full[ring.stage], ring.phase);
    wait_for_turn(wg);
    issue_scores(ring.stage);
    pass_turn(wg);
    sm90::wgmma_wait<0>();
    sm90::fence_registers(s);
    release_stage(&k_empty[ring.stage], lane);
    scores_done(0);
    softmax(b.kv_begin);
    accumulator_to_fragments<T::kBlockN>(pf, s);

    for (int j = 1; j < b.n_tiles; ++j) {
      RingPosition<T::kStages> next = ring;
      next.advance();
      sm90::barrier_wait(&k_full[next.stage], next.phase);
      wait_for_turn(wg);
      issue_scores(next.stage);                              // S_j = Q K_j^T
      sm90::barrier_wait(&v_full[ring.stage], ring.phase);
      issue_pv(ring.stage);                                  // O += P_{j-1} V_{j-1}
      pass_turn(wg);
      sm90::wgmma_wait<1>();                                 // S_j is done, P V may still run
      sm90::fence_registers(s);
      release_stage(&k_empty[next.stage], lane);
      scores_done(j);
      softmax(b.kv_begin + j * T::kBlockN);
      sm90::wgmma_wait<0>();
      sm90::fence_registers(o);
      fence_fragments(pf);
      release_stage(&v_empty[ring.stage], lane);
#pragma unroll
      for (int i = 0; i < kV / 2; ++i) o[i] *= correction[(i >> 1) & 1];
      accumulator_to_fragments<T::kBlockN>(pf, s);
      ring = next;
    }
    sm90::barrier_wait(&v_full[ring.stage], ring.phase);
    wait_for_turn(wg);
    issue_pv(ring.stage);
    pass_turn(wg);
    sm90::wgmma_wait<0>();
    sm90::fence_registers(o);
    fence_fragments(pf);
    release_stage(&v_empty[ring.stage], lane);
    ring.advance();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = rows.row[h];
      const float total = quad_sum(row_sum[h]);
      if (t >= p.tokens) continue;
      // Every row sees its own key, so total >= 1 (its largest term is 2^0).
      const int64_t row = static_cast<int64_t>(t) * p.heads + b.head;
      store_row_bf16<kV>(p.out + row * kV, o, h, 1.0f / total, quad);
      if (quad == 0) p.lse[row] = (row_max[h] * p.scale_log2 + log2f(total)) * kLn2;
    }
  }
  // Warpgroup 1 passed the turn after its last issue as after every other: take that arrival, so
  // that both named barriers end with every phase complete.
  if (wg == 0) wait_for_turn(wg);
}

}  // namespace
}  // namespace flash_sm90

bool flash_attention_forward_sm90_supported(const AttentionArgs& args) {
  using namespace flash_sm90;
  if (!flash_enabled_by_environment()) return false;
  for (const TensorView* t : {&args.q, &args.k, &args.v, &args.out}) {
    if (!flash_bf16_operand(*t)) return false;
  }
  if (!flash_head_dims(args.q, args.v) || !flash_shape_fits(args.q, args.scale)) return false;
  static const bool runs = sm90_kernel_runs_here(flash_attention_forward_sm90_bf16_kernel<128, 128>);
  return runs;
}

void flash_attention_forward_sm90(const AttentionArgs& args, cudaStream_t stream) {
  using namespace flash_sm90;
  const int64_t tokens = args.q.size(0), heads = args.q.size(1), qk_dim = args.q.size(2), v_dim = args.v.size(2);
  if (tokens == 0) return;
  ForwardParams p;
  p.out = static_cast<bf16*>(args.out.data);
  p.lse = static_cast<float*>(args.lse.data);
  p.cu_seqlens = static_cast<const int32_t*>(args.cu_seqlens.data);
  p.tokens = static_cast<int>(tokens);
  p.heads = static_cast<int>(heads);
  p.num_segments = static_cast<int>(args.cu_seqlens.numel() - 1);
  p.scale_log2 = static_cast<float>(args.scale) * kLog2e;
  // The persistent launch's work counter, in stream-ordered scratch, zeroed on the stream.
  int* counter = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&counter), sizeof(int), stream));
  CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(int), stream));
  dispatch_dims(static_cast<int>(qk_dim), [&](auto qk, auto v) {
    constexpr int kQk = decltype(qk)::value, kV = decltype(v)::value;
    using T = ForwardTiling<kQk, kV>;
    const CUtensorMap q_map = token_tile_map(args.q.data, tokens, heads, qk_dim, T::kBlockM);
    const CUtensorMap k_map = token_tile_map(args.k.data, tokens, heads, qk_dim, T::kBlockN);
    const CUtensorMap v_map = token_tile_map(args.v.data, tokens, heads, v_dim, T::kBlockN);
    launch_persistent<flash_attention_forward_sm90_bf16_kernel<kQk, kV>>(T::kSmemBytes, T::kBlockM, counter, p, stream,
                                                                         q_map, k_map, v_map);
  });
  CUDA_CHECK(cudaFreeAsync(counter, stream));
}

}  // namespace moetrain::kernels::cuda_ops
