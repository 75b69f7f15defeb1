// MoE routing on CUDA: one warp per token for the forward and backward, a three-stage
// fixed-order reduction for the aux loss. Matches kernels/cpu/router.cpp decision for decision:
//  - scores are computed in double and rounded to F32, as the CPU does, so that selection
//    scores (score + bias (+ noise), formed in F32) and group sums (the two best of a group,
//    added in F32) are the same numbers on both backends;
//  - ties go to the lower expert or group index, a number beats NaN (the CPU's scan order);
//  - experts of dropped groups are never chosen;
//  - weights = score * scaling / (sum of chosen scores + 1e-20), the sum in double in slot order.
// Per-token scratch (scores, selection scores, flags) lives in the warp's slice of shared memory.
#include "kernels/cuda/moe/router.h"

#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <string>

#include "kernels/arg_checks.h"
#include "kernels/cuda/common/cuda_check.h"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kRouterThreads = kWarpsPerBlock * kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr double kNormalizeEpsilon = 1e-20;  // as kernels/cpu/router.cpp (transformers adds it)

// A BF16 or F32 operand chosen at run time; data == nullptr when absent.
struct InOperand {
  const void* data = nullptr;
  bool bf16 = false;
};
__device__ __forceinline__ float load_element(const InOperand& x, int64_t i) {
  return x.bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x.data)[i]) : static_cast<const float*>(x.data)[i];
}

