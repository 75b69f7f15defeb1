// Hopper sparse attention forward in MQA form (kernels/ops.h SparseAttentionArgs; the CPU reference
// kernels/cpu/dsa.cpp is the spec) at DeepSeek-V3.2's latent dims: q/kv rows of 576 (512 + 64
// rope), the value the first 512 columns of the same kv row. BF16 operands, F32 softmax.
//
// One CTA per (query t, group of 64 heads): the heads are the wgmma M, since every head of a query
// reads the same selected rows (MQA). Two warpgroups, both loading and both computing:
//   - Q (64 x 576) is loaded once; the selected kv rows are gathered 64 at a time (cp.async, 16
//     bytes a copy, zeros for an entry outside [0, t]) into one of two stages, so that block b+1
//     is in flight while block b is computed. Every tile is stored in the 128-byte-swizzled
//     layout of flash_attention_common_sm90.cuh (64-column chunks), so wgmma reads it directly.
//   - S = Q K^T: warpgroup w scores keys [32 w, 32 w + 32) of the block (wgmma m64n32, 36 k-steps).
//     Invalid slots are masked to -inf; the row maxima go through shared memory so that both
//     warpgroups hold the same running max m (fmaxf of the same values), then P = 2^(S scale
//     log2e - m scale log2e) goes to a shared 64 x 64 BF16 tile (each warpgroup its 32 columns).
//   - O += P V: warpgroup w owns output columns [256 w, 256 w + 256) (a 64 x 256 F32 accumulator,
//     128 registers a thread), wgmma m64n256 with P (K-major) and V (the stage's first 512
//     columns, MN-major) from shared memory.
//   - Each warpgroup's row sums cover its own keys; the two are added (in a fixed order) at the
//     end: out = O / l, lse = m scale + ln l (natural log), as the SIMT kernel and the backward use.
// A block whose 64 entries are all invalid (the -1 tail of a short row) is skipped. The grid runs
// the last queries first (they select the most rows). Deterministic: every sum has a fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/dsa/sparse_attention.h"
#include "kernels/cuda/dsa/sparse_attention_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops {
namespace sparse_sm90 {
namespace {

constexpr int kWarpgroupV = kV / 2;
constexpr int kKvOffset = QTile::kBytes;
constexpr int kPOffset = kKvOffset + 2 * KvTile::kBytes;
constexpr int kReduceOffset = kPOffset + PTile::kBytes;            // float [2][kHeads]
constexpr int kSlotOffset = kReduceOffset + 2 * kHeads * 4;        // int [2][kBlockKeys]
constexpr size_t kSmemBytes = fs::kSmemAlignment + kSlotOffset + 2 * kBlockKeys * 4;
static_assert(kSmemBytes <= fs::kMaxSmemBytes, "Q, two kv stages and P must fit in shared memory");

struct Params {
  const bf16* q = nullptr;         // [tokens, heads, 576]
  const bf16* kv = nullptr;        // [key_offset + tokens, 576]
  const int32_t* index = nullptr;  // [tokens, top_k]
  bf16* out = nullptr;             // [tokens, heads, 512]
  float* lse = nullptr;            // [tokens, heads]
  int tokens = 0, heads = 0, top_k = 0;
  int key_offset = 0;  // query t's own key is kv row t + key_offset
  float scale_log2 = 0.0f;  // scale * log2(e), > 0
};

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_forward_sm90_bf16_kernel(const Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = fs::align_to_swizzle(smem_raw);
  const uint32_t q_base = sm90::smem_address(smem);
  const uint32_t kv_base = q_base + kKvOffset;
  const uint32_t p_base = q_base + kPOffset;
  float* reduce = reinterpret_cast<float*>(smem + kReduceOffset);  // [warpgroup][row]
  int* slots = reinterpret_cast<int*>(smem + kSlotOffset);         // [stage][key]: row, or -1

  const int t = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h0 = static_cast<int>(blockIdx.y) * kHeads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, quad = lane % 4;
  const int load_row = threadIdx.x / kLoadersPerRow, load_part = threadIdx.x % kLoadersPerRow;
  const int n_blocks = (p.top_k + kBlockKeys - 1) / kBlockKeys;
  const int32_t* index_row = p.index + static_cast<int64_t>(t) * p.top_k;

  {
    const bool valid = h0 + load_row < p.heads;
    const bf16* src = valid ? p.q + (static_cast<int64_t>(t) * p.heads + h0 + load_row) * kQk : p.q;
    copy_row<kQk>(q_base, kHeads, load_row, load_part, src, valid);
  }
  // Starts the copies of block b into `stage`; true when this thread's row is a valid entry.
  auto issue_block = [&](int b, int stage) {
    const int e = b * kBlockKeys + load_row;
    const int s = e < p.top_k ? index_row[e] : -1;
    const bool valid = s >= 0 && s <= t + p.key_offset;
    if (load_part == 0) slots[stage * kBlockKeys + load_row] = valid ? s : -1;
    copy_row<kQk>(kv_base + stage * KvTile::kBytes, kBlockKeys, load_row, load_part,
             valid ? p.kv + static_cast<int64_t>(s) * kQk : p.kv, valid);
    return valid;
  };
  bool next_valid = n_blocks > 0 && issue_block(0, 0);
  cp_async_commit();

  float o[kWarpgroupV / 2];
  float s[kWarpgroupKeys / 2];
  fs::zero(o);
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int row0 = (warp % 4) * 16 + lane / 4;  // this thread's rows: row0 and row0 + 8

  for (int b = 0; b < n_blocks; ++b) {
    const int stage = b & 1;
    // Block b has landed (this thread's copies), made visible to wgmma, and every thread is past
    // block b - 1 (so the other stage and P are free).
    cp_async_wait<0>();
    sm90::fence_proxy_async_shared();
    const bool any = __syncthreads_or(next_valid) != 0;
    next_valid = b + 1 < n_blocks && issue_block(b + 1, stage ^ 1);
    cp_async_commit();
    if (!any) continue;
    const uint32_t kv_stage = kv_base + stage * KvTile::kBytes;
    const int* stage_slots = slots + stage * kBlockKeys + wg * kWarpgroupKeys;

    sm90::fence_registers(s);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQk / 16; ++kk) {
      sm90::Wgmma<kWarpgroupKeys>::template mma<0, 0>(s, QTile::k_major(q_base, 0, kk),
                                                       KvTile::k_major(kv_stage, wg * kWarpgroupKeys, kk), kk > 0 ? 1 : 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_registers(s);

    // Mask, this warpgroup's row maxima, then the shared running max.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kWarpgroupKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = stage_slots[8 * j + 2 * quad + e] >= 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = s[4 * j + 2 * h + e];
          if (!valid) x = -INFINITY;
          tile_max[h] = fmaxf(tile_max[h], x);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fs::quad_max(tile_max[h]);
      if (quad == 0) reduce[wg * kHeads + row0 + 8 * h] = tile_max[h];
    }
    __syncthreads();
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = reduce[(1 - wg) * kHeads + row0 + 8 * h];
      const float new_max = fmaxf(row_max[h], fmaxf(tile_max[h], other));
      // A row without a valid key so far keeps max -inf: exponents against 0 give 2^-inf = 0.
      const float base = new_max == -INFINITY ? 0.0f : new_max * p.scale_log2;
      correction[h] = fs::fast_exp2(row_max[h] * p.scale_log2 - base);
      row_max[h] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kWarpgroupKeys / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = fs::fast_exp2(fmaf(x, p.scale_log2, -base));
          sum += x;
        }
      }
      row_sum[h] = row_sum[h] * correction[h] + sum;
    }
    // P (BF16) into its swizzled K-major tile: row r, columns 32 wg + 8 j + 2 quad (+1).
#pragma unroll
    for (int j = 0; j < kWarpgroupKeys / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        store_pair(smem + kPOffset, row0 + 8 * h, wg * kWarpgroupKeys + 8 * j + 2 * quad, s[4 * j + 2 * h],
                   s[4 * j + 2 * h + 1]);
#pragma unroll
    for (int i = 0; i < kWarpgroupV / 2; ++i) o[i] *= correction[(i >> 1) & 1];
    sm90::fence_proxy_async_shared();
    __syncthreads();

    sm90::fence_registers(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockKeys / 16; ++kk) {
      sm90::Wgmma<kWarpgroupV>::template mma<0, 1>(
          o, PTile::k_major(p_base, 0, kk),
          KvTile::mn_major(kv_stage + wg * (kWarpgroupV / fs::kChunkColumns) * KvTile::kChunkBytes, kk), 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_registers(o);
  }
  cp_async_wait<0>();  // no copy may land after the CTA ends

  // Row sums: each warpgroup's over its own keys, added in a fixed order.
  float partial[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) partial[h] = fs::quad_sum(row_sum[h]);
  __syncthreads();  // the last block's maxima are read
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (quad == 0) reduce[wg * kHeads + row0 + 8 * h] = partial[h];
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + 8 * h, head = h0 + r;
    if (head >= p.heads) continue;
    const float total = reduce[r] + reduce[kHeads + r];
    const int64_t row = static_cast<int64_t>(t) * p.heads + head;
    fs::store_row_bf16<kWarpgroupV>(p.out + row * kV + wg * kWarpgroupV, o, h, total > 0.0f ? 1.0f / total : 0.0f,
                                    quad);
    if (wg == 0 && quad == 0)
      p.lse[row] = total > 0.0f ? (row_max[h] * p.scale_log2 + log2f(total)) * fs::kLn2 : -INFINITY;
  }
}

}  // namespace
}  // namespace sparse_sm90

