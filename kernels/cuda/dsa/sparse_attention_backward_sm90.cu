// Hopper sparse attention backward, step 1 (per query), at the latent dims 576 / 512: the tensor-core
// twin of sparse_attention.cu's SIMT query kernel, with the same outputs: dq, and per (query,
// selected slot) the row's dkv contribution (F32, 576 columns) in the chunk's scratch, which step 2
// (sparse_attention.cu) sums per key in ascending query order. No atomics: deterministic.
//
// One CTA per query of the chunk; its heads go in groups of 64 (the wgmma M). Per group, Q (64 x
// 576) and dO (64 x 512) sit in shared memory with D = dO . O per head and lse; then per block of
// 64 selected rows (gathered by cp.async into one swizzled stage, zeros for an invalid slot):
//   S = Q K^T, dP = dO V^T     warpgroup w: keys [32 w, 32 w + 32) (wgmma m64n32), V = K[:, :512]
//   P = 2^(S scale log2e - lse log2e), dS = P (dP - D) scale   in registers (F32), 0 where invalid;
//                              both to shared [heads, keys] BF16 tiles
//   dQ += dS K                 warpgroup 0 columns [0, 256) and [512, 576), warpgroup 1 [256, 512)
//                              (F32 accumulators held across blocks)
//   dKV = dS^T Q + P^T dO      per 64-column chunk (M = keys, K = heads: dS, P read transposed),
//                              the 8 V chunks alternating between the warpgroups, the rope chunk
//                              (dS^T Q only) by warpgroup 0, each stored (the first head group) or
//                              added (later ones: the same thread owns the element) to the slot's
//                              contribution row.
// The block's rows are loaded once and read by all five products; the load is not overlapped with
// the previous block's products (Q, dO and a stage take the shared memory that a second stage
// would need).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/dsa/sparse_attention.h"
#include "kernels/cuda/dsa/sparse_attention_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace sparse_sm90 {
namespace {

using DoTile = fs::SwizzledTile<kHeads, kV>;
constexpr int kChunks = kQk / fs::kChunkColumns;  // 9 column chunks of a kv row; the first 8 are V
constexpr int kDoOffset = QTile::kBytes;
constexpr int kKvOffset = kDoOffset + DoTile::kBytes;
constexpr int kPOffset = kKvOffset + KvTile::kBytes;
constexpr int kDsOffset = kPOffset + PTile::kBytes;
constexpr int kDeltaOffset = kDsOffset + PTile::kBytes;   // float [kHeads]
constexpr int kLseOffset = kDeltaOffset + kHeads * 4;     // float [kHeads], times log2e
constexpr int kSlotOffset = kLseOffset + kHeads * 4;      // int [kBlockKeys]
constexpr size_t kSmemBytes = fs::kSmemAlignment + kSlotOffset + kBlockKeys * 4;
static_assert(kSmemBytes <= fs::kMaxSmemBytes, "Q, dO, a kv stage, P and dS must fit in shared memory");

struct BackwardParams {
  const bf16* q = nullptr;      // [tokens, heads, 576]
  const bf16* kv = nullptr;     // [key_offset + tokens, 576]
  const bf16* dout = nullptr;   // [tokens, heads, 512]
  const bf16* out = nullptr;    // [tokens, heads, 512]
  const float* lse = nullptr;   // [tokens, heads]
  const int32_t* index = nullptr;
  bf16* dq = nullptr;           // [tokens, heads, 576]
  float* contrib = nullptr;     // [chunk rows, top_k, 576]
  int heads = 0, top_k = 0, chunk_begin = 0;
  int key_offset = 0;  // query t's own key is kv row t + key_offset
  float scale = 0.0f, scale_log2 = 0.0f;
};

// A 64 x 64 chunk of the block's dkv (keys x columns [64 c, 64 c + 64)): dS^T Q (+ P^T dO when
// kValue: the chunk is V columns), stored or added to the valid slots' contribution rows when
// `write`. The products run whatever `write` says: wgmma under a branch that ptxas cannot prove
// uniform per warpgroup gets serialized.
template <bool kValue>
__device__ __forceinline__ void dkv_chunk(int c, bool write, uint32_t q_base, uint32_t do_base, uint32_t p_base,
                                          uint32_t ds_base, const int* slots, float* contrib_block, bool first_group,
                                          int row0, int quad) {
  float acc[32];
  sm90::fence_registers(acc);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeads / 16; ++kk)
    sm90::Wgmma<64>::template mma<1, 1>(acc, PTile::mn_major(ds_base, kk),
                                        QTile::mn_major(q_base + c * QTile::kChunkBytes, kk), kk > 0 ? 1 : 0);
  if constexpr (kValue) {
#pragma unroll
    for (int kk = 0; kk < kHeads / 16; ++kk)
      sm90::Wgmma<64>::template mma<1, 1>(acc, PTile::mn_major(p_base, kk),
                                          DoTile::mn_major(do_base + c * DoTile::kChunkBytes, kk), 1);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_registers(acc);
  if (!write) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 8 * h;
    if (slots[r] < 0) continue;
    float* row = contrib_block + static_cast<int64_t>(r) * kQk + c * fs::kChunkColumns + 2 * quad;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float2 value = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      float2* dst = reinterpret_cast<float2*>(row + 8 * j);
      if (!first_group) {
        const float2 before = *dst;
        value.x += before.x;
        value.y += before.y;
      }
      *dst = value;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_backward_sm90_bf16_kernel(const BackwardParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = fs::align_to_swizzle(smem_raw);
  const uint32_t q_base = sm90::smem_address(smem);
  const uint32_t do_base = q_base + kDoOffset;
  const uint32_t kv_base = q_base + kKvOffset;
  const uint32_t p_base = q_base + kPOffset;
  const uint32_t ds_base = q_base + kDsOffset;
  float* delta = reinterpret_cast<float*>(smem + kDeltaOffset);
  float* lse2 = reinterpret_cast<float*>(smem + kLseOffset);
  int* slots = reinterpret_cast<int*>(smem + kSlotOffset);

  // The chunk's last queries first: they select the most rows.
  const int local = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int t = p.chunk_begin + local;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, quad = lane % 4;
  const int load_row = threadIdx.x / kLoadersPerRow, load_part = threadIdx.x % kLoadersPerRow;
  const int n_blocks = (p.top_k + kBlockKeys - 1) / kBlockKeys;
  const int32_t* index_row = p.index + static_cast<int64_t>(t) * p.top_k;
  float* contrib = p.contrib + static_cast<int64_t>(local) * p.top_k * kQk;
  const int row0 = (warp % 4) * 16 + lane / 4;  // this thread's accumulator rows: row0, row0 + 8
  const float log2e = fs::kLog2e;

  for (int h0 = 0; h0 < p.heads; h0 += kHeads) {
    const bool first_group = h0 == 0;
    __syncthreads();  // the previous group's tiles are consumed
    {
      const int head = h0 + load_row;
      const bool valid = head < p.heads;
      const int64_t row = static_cast<int64_t>(t) * p.heads + head;
      copy_row<kQk>(q_base, kHeads, load_row, load_part, valid ? p.q + row * kQk : p.q, valid);
      copy_row<kV>(do_base, kHeads, load_row, load_part, valid ? p.dout + row * kV : p.dout, valid);
      cp_async_commit();
      // D = dO . O: a head's 4 loaders sum 128 columns each, then across the quad (fixed order).
      float d = 0.0f;
      if (valid) {
        const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(p.dout + row * kV + load_part * 128);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(p.out + row * kV + load_part * 128);
        for (int i = 0; i < 64; ++i) {
          const float2 x = __bfloat1622float2(a[i]), y = __bfloat1622float2(b[i]);
          d = fmaf(x.x, y.x, d);
          d = fmaf(x.y, y.y, d);
        }
      }
      d = fs::quad_sum(d);
      if (load_part == 0) {
        delta[load_row] = d;
        lse2[load_row] = valid ? p.lse[row] * log2e : 0.0f;
      }
    }

    float dq_a[128];  // warpgroup 0: columns [0, 256); 1: [256, 512)
    float dq_b[32];   // warpgroup 0: columns [512, 576)
    fs::zero(dq_a);
    fs::zero(dq_b);

    for (int b = 0; b < n_blocks; ++b) {
      __syncthreads();  // the previous block's stage, P and dS are consumed
      bool valid_row;
      {
        const int e = b * kBlockKeys + load_row;
        const int s = e < p.top_k ? index_row[e] : -1;
        valid_row = s >= 0 && s <= t + p.key_offset;
        if (load_part == 0) slots[load_row] = valid_row ? s : -1;
        copy_row<kQk>(kv_base, kBlockKeys, load_row, load_part, valid_row ? p.kv + static_cast<int64_t>(s) * kQk : p.kv,
                      valid_row);
        cp_async_commit();
      }
      cp_async_wait<0>();
      sm90::fence_proxy_async_shared();
      if (__syncthreads_or(valid_row) == 0) continue;

      float s_acc[16], dp_acc[16];
      sm90::fence_registers(s_acc);
      sm90::fence_registers(dp_acc);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQk / 16; ++kk)
        sm90::Wgmma<kWarpgroupKeys>::template mma<0, 0>(s_acc, QTile::k_major(q_base, 0, kk),
                                                         KvTile::k_major(kv_base, wg * kWarpgroupKeys, kk), kk > 0 ? 1 : 0);
#pragma unroll
      for (int kk = 0; kk < kV / 16; ++kk)
        sm90::Wgmma<kWarpgroupKeys>::template mma<0, 0>(dp_acc, DoTile::k_major(do_base, 0, kk),
                                                         KvTile::k_major(kv_base, wg * kWarpgroupKeys, kk), kk > 0 ? 1 : 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(s_acc);
      sm90::fence_registers(dp_acc);

#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + 8 * h;
        const bool head_valid = h0 + r < p.heads;
        const float row_lse2 = lse2[r], row_delta = delta[r];
#pragma unroll
        for (int j = 0; j < kWarpgroupKeys / 8; ++j) {
          float prob[2], dscore[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = wg * kWarpgroupKeys + 8 * j + 2 * quad + e;
            const bool valid = head_valid && slots[key] >= 0;
            const int i = 4 * j + 2 * h + e;
            prob[e] = valid ? fs::fast_exp2(fmaf(s_acc[i], p.scale_log2, -row_lse2)) : 0.0f;
            dscore[e] = prob[e] * (dp_acc[i] - row_delta) * p.scale;
          }
          const int c = wg * kWarpgroupKeys + 8 * j + 2 * quad;
          store_pair(smem + kPOffset, r, c, prob[0], prob[1]);
          store_pair(smem + kDsOffset, r, c, dscore[0], dscore[1]);
        }
      }
      sm90::fence_proxy_async_shared();
      __syncthreads();

      // dQ += dS K, left in flight while the dkv chunks start (their first wait covers it). Both
      // warpgroups run the [512, 576) product (uniform code, see dkv_chunk); warpgroup 1's is unused.
      sm90::fence_registers(dq_a);
      sm90::fence_registers(dq_b);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockKeys / 16; ++kk) {
        sm90::Wgmma<256>::template mma<0, 1>(dq_a, PTile::k_major(ds_base, 0, kk),
                                             KvTile::mn_major(kv_base + wg * 4 * KvTile::kChunkBytes, kk), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockKeys / 16; ++kk)
        sm90::Wgmma<64>::template mma<0, 1>(dq_b, PTile::k_major(ds_base, 0, kk),
                                            KvTile::mn_major(kv_base + 8 * KvTile::kChunkBytes, kk), 1);
      sm90::wgmma_commit();

      // dkv: V chunks 2 i + wg to each warpgroup, the rope chunk (dS^T Q only) written by warpgroup 0.
      float* contrib_block = contrib + static_cast<int64_t>(b) * kBlockKeys * kQk;
#pragma unroll 1
      for (int i = 0; i < kV / fs::kChunkColumns / 2; ++i)
        dkv_chunk<true>(2 * i + wg, true, q_base, do_base, p_base, ds_base, slots, contrib_block, first_group, row0,
                        quad);
      dkv_chunk<false>(kChunks - 1, wg == 0, q_base, do_base, p_base, ds_base, slots, contrib_block, first_group,
                       row0, quad);
      sm90::fence_registers(dq_a);
      sm90::fence_registers(dq_b);
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = h0 + row0 + 8 * h;
      if (head >= p.heads) continue;
      bf16* dst = p.dq + (static_cast<int64_t>(t) * p.heads + head) * kQk;
      fs::store_row_bf16<256>(dst + wg * 256, dq_a, h, 1.0f, quad);
      if (wg == 0) fs::store_row_bf16<64>(dst + 512, dq_b, h, 1.0f, quad);
    }
  }
  cp_async_wait<0>();
}

}  // namespace
}  // namespace sparse_sm90

