// Random MXFP4 weights on the device: a K3 layer's experts are 33B values, which the host makes
// and quantizes in minutes; here they take well under a second. The values and the encoding are
// the CPU reference's own functions (core/base/random.h, kernels/mxfp4_format.h), so the bytes
// are the same.
#include "kernels/cuda/training/random_mxfp4.h"

#include "core/base/random.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/mxfp4_format.h"

namespace moetrain::kernels::cuda_ops {
namespace {

// One thread per group of 32 values: its 16 code bytes and its scale byte.
__global__ void random_mxfp4_kernel(uint8_t* codes, uint8_t* scales, int64_t groups, int64_t cols, uint64_t first,
                                    double half_width) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= groups) return;
  const int64_t groups_per_row = cols / kMxfp4GroupSize;
  const int64_t row = group / groups_per_row, col = (group % groups_per_row) * kMxfp4GroupSize;
  const uint64_t counter = first + static_cast<uint64_t>(row * cols + col);
  double v[kMxfp4GroupSize];
  double amax = 0.0;
#pragma unroll
  for (int i = 0; i < kMxfp4GroupSize; ++i) {
    v[i] = uniform_weight(counter + i, half_width);
    amax = fmax(amax, fabs(v[i]));
  }
  const int exponent = mxfp4_exponent(amax);
  scales[group] = static_cast<uint8_t>(exponent + 127);
  uint32_t words[kMxfp4GroupSize / 8];
#pragma unroll
  for (int w = 0; w < kMxfp4GroupSize / 8; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(mxfp4_code(v[8 * w + i], exponent)) << (4 * i);
    words[w] = word;
  }
  // 16 bytes per group, 16-byte aligned (a row's codes are whole groups): one vector store.
  reinterpret_cast<uint4*>(codes)[group] = make_uint4(words[0], words[1], words[2], words[3]);
}

}  // namespace

void random_mxfp4(const RandomMxfp4Args& args, cudaStream_t stream) {
  const int64_t cols = 2 * args.codes.size(-1), groups = args.codes.numel() * 2 / kMxfp4GroupSize;
  if (groups == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (groups + kThreads - 1) / kThreads;
  random_mxfp4_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<uint8_t*>(args.codes.data), static_cast<uint8_t*>(args.scales.data), groups, cols,
      args.seed + args.first_element, args.half_width);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
