#include "kernels/cuda/training/cross_entropy.h"

#include <cmath>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 512;

// A running (max, sum of exp(x - max)) pair; merging is commutative, so the butterfly below
// gives every lane the same bits.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  const float sa = a.max == -INFINITY ? 0.0f : a.sum * expf(a.max - m);
  const float sb = b.max == -INFINITY ? 0.0f : b.sum * expf(b.max - m);
  return {m, sa + sb};
}

__device__ __forceinline__ MaxSum block_merge(MaxSum v, MaxSum* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  return v;
}

template <int kChunk>
__global__ void cross_entropy_kernel(float* __restrict__ loss, MutOperand dlogits, ConstOperand logits,
                                     const int32_t* __restrict__ labels, int64_t vocab, float grad_scale) {
  __shared__ MaxSum scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t base = row * vocab;
  const int64_t chunks = vocab / kChunk;
  const int32_t label = labels[row];
  const bool want_grad = dlogits.data != nullptr;
  if (label < 0 || label >= vocab) {  // the whole block takes this branch
    const float value = label < 0 ? 0.0f : nanf("");
    if (threadIdx.x == 0) loss[row] = value;
    if (want_grad) {
      float v[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] = value;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) store_chunk<kChunk>(dlogits, base + c * kChunk, v);
    }
    return;
  }
  // Read before any thread writes dlogits (which may alias logits): the barrier in block_merge
  // orders it before the gradient pass.
  const float label_logit = load_one(logits, base + label);
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk];
    load_chunk<kChunk>(v, logits, base + c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      if (v[e] > acc.max) {
        acc.sum = (acc.max == -INFINITY ? 0.0f : acc.sum * expf(acc.max - v[e])) + 1.0f;
        acc.max = v[e];
      } else {
        acc.sum += expf(v[e] - acc.max);
      }
    }
  }
  const MaxSum total = block_merge(acc, scratch);
  const float lse = total.max + logf(total.sum);
  if (threadIdx.x == 0) loss[row] = lse - label_logit;
  if (!want_grad) return;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kChunk];
    load_chunk<kChunk>(v, logits, base + c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      v[e] = expf(v[e] - lse) * grad_scale;
      if (c * kChunk + e == label) v[e] -= grad_scale;
    }
    store_chunk<kChunk>(dlogits, base + c * kChunk, v);
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void cross_entropy(const CrossEntropyArgs& args, cudaStream_t stream) {
  const int64_t rows = args.logits.size(0), vocab = args.logits.size(1);
  if (rows == 0) return;
  auto* loss = static_cast<float*>(args.loss.data);
  const MutOperand dlogits{args.dlogits.data, kind_of(args.dlogits.dtype)};
  const ConstOperand logits{args.logits.data, kind_of(args.logits.dtype)};
  const auto* labels = static_cast<const int32_t*>(args.labels.data);
  const float scale = static_cast<float>(args.grad_scale);
  const bool vector = vocab % 8 == 0 && aligned16(logits.data) && (dlogits.data == nullptr || aligned16(dlogits.data));
  if (vector) {
    cross_entropy_kernel<8><<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(loss, dlogits, logits, labels,
                                                                                     vocab, scale);
  } else {
    cross_entropy_kernel<1><<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(loss, dlogits, logits, labels,
                                                                                     vocab, scale);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