bool sparse_attention_backward_sm90_supported(const SparseAttentionBackwardArgs& args) {
  using namespace sparse_sm90;
  if (simt_forced()) return false;
  for (const TensorView* t : {&args.q, &args.kv, &args.dout, &args.out, &args.dq})
    if (!bf16_aligned(*t)) return false;
  if (args.q.ndim() != 3 || args.q.size(2) != kQk || args.out.size(2) != kV || args.q.size(1) == 0) return false;
  if (args.q.size(0) >= (int64_t{1} << 31)) return false;
  if (!std::isfinite(args.scale) || args.scale <= 0.0) return false;
  static const bool runs = kernel_fits_device(sparse_attention_backward_sm90_bf16_kernel, kSmemBytes);
  return runs;
}

void sparse_attention_backward_sm90_queries(const SparseAttentionBackwardArgs& args, float* contrib,
                                            int64_t chunk_begin, int64_t rows, cudaStream_t stream) {
  using namespace sparse_sm90;
  if (rows <= 0) return;
  BackwardParams p;
  p.q = static_cast<const bf16*>(args.q.data);
  p.kv = static_cast<const bf16*>(args.kv.data);
  p.dout = static_cast<const bf16*>(args.dout.data);
  p.out = static_cast<const bf16*>(args.out.data);
  p.lse = static_cast<const float*>(args.lse.data);
  p.index = static_cast<const int32_t*>(args.topk_index.data);
  p.dq = static_cast<bf16*>(args.dq.data);
  p.contrib = contrib;
  p.heads = static_cast<int>(args.q.size(1));
  p.top_k = static_cast<int>(args.topk_index.size(1));
  p.chunk_begin = static_cast<int>(chunk_begin);
  p.key_offset = static_cast<int>(args.key_offset);
  p.scale = static_cast<float>(args.scale);
  p.scale_log2 = p.scale * fs::kLog2e;
  CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_backward_sm90_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kSmemBytes)));
  sparse_attention_backward_sm90_bf16_kernel<<<static_cast<unsigned int>(rows), kThreads, kSmemBytes, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
