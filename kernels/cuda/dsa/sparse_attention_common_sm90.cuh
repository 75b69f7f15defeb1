// Pieces shared by the Hopper sparse attention kernels (sparse_attention_forward_sm90.cu forward,
// sparse_attention_backward_sm90.cu): DeepSeek-V3.2's latent dims, the CTA shape (a query's 64
// heads as the wgmma M, two warpgroups that both load and compute) and the cp.async gather of
// rows into the 128-byte-swizzled tiles of flash_attention_common_sm90.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/base/tensor.h"
#include "kernels/cuda/attention/flash_attention_common_sm90.cuh"

namespace moetrain::kernels::cuda_ops::sparse_sm90 {

namespace fs = flash_sm90;
using bf16 = __nv_bfloat16;

constexpr int kQk = 576;
constexpr int kV = 512;
constexpr int kHeads = 64;       // heads per CTA: the wgmma M
constexpr int kBlockKeys = 64;   // selected rows per block
constexpr int kThreads = 256;    // two warpgroups
constexpr int kWarpgroupKeys = kBlockKeys / 2;
constexpr int kLoadersPerRow = kThreads / kBlockKeys;  // 4 threads copy a row
static_assert(kThreads / kHeads == kLoadersPerRow, "Q and kv tiles have the same rows");

using QTile = fs::SwizzledTile<kHeads, kQk>;
using KvTile = fs::SwizzledTile<kBlockKeys, kQk>;
using PTile = fs::SwizzledTile<kHeads, kBlockKeys>;  // [heads, keys]: P, dS

using sm80::cp_async_16;
using sm80::cp_async_commit;
using sm80::cp_async_wait;

// Thread `part` of a row's kLoadersPerRow copies its share of one row of kCols BF16 (zeros when
// !valid) into row r of a swizzled tile of `rows` rows: 16-byte unit u of 64-column chunk c lands
// at c * rows * 128 + r * 128 + (u ^ r % 8) * 16.
template <int kCols>
__device__ __forceinline__ void copy_row(uint32_t tile, int rows, int r, int part, const bf16* src, bool valid) {
  constexpr int kUnits = kCols * 2 / 16;
  static_assert(kUnits % kLoadersPerRow == 0, "a row's copies split evenly");
#pragma unroll
  for (int i = 0; i < kUnits / kLoadersPerRow; ++i) {
    const int unit = part + kLoadersPerRow * i;
    const uint32_t dst = tile + (unit / 8) * rows * fs::kSwizzleBytes + r * fs::kSwizzleBytes +
                         (((unit % 8) ^ (r % 8)) * 16);
    cp_async_16(dst, valid ? static_cast<const void*>(src + unit * 8) : static_cast<const void*>(src), valid);
  }
}

// A BF16 pair into a swizzled K-major [heads, keys] tile (P, dS): row r, columns c and c + 1 (c even).
__device__ __forceinline__ void store_pair(unsigned char* tile, int r, int c, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(tile + r * fs::kSwizzleBytes + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2) =
      fs::pack_bf16x2(lo, hi);
}

// Host: MOETRAIN_SPARSE_ATTENTION=simt sends every call to the SIMT kernels.
inline bool simt_forced() {
  const char* value = std::getenv("MOETRAIN_SPARSE_ATTENTION");
  return value != nullptr && std::strcmp(value, "simt") == 0;
}
// A BF16 operand whose rows cp.async can copy in 16-byte units (rows of 576 or 512 BF16 are).
inline bool bf16_aligned(const TensorView& t) {
  return t.dtype == DType::kBF16 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}
// The kernel runs here (an sm_90a image on a 9.0 device) with `bytes` of shared memory.
template <typename Kernel>
bool kernel_fits_device(Kernel kernel, size_t bytes) {
  if (!fs::sm90_kernel_runs_here(kernel)) return false;
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(optin) >= bytes;
}

}  // namespace moetrain::kernels::cuda_ops::sparse_sm90
