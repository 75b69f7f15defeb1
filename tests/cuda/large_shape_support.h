// Helpers of the CUDA tests at shapes past 2^31 elements (test_cuda_large_*.cpp): an index that
// a kernel computes in 32 bits wraps there, so its outputs past that element land elsewhere or
// read the wrong inputs. The inputs are a small random block repeated along the first dimension
// (row r holds block row r % block_rows), made on the device by doubling copies, so a test needs
// no host copy of the whole tensor; the outputs are read back in sampled row ranges (the first
// rows, the rows around element 2^31, the last rows) and compared with the CPU reference of the
// block (or an independent computation on the host), which those rows must equal.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {

inline constexpr int64_t kTwoPow31 = int64_t{1} << 31;

// Whether the device can hold `gigabytes` more for a test (`what` names it); else a visible skip
// note. Counted as the device's memory less the tensors alive now and 2 GB for the context and
// library workspaces: blocks the backend's caching allocator keeps from earlier tests are free
// for this (it returns them when cudaMalloc runs out).
inline bool device_has(double gigabytes, const std::string& what) {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return false;
  const double available =
      static_cast<double>(total_bytes) - static_cast<double>(cuda::memory_stats().allocated_bytes) - 2e9;
  if (available >= gigabytes * 1e9) return true;
  const std::string note = "SKIPPED: " + what + " needs " + std::to_string(gigabytes) + " GB of device memory, " +
                           std::to_string(available / 1e9) + " GB available";
  std::printf("%s\n", note.c_str());
  WARN(note);
  return false;
}

// A device tensor [rows, block dims...] of `dtype` whose row r is row r % block_rows of `block`
// (F64 or I32 host values; rounded to dtype as upload does).
inline Tensor repeated_rows(const TensorView& block, int64_t rows, DType dtype) {
  const Tensor first = upload(block, dtype);
  Shape shape = block.shape;
  shape[0] = rows;
  Tensor big(shape, dtype, cuda::device_allocator());
  const int64_t block_rows = block.shape[0];
  int64_t filled = std::min(block_rows, rows);
  gpu().copy(big.view().slice_rows(0, filled), first.view().slice_rows(0, filled));
  while (filled < rows) {
    // Copy whole blocks of what is there, so row r keeps the pattern r % block_rows.
    const int64_t span = std::min(filled / block_rows * block_rows, rows - filled);
    gpu().copy(big.view().slice_rows(filled, filled + span), big.view().slice_rows(0, span));
    filled += span;
  }
  return big;
}

// Rows [begin, end) of a device tensor as F64 (I32 stays I32) host values.
inline Tensor download_rows(const Tensor& device, int64_t begin, int64_t end) {
  return download(device.view().slice_rows(begin, end));
}

// Block-aligned row ranges to check of a tensor of `rows` rows, `row_elements` elements each, in
// blocks of `block_rows`: the first block, the one holding element 2^31 (and the one after), the
// last whole block. Starts are multiples of block_rows, so each range holds the block's rows in order.
inline std::vector<int64_t> sampled_block_starts(int64_t rows, int64_t row_elements, int64_t block_rows) {
  const int64_t blocks = rows / block_rows;
  const int64_t at_limit = kTwoPow31 / row_elements / block_rows;
  std::vector<int64_t> starts{0};
  for (int64_t b : {at_limit, at_limit + 1, blocks - 1})
    if (b > starts.back() / block_rows && b < blocks) starts.push_back(b * block_rows);
  return starts;
}

// The F64 host rows [begin, end) of a host tensor (a reference's slice).
inline Tensor host_rows(const Tensor& host, int64_t begin, int64_t end) {
  const TensorView v = host.view().slice_rows(begin, end);
  Tensor out(v.shape, v.dtype);
  std::copy(static_cast<const char*>(v.data), static_cast<const char*>(v.data) + v.nbytes(),
            static_cast<char*>(out.data()));
  return out;
}

}  // namespace moetrain::cuda_test