bool sparse_attention_forward_sm90_supported(const SparseAttentionArgs& args) {
  using namespace sparse_sm90;
  if (simt_forced()) return false;
  if (!bf16_aligned(args.q) || !bf16_aligned(args.kv) || !bf16_aligned(args.out)) return false;
  if (args.q.ndim() != 3 || args.q.size(2) != kQk || args.out.size(2) != kV) return false;
  if (args.q.size(0) >= (int64_t{1} << 31) || (args.q.size(1) + kHeads - 1) / kHeads > 65535) return false;
  if (!std::isfinite(args.scale) || args.scale <= 0.0) return false;
  static const bool runs = kernel_fits_device(sparse_attention_forward_sm90_bf16_kernel, kSmemBytes);
  return runs;
}

void sparse_attention_forward_sm90(const SparseAttentionArgs& args, cudaStream_t stream) {
  using namespace sparse_sm90;
  Params p;
  p.tokens = static_cast<int>(args.q.size(0));
  p.heads = static_cast<int>(args.q.size(1));
  p.top_k = static_cast<int>(args.topk_index.size(1));
  p.key_offset = static_cast<int>(args.key_offset);
  if (p.tokens == 0 || p.heads == 0) return;
  p.q = static_cast<const bf16*>(args.q.data);
  p.kv = static_cast<const bf16*>(args.kv.data);
  p.index = static_cast<const int32_t*>(args.topk_index.data);
  p.out = static_cast<bf16*>(args.out.data);
  p.lse = static_cast<float*>(args.lse.data);
  p.scale_log2 = static_cast<float>(args.scale) * fs::kLog2e;
  CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_forward_sm90_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kSmemBytes)));
  const dim3 grid(static_cast<unsigned int>(p.tokens), static_cast<unsigned int>((p.heads + kHeads - 1) / kHeads));
  sparse_attention_forward_sm90_bf16_kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
