// Hopper (sm_90a) building blocks for warp-specialised tensor-core kernels, as thin inline-PTX
// wrappers (PTX ISA 8.x: mbarrier, cp.async.bulk.tensor, wgmma, setmaxnreg):
//   - mbarriers: a producer thread arms one with the bytes a stage's TMA copies will deliver,
//     consumers wait on its phase parity; consumers release a stage by arriving on another.
//   - TMA tile loads (2-D and 3-D) into shared memory, completing on an mbarrier.
//   - wgmma matrix descriptors for 128/64/32-byte swizzled tiles, and the fence / commit / wait
//     around asynchronous wgmma groups.
// Every wrapper compiles to nothing useful (a trap) without sm_90a, so a kernel built from them
// must only be launched on a 9.0 device from an sm_90a build (grouped_gemm.cu checks).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

namespace moetrain::kernels::cuda_ops::sm90 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOETRAIN_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define MOETRAIN_SM90_ASM(...) __trap()
#endif

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------------
// mbarriers

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  MOETRAIN_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// Makes initialised barriers visible to the async proxy (TMA) too; a __syncthreads follows.
__device__ __forceinline__ void fence_barrier_init() {
  MOETRAIN_SM90_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of TMA data for the current phase.
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  MOETRAIN_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
                    : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  MOETRAIN_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the phase with this parity has completed. A fresh barrier is in phase 0, so a
// wait for parity 1 returns at once (producers start that way on the 'empty' barriers).
// One try of barrier_wait: nonzero when the phase with this parity has completed (the hardware
// may wait a little before it answers no). `address` is the barrier's shared address.
__device__ __forceinline__ uint32_t barrier_try_wait(uint32_t address, uint32_t parity) {
  uint32_t done = 0;
  MOETRAIN_SM90_ASM(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(address), "r"(parity)
      : "memory");
  return done;
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t address = smem_address(bar);
  uint32_t done = 0;
  do {
    done = barrier_try_wait(address, parity);
  } while (done == 0);
}

// ---------------------------------------------------------------------------------------------
// TMA (the tensor copy engine). Coordinates are element indices, innermost first; parts of the
// box outside the tensor arrive as zeros and still count towards the barrier's bytes.

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  MOETRAIN_SM90_ASM("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  MOETRAIN_SM90_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(x), "r"(y)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
  MOETRAIN_SM90_ASM(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// Ordinary shared-memory stores made visible to the async proxy (wgmma, TMA) that reads next.
__device__ __forceinline__ void fence_proxy_async_shared() {
  MOETRAIN_SM90_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  MOETRAIN_SM90_ASM("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// stmatrix.m8n8.x4.trans: four 8x8 BF16 matrices from a warp's registers into shared memory,
// transposed. Register i of a thread holds (row lane / 4, columns 2 (lane % 4) and + 1) of matrix
// i (an mma / wgmma accumulator fragment packed to BF16, low half first); lane 8 i + t gives the
// address of the 16 bytes that receive column t of matrix i.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t address, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  MOETRAIN_SM90_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(r0),
                    "r"(r1), "r"(r2), "r"(r3)
                    : "memory");
}

// ---------------------------------------------------------------------------------------------
// Register budget per warpgroup (needs __launch_bounds__(threads, 1) on the kernel).

template <uint32_t kRegisters>
__device__ __forceinline__ void registers_release() {
  MOETRAIN_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <uint32_t kRegisters>
__device__ __forceinline__ void registers_claim() {
  MOETRAIN_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// ---------------------------------------------------------------------------------------------
// wgmma

// The descriptor's swizzle field for a tile swizzled at this many bytes (128, 64 or 32).
__host__ __device__ constexpr uint32_t swizzle_code(int swizzle_bytes) {
  return swizzle_bytes == 128 ? 1u : swizzle_bytes == 64 ? 2u : 3u;
}

// A shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading
// and stride byte offsets, each >> 4 in 14 bits; base offset 0 (tiles start on a whole swizzle
// pattern); the swizzle mode in bits 62-63.
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes,
                                                      uint32_t swizzle) {
  return static_cast<uint64_t>((address & 0x3FFFFu) >> 4) | static_cast<uint64_t>((leading_bytes & 0x3FFFFu) >> 4) << 16 |
         static_cast<uint64_t>((stride_bytes & 0x3FFFFu) >> 4) << 32 | static_cast<uint64_t>(swizzle) << 62;
}

// Before the first wgmma of a batch: orders earlier register and shared-memory accesses.
__device__ __forceinline__ void wgmma_fence() { MOETRAIN_SM90_ASM("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { MOETRAIN_SM90_ASM("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  MOETRAIN_SM90_ASM("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across an asynchronous wgmma
// (it cannot see that wgmma writes them after the instruction issues).
template <int kCount>
__device__ __forceinline__ void fence_registers(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

}  // namespace moetrain::kernels::cuda_ops::sm90