// Is candidate (a, ia) preferred over (b, ib)? Index -1 means "no candidate". A number beats
// NaN; among numbers the larger wins; ties (and NaN against NaN) go to the lower index. This is
// the order in which the CPU's left-to-right scan with strict `>` picks its winner.
__device__ __forceinline__ bool preferred(float a, int ia, float b, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// The warp's best candidate; every lane returns the same one (a butterfly over a total order).
__device__ __forceinline__ int warp_best(float value, int index) {
  for (int offset = 16; offset >= 1; offset /= 2) {
    const float other_value = __shfl_xor_sync(kFullMask, value, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    if (preferred(other_value, other_index, value, index)) {
      value = other_value;
      index = other_index;
    }
  }
  return index;
}

__device__ __forceinline__ double warp_sum(double x) {
  for (int offset = 16; offset >= 1; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Forward

struct RouterForwardParams {
  float* scores = nullptr;
  int32_t* topk_index = nullptr;
  float* topk_weight = nullptr;
  const float* logits = nullptr;
  InOperand bias;   // [experts], may be absent
  InOperand noise;  // [tokens, experts], may be absent
  int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  int num_groups = 0;
  int topk_groups = 0;
  bool softmax = false;
  bool normalize = true;
  double scaling = 1.0;
};

// One warp's shared scratch, in bytes: scores, choice [experts] f32; group_score [groups] f32;
// chosen [top_k] i32; taken [experts], group_kept [groups] bytes; rounded up to 16 bytes.
__host__ __device__ size_t router_warp_scratch_bytes(int experts, int groups, int top_k) {
  const size_t bytes = sizeof(float) * (2 * static_cast<size_t>(experts) + groups) + sizeof(int) * top_k +
                       static_cast<size_t>(experts) + groups;
  return (bytes + 15) / 16 * 16;
}

__global__ void __launch_bounds__(kRouterThreads) router_forward_warp_per_token_kernel(RouterForwardParams p) {
  extern __shared__ __align__(16) unsigned char router_smem[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.tokens) return;  // whole warps leave together
  const int E = p.experts, G = p.num_groups, group_size = E / G;

  unsigned char* base = router_smem + warp * router_warp_scratch_bytes(E, G, p.top_k);
  float* score = reinterpret_cast<float*>(base);
  float* choice = score + E;
  float* group_score = choice + E;
  int* chosen = reinterpret_cast<int*>(group_score + G);
  unsigned char* taken = reinterpret_cast<unsigned char*>(chosen + p.top_k);
  unsigned char* group_kept = taken + E;

  // Scores, in double and rounded once, as the CPU does.
  const float* logits = p.logits + t * E;
  if (!p.softmax) {
    for (int e = lane; e < E; e += kWarpSize) score[e] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logits[e]))));
  } else {
    float max_logit = -INFINITY;
    for (int e = lane; e < E; e += kWarpSize) max_logit = fmaxf(max_logit, logits[e]);
    for (int offset = 16; offset >= 1; offset /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(kFullMask, max_logit, offset));
    double denom = 0.0;
    for (int e = lane; e < E; e += kWarpSize) denom += exp(static_cast<double>(logits[e]) - max_logit);
    denom = warp_sum(denom);
    for (int e = lane; e < E; e += kWarpSize) score[e] = static_cast<float>(exp(static_cast<double>(logits[e]) - max_logit) / denom);
  }
  for (int e = lane; e < E; e += kWarpSize) {
    float c = score[e];
    if (p.bias.data != nullptr) c = c + load_element(p.bias, e);
    if (p.noise.data != nullptr) c = c + load_element(p.noise, t * E + e);
    choice[e] = c;
    taken[e] = 0;
  }
  __syncwarp();

  // Group-limited routing: keep the best topk_groups groups by the sum of their two best choices.
  if (p.topk_groups >= G) {
    for (int g = lane; g < G; g += kWarpSize) group_kept[g] = 1;
  } else {
    for (int g = lane; g < G; g += kWarpSize) {
      const float* c = choice + g * group_size;
      int first = 0;
      for (int i = 1; i < group_size; ++i)
        if (c[i] > c[first]) first = i;
      float sum = c[first];
      if (group_size > 1) {
        int second = first == 0 ? 1 : 0;
        for (int i = 0; i < group_size; ++i)
          if (i != first && c[i] > c[second]) second = i;
        sum = sum + c[second];
      }
      group_score[g] = sum;
      group_kept[g] = 0;
    }
    __syncwarp();
    for (int n = 0; n < p.topk_groups; ++n) {
      float best_value = 0.0f;
      int best = -1;
      for (int g = lane; g < G; g += kWarpSize) {
        if (!group_kept[g] && preferred(group_score[g], g, best_value, best)) {
          best_value = group_score[g];
          best = g;
        }
      }
      best = warp_best(best_value, best);
      __syncwarp();  // every lane has read group_kept before it changes
      if (lane == 0 && best >= 0) group_kept[best] = 1;
      __syncwarp();
    }
  }
  __syncwarp();

  // Top-k among the kept groups' experts, one warp-wide arg-max per slot.
  double sum = 0.0;
  for (int j = 0; j < p.top_k; ++j) {
    float best_value = 0.0f;
    int best = -1;
    for (int e = lane; e < E; e += kWarpSize) {
      if (group_kept[e / group_size] && !taken[e] && preferred(choice[e], e, best_value, best)) {
        best_value = choice[e];
        best = e;
      }
    }
    best = warp_best(best_value, best);
    __syncwarp();
    if (lane == 0) {
      chosen[j] = best;
      if (best >= 0) taken[best] = 1;
    }
    if (best >= 0) sum += static_cast<double>(score[best]);  // the same sum on every lane
    __syncwarp();
  }

  const double factor = p.normalize ? p.scaling / (sum + kNormalizeEpsilon) : p.scaling;
  for (int e = lane; e < E; e += kWarpSize) p.scores[t * E + e] = score[e];
  for (int j = lane; j < p.top_k; j += kWarpSize) {
    const int e = chosen[j];  // always >= 0: the host checked top_k against the kept experts
    p.topk_index[t * p.top_k + j] = e;
    p.topk_weight[t * p.top_k + j] = e >= 0 ? static_cast<float>(static_cast<double>(score[e]) * factor) : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

struct RouterBackwardParams {
  float* dlogits = nullptr;
  const float* dtopk_weight = nullptr;
  const float* dscores_extra = nullptr;  // may be null
  const float* scores = nullptr;
  const int32_t* topk_index = nullptr;
  int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  bool softmax = false;
  bool normalize = true;
  double scaling = 1.0;
};

// dscores (double, in the warp's shared slice) from the weights' gradient, then through the
// scoring function. The slot loop is serial on lane 0: it is short and keeps the CPU's order.
__global__ void __launch_bounds__(kRouterThreads) router_backward_warp_per_token_kernel(RouterBackwardParams p) {
  extern __shared__ __align__(16) unsigned char router_smem[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.tokens) return;
  const int E = p.experts, K = p.top_k;
  double* dscores = reinterpret_cast<double*>(router_smem) + static_cast<size_t>(warp) * E;
  const float* s = p.scores + t * E;
  const int32_t* index = p.topk_index + t * K;
  const float* dw = p.dtopk_weight + t * K;

  for (int e = lane; e < E; e += kWarpSize) dscores[e] = p.dscores_extra ? static_cast<double>(p.dscores_extra[t * E + e]) : 0.0;
  __syncwarp();
  if (lane == 0) {
    // w_j = c s_j / S, S = sum_k s_k + eps: dL/ds_m = c (dw_m / S - sum_j dw_j s_j / S^2).
    if (p.normalize) {
      double sum = 0.0, weighted = 0.0;
      for (int j = 0; j < K; ++j) {
        const int e = index[j];
        if (e < 0 || e >= E) continue;
        sum += static_cast<double>(s[e]);
        weighted += static_cast<double>(dw[j]) * static_cast<double>(s[e]);
      }
      sum += kNormalizeEpsilon;
      const double through_sum = weighted / (sum * sum);
      for (int j = 0; j < K; ++j) {
        const int e = index[j];
        if (e >= 0 && e < E) dscores[e] += p.scaling * (static_cast<double>(dw[j]) / sum - through_sum);
      }
    } else {
      for (int j = 0; j < K; ++j) {
        const int e = index[j];
        if (e >= 0 && e < E) dscores[e] += p.scaling * static_cast<double>(dw[j]);
      }
    }
  }
  __syncwarp();

  float* dl = p.dlogits + t * E;
  if (!p.softmax) {
    for (int e = lane; e < E; e += kWarpSize) {
      const double se = static_cast<double>(s[e]);
      dl[e] = static_cast<float>(dscores[e] * se * (1.0 - se));
    }
  } else {
    // Softmax Jacobian: dl_e = s_e (ds_e - sum_f ds_f s_f).
    double mean = 0.0;
    for (int e = lane; e < E; e += kWarpSize) mean += dscores[e] * static_cast<double>(s[e]);
    mean = warp_sum(mean);
    for (int e = lane; e < E; e += kWarpSize) dl[e] = static_cast<float>(static_cast<double>(s[e]) * (dscores[e] - mean));
  }
}

// ---------------------------------------------------------------------------------------------
// Aux loss: (1) per-segment expert counts, (2) per-token dscores and loss terms, (3) the sum of
// the loss terms in a fixed tree. The counts use shared-memory integer atomics: integer sums are
// exact, so their order cannot change the result (the no-atomics rule is about float sums).

constexpr int kCountThreads = 256;
constexpr int kLossSumThreads = 1024;

__global__ void __launch_bounds__(kCountThreads) aux_loss_count_kernel(int32_t* counts, const int32_t* topk_index,
                                                                        int64_t pairs_per_segment, int experts) {
  extern __shared__ int32_t segment_counts[];  // [experts]
  for (int e = threadIdx.x; e < experts; e += kCountThreads) segment_counts[e] = 0;
  __syncthreads();
  const int32_t* index = topk_index + blockIdx.x * pairs_per_segment;
  for (int64_t i = threadIdx.x; i < pairs_per_segment; i += kCountThreads) {
    const int e = index[i];
    if (e >= 0 && e < experts) atomicAdd(&segment_counts[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kCountThreads) counts[static_cast<int64_t>(blockIdx.x) * experts + e] = segment_counts[e];
}

struct AuxTokenParams {
  float* dscores = nullptr;
  double* token_loss = nullptr;  // [tokens]
  const float* scores = nullptr;
  const int32_t* counts = nullptr;  // [segments, experts]
  int64_t tokens = 0;
  int64_t tokens_per_segment = 0;
  int experts = 0;
  double count_scale = 0.0;  // experts / (top_k * tokens_per_segment)
  double grad_scale = 0.0;   // coef / (segments * tokens_per_segment)
};

// dL/ds[t, e] = grad_scale / row_sum * (f_e - sum_e' f_e' s[t, e'] / row_sum); loss term
// grad_scale * sum_e f_e s[t, e] / row_sum. One warp per token.
__global__ void __launch_bounds__(kRouterThreads) aux_loss_token_kernel(AuxTokenParams p) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.tokens) return;
  const int E = p.experts;
  const float* s = p.scores + t * E;
  const int32_t* count = p.counts + (t / p.tokens_per_segment) * E;
  double row_sum = 0.0;
  for (int e = lane; e < E; e += kWarpSize) row_sum += static_cast<double>(s[e]);
  row_sum = warp_sum(row_sum);
  double f_dot = 0.0;
  for (int e = lane; e < E; e += kWarpSize) f_dot += count[e] * p.count_scale * static_cast<double>(s[e]) / row_sum;
  f_dot = warp_sum(f_dot);
  for (int e = lane; e < E; e += kWarpSize) {
    p.dscores[t * E + e] = static_cast<float>(p.grad_scale / row_sum * (count[e] * p.count_scale - f_dot));
  }
  if (lane == 0) p.token_loss[t] = p.grad_scale * f_dot;
}

// loss[0] = sum_t token_loss[t]: per-thread strided sums, then a fixed tree. One block.
__global__ void __launch_bounds__(kLossSumThreads) aux_loss_sum_kernel(float* loss, const double* token_loss, int64_t tokens) {
  __shared__ double partial[kLossSumThreads];
  double sum = 0.0;
  for (int64_t t = threadIdx.x; t < tokens; t += kLossSumThreads) sum += token_loss[t];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kLossSumThreads / 2; stride >= 1; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss[0] = static_cast<float>(partial[0]);
}

// ---------------------------------------------------------------------------------------------
// Host side

// The launchers check again what they rely on (kernels/arg_checks.h), as the backend does.
bool given_nonempty(const TensorView& t) { return t.data != nullptr && t.numel() > 0; }
void expect_device(const char* op, const char* name, const TensorView& t) { expect_on(op, name, t, Device::kCUDA); }
void expect_dtype(const char* op, const char* name, const TensorView& t, DType dtype) {
  expect_device(op, name, t);
  expect_dtype_is(op, name, t, dtype);
}
InOperand optional_activation(const char* op, const char* name, const TensorView& t) {
  if (!given_nonempty(t)) return InOperand{};
  expect_device(op, name, t);
  expect(t.dtype == DType::kBF16 || t.dtype == DType::kF32, op,
         std::string(name) + " is " + dtype_name(t.dtype) + ", expected BF16 or F32");
  return InOperand{t.data, t.dtype == DType::kBF16};
}

// Shared memory for `warps` warps of `per_warp` bytes, within what the device allows.
size_t checked_smem(const char* op, const void* kernel, size_t bytes) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  expect(bytes <= static_cast<size_t>(optin), op,
         "needs " + std::to_string(bytes) + " bytes of shared memory per block, the device allows " +
             std::to_string(optin) + " (too many experts for the warp-per-token kernel)");
  if (bytes > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return bytes;
}

unsigned warp_blocks(int64_t tokens) { return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void router_forward(const RouterArgs& args, cudaStream_t stream) {
  const char* op = "router_forward";
  expect_dtype(op, "logits", args.logits, DType::kF32);
  expect(args.logits.ndim() == 2, op, "logits is " + args.logits.shape.str() + ", expected [tokens, experts]");
  const int64_t tokens = args.logits.size(0), experts = args.logits.size(1);
  expect_dtype(op, "scores", args.scores, DType::kF32);
  expect_shape(op, "scores", args.scores, args.logits.shape);
  expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect_shape(op, "topk_index", args.topk_index, Shape{tokens, args.top_k});
  expect_dtype(op, "topk_weight", args.topk_weight, DType::kF32);
  expect_shape(op, "topk_weight", args.topk_weight, Shape{tokens, args.top_k});
  expect(experts >= 1 && experts <= INT_MAX, op, std::to_string(experts) + " experts");
  expect_router_groups(op, args, experts);

  RouterForwardParams p;
  p.scores = static_cast<float*>(args.scores.data);
  p.topk_index = static_cast<int32_t*>(args.topk_index.data);
  p.topk_weight = static_cast<float*>(args.topk_weight.data);
  p.logits = static_cast<const float*>(args.logits.data);
  p.bias = optional_activation(op, "bias", args.bias);
  if (p.bias.data) expect(args.bias.numel() == experts, op, "bias is " + args.bias.shape.str() + " for " + std::to_string(experts) + " experts");
  p.noise = optional_activation(op, "noise", args.noise);
  if (p.noise.data) expect_shape(op, "noise", args.noise, args.logits.shape);
  p.tokens = tokens;
  p.experts = static_cast<int>(experts);
  p.top_k = static_cast<int>(args.top_k);
  p.num_groups = static_cast<int>(args.num_groups);
  p.topk_groups = static_cast<int>(args.topk_groups);
  p.softmax = args.scoring == RouterScoring::kSoftmax;
  p.normalize = args.normalize;
  p.scaling = args.scaling;
  if (tokens == 0) return;

  const size_t smem = checked_smem(op, reinterpret_cast<const void*>(router_forward_warp_per_token_kernel),
                                   kWarpsPerBlock * router_warp_scratch_bytes(p.experts, p.num_groups, p.top_k));
  router_forward_warp_per_token_kernel<<<warp_blocks(tokens), kRouterThreads, smem, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void router_backward(const RouterBackwardArgs& args, cudaStream_t stream) {
  const char* op = "router_backward";
  expect_dtype(op, "scores", args.scores, DType::kF32);
  expect(args.scores.ndim() == 2, op, "scores is " + args.scores.shape.str() + ", expected [tokens, experts]");
  const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
  expect(experts >= 1 && experts <= INT_MAX, op, std::to_string(experts) + " experts");
  expect_dtype(op, "dlogits", args.dlogits, DType::kF32);
  expect_shape(op, "dlogits", args.dlogits, args.scores.shape);
  expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect(args.topk_index.ndim() == 2 && args.topk_index.size(0) == tokens, op,
         "topk_index is " + args.topk_index.shape.str() + " for " + std::to_string(tokens) + " tokens");
  expect_dtype(op, "dtopk_weight", args.dtopk_weight, DType::kF32);
  expect_shape(op, "dtopk_weight", args.dtopk_weight, args.topk_index.shape);
  RouterBackwardParams p;
  if (given_nonempty(args.dscores_extra)) {
    expect_dtype(op, "dscores_extra", args.dscores_extra, DType::kF32);
    expect_shape(op, "dscores_extra", args.dscores_extra, args.scores.shape);
    p.dscores_extra = static_cast<const float*>(args.dscores_extra.data);
  }
  p.dlogits = static_cast<float*>(args.dlogits.data);
  p.dtopk_weight = static_cast<const float*>(args.dtopk_weight.data);
  p.scores = static_cast<const float*>(args.scores.data);
  p.topk_index = static_cast<const int32_t*>(args.topk_index.data);
  p.tokens = tokens;
  p.experts = static_cast<int>(experts);
  p.top_k = static_cast<int>(args.topk_index.size(1));
  p.softmax = args.scoring == RouterScoring::kSoftmax;
  p.normalize = args.normalize;
  p.scaling = args.scaling;
  if (tokens == 0) return;

  const size_t smem = checked_smem(op, reinterpret_cast<const void*>(router_backward_warp_per_token_kernel),
                                   kWarpsPerBlock * sizeof(double) * static_cast<size_t>(experts));
  router_backward_warp_per_token_kernel<<<warp_blocks(tokens), kRouterThreads, smem, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void aux_loss(const AuxLossArgs& args, cudaStream_t stream) {
  const char* op = "aux_loss";
  expect_dtype(op, "scores", args.scores, DType::kF32);
  expect(args.scores.ndim() == 2, op, "scores is " + args.scores.shape.str() + ", expected [tokens, experts]");
  const int64_t tokens = args.scores.size(0), experts = args.scores.size(1);
  expect(experts >= 1 && experts <= INT_MAX, op, std::to_string(experts) + " experts");
  expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
  expect(args.topk_index.ndim() == 2 && args.topk_index.size(0) == tokens && args.topk_index.size(1) >= 1, op,
         "topk_index is " + args.topk_index.shape.str() + " for " + std::to_string(tokens) + " tokens");
  const int64_t top_k = args.topk_index.size(1);
  const int64_t seg_len = args.tokens_per_segment;
  expect(seg_len > 0 && tokens % seg_len == 0, op,
         std::to_string(tokens) + " tokens are not whole segments of " + std::to_string(seg_len));
  expect_dtype(op, "dscores", args.dscores, DType::kF32);
  expect_shape(op, "dscores", args.dscores, args.scores.shape);
  expect_dtype(op, "loss", args.loss, DType::kF32);
  expect(args.loss.numel() == 1, op, "loss is " + args.loss.shape.str() + ", expected one element");
  const int64_t segments = tokens / seg_len;

  int32_t* counts = nullptr;
  double* token_loss = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&counts), sizeof(int32_t) * static_cast<size_t>(segments * experts + 1), stream));
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&token_loss), sizeof(double) * static_cast<size_t>(tokens + 1), stream));
  if (segments > 0) {
    const size_t smem = checked_smem(op, reinterpret_cast<const void*>(aux_loss_count_kernel), sizeof(int32_t) * static_cast<size_t>(experts));
    aux_loss_count_kernel<<<static_cast<unsigned>(segments), kCountThreads, smem, stream>>>(
        counts, static_cast<const int32_t*>(args.topk_index.data), seg_len * top_k, static_cast<int>(experts));
    CUDA_CHECK_LAUNCH();

    AuxTokenParams p;
    p.dscores = static_cast<float*>(args.dscores.data);
    p.token_loss = token_loss;
    p.scores = static_cast<const float*>(args.scores.data);
    p.counts = counts;
    p.tokens = tokens;
    p.tokens_per_segment = seg_len;
    p.experts = static_cast<int>(experts);
    p.count_scale = static_cast<double>(experts) / static_cast<double>(top_k * seg_len);
    p.grad_scale = args.coef / static_cast<double>(segments * seg_len);
    aux_loss_token_kernel<<<warp_blocks(tokens), kRouterThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
  }
  aux_loss_sum_kernel<<<1, kLossSumThreads, 0, stream>>>(static_cast<float*>(args.loss.data), token_loss, tokens);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(counts, stream));
  CUDA_CHECK(cudaFreeAsync(token_loss, stream));
}

}  // namespace moetrain::kernels::cuda_ops
