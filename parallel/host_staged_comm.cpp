// HostStagedCommunicator (see host_staged_comm.h). Compiles to nothing without the CUDA
// backend, so the parallel library's *.cpp glob can include it in every build.
#ifdef MOETRAIN_HAVE_CUDA

#include "parallel/host_staged_comm.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/bf16.h"
#include "core/base/error.h"
#include "parallel/checks.h"

namespace moetrain {
namespace {

using Bytes = std::vector<uint8_t>;

size_t bytes_of(int64_t count, DType dtype) { return static_cast<size_t>(count) * dtype_size(dtype); }

// Host copies of device memory. Each waits for the device first, so that the copy sees the
// work queued on every stream, and after copying in, waits until the bytes have landed (a copy
// from pageable memory may return before its DMA ends, and the consumer's stream may be a
// non-blocking one that the copy does not order).
void wait_for_device() { CUDA_RUNTIME_CHECK(cudaDeviceSynchronize()); }

Bytes copy_out(const void* device, int64_t count, DType dtype) {
  Bytes host(bytes_of(count, dtype));
  if (!host.empty()) CUDA_RUNTIME_CHECK(cudaMemcpy(host.data(), device, host.size(), cudaMemcpyDeviceToHost));
  return host;
}

void copy_in(void* device, const void* host, size_t bytes) {
  if (bytes > 0) CUDA_RUNTIME_CHECK(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
}

bool needs_f32(DType dtype) { return dtype == DType::kBF16; }

// A layout in elements as the same layout in bytes, for moving any dtype as uint8_t.
AllToAllLayout in_bytes(const AllToAllLayout& layout, DType dtype) {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  AllToAllLayout bytes = layout;
  for (auto* v : {&bytes.send_counts, &bytes.send_offsets, &bytes.recv_counts, &bytes.recv_offsets}) {
    for (int64_t& x : *v) x *= elem;
  }
  return bytes;
}

// The typed host collective for a sum or max of `dtype` (BF16 is widened to F32 before this).
template <typename Run>
void with_host_type(DType dtype, Run&& run) {
  switch (dtype) {
    case DType::kF32: return run(float{});
    case DType::kF64: return run(double{});
    case DType::kI32: return run(int32_t{});
    case DType::kI64: return run(int64_t{});
    default:
      throw Error(ExitCode::kInternal, std::string("HostStagedCommunicator cannot reduce ") + dtype_name(dtype) +
                                           " (reductions: F32, F64, I32, I64, BF16)");
  }
}

std::vector<float> to_f32(const Bytes& bf16) {
  std::vector<float> out(bf16.size() / sizeof(uint16_t));
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bf16.data() + i * sizeof bits, sizeof bits);
    out[i] = bf16_to_float(bits);
  }
  return out;
}

Bytes to_bf16(const std::vector<float>& f32) {
  Bytes out(f32.size() * sizeof(uint16_t));
  for (size_t i = 0; i < f32.size(); ++i) {
    const uint16_t bits = float_to_bf16(f32[i]);
    std::memcpy(out.data() + i * sizeof bits, &bits, sizeof bits);
  }
  return out;
}

}  // namespace

HostStagedCommunicator::HostStagedCommunicator(MPI_Comm group) : host_(group) {}

void HostStagedCommunicator::barrier() {
  wait_for_device();
  host_.barrier();
}

void HostStagedCommunicator::all_gather_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  wait_for_device();
  const Bytes mine = copy_out(in, count_per_rank, dtype);
  Bytes all(bytes_of(count_per_rank * size(), dtype));
  host_.all_gather<uint8_t>(all.data(), mine.data(), static_cast<int64_t>(mine.size()));
  copy_in(out, all.data(), all.size());
  wait_for_device();
}

void HostStagedCommunicator::reduce_scatter_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  wait_for_device();
  const Bytes parts = copy_out(in, count_per_rank * size(), dtype);
  if (needs_f32(dtype)) {
    const std::vector<float> wide = to_f32(parts);
    std::vector<float> sum(static_cast<size_t>(count_per_rank));
    host_.reduce_scatter(sum.data(), wide.data(), count_per_rank);
    const Bytes narrow = to_bf16(sum);
    copy_in(out, narrow.data(), narrow.size());
  } else {
    Bytes sum(bytes_of(count_per_rank, dtype));
    with_host_type(dtype, [&](auto type) {
      using T = decltype(type);
      host_.reduce_scatter(reinterpret_cast<T*>(sum.data()), reinterpret_cast<const T*>(parts.data()), count_per_rank);
    });
    copy_in(out, sum.data(), sum.size());
  }
  wait_for_device();
}

void HostStagedCommunicator::all_reduce_elements(void* data, int64_t count, DType dtype, ReduceOp op) {
  wait_for_device();
  Bytes values = copy_out(data, count, dtype);
  if (needs_f32(dtype)) {
    std::vector<float> wide = to_f32(values);
    host_.all_reduce(wide.data(), count, op);
    values = to_bf16(wide);
  } else {
    with_host_type(dtype, [&](auto type) {
      using T = decltype(type);
      host_.all_reduce(reinterpret_cast<T*>(values.data()), count, op);
    });
  }
  copy_in(data, values.data(), values.size());
  wait_for_device();
}

void HostStagedCommunicator::all_to_all_v_elements(void* out, const void* in, const AllToAllLayout& layout,
                                                   DType dtype) {
  wait_for_device();
  const Bytes sent = copy_out(in, layout.send_extent(), dtype);
  Bytes received(bytes_of(layout.recv_extent(), dtype));
  host_.all_to_all_v<uint8_t>(received.data(), sent.data(), in_bytes(layout, dtype));
  // Only the received ranges: the gaps between them keep what the device holds there.
  const size_t elem = dtype_size(dtype);
  for (size_t peer = 0; peer < layout.recv_counts.size(); ++peer) {
    const size_t at = static_cast<size_t>(layout.recv_offsets[peer]) * elem;
    copy_in(static_cast<uint8_t*>(out) + at, received.data() + at, bytes_of(layout.recv_counts[peer], dtype));
  }
  wait_for_device();
}

void HostStagedCommunicator::broadcast_elements(void* data, int64_t count, DType dtype, int root) {
  wait_for_device();
  Bytes values = rank() == root ? copy_out(data, count, dtype) : Bytes(bytes_of(count, dtype));
  host_.broadcast<uint8_t>(values.data(), static_cast<int64_t>(values.size()), root);
  if (rank() != root) copy_in(data, values.data(), values.size());
  wait_for_device();
}

}  // namespace moetrain

#endif  // MOETRAIN_HAVE_CUDA
