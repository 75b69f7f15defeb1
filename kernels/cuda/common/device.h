// The thin device layer: how many GPUs, which one this thread uses, device memory through the
// tensor Allocator interface, and copies between host and device. No CUDA types here, so host
// code (core/, apps/) can use it without nvcc; built only with the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/base/tensor.h"

namespace moetrain::cuda {

// Number of usable GPUs; 0 (not an error) without a driver or without a GPU.
int device_count();
void set_device(int device);
int current_device();
// The current GPU's multiprocessors (asked once per device): persistent kernels launch a CTA per
// multiprocessor.
int multiprocessor_count();

// Device memory behind core's Allocator: `Tensor t(shape, dtype, cuda::device_allocator())`.
// A cache of freed blocks in front of cudaMalloc/cudaFree (kernels/caching_allocator.h), or
// with MOETRAIN_CUDA_ALLOCATOR=direct one cudaMalloc/cudaFree per tensor.
// Running out of memory is an Error naming the request and what was free.
Allocator& device_allocator();

// Tensor memory: what tensors hold now and at the peak since the start or the last
// reset_peak_memory() (with the caching allocator, without its cached free blocks). The CUDA
// context, cuBLAS workspaces and NCCL buffers are outside it; device_used_bytes() sees
// everything on the device, other processes included.
struct MemoryStats {
  size_t allocated_bytes = 0;
  size_t peak_bytes = 0;
  int64_t allocations = 0;  // cudaMalloc calls so far
};
MemoryStats memory_stats();
// The current GPU's datasheet dense BF16 tensor rate in FLOP/s (the MFU denominator), from its
// name; 0 for a GPU not in the table (MFU is then not reported).
double peak_bf16_flops();
void reset_peak_memory();
size_t device_used_bytes();

// Blocking copies (they return when the data has arrived).
void copy_host_to_device(void* device_dst, const void* host_src, size_t bytes);
void copy_device_to_host(void* host_dst, const void* device_src, size_t bytes);
void copy_device_to_device(void* device_dst, const void* device_src, size_t bytes);
// Waits for all work on the current device; surfaces asynchronous kernel errors as an Error.
void synchronize();

}  // namespace moetrain::cuda
