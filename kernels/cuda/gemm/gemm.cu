// The GEMM launchers of the CUDA backend and their helpers (see gemm.h).
//
// GEMM. Our tensors are row-major; cuBLAS(Lt) is column-major. A row-major X [r, c] is the
// column-major X^T [c, r] with leading dimension c, so the row-major product C = op(A) op(B)
// is computed as the column-major C^T [n, m] = op(B)^T op(A)^T: cuBLAS's first operand is our
// b and its second is our a, each with the transpose flag it already has in row-major terms.
// Tensor-core products take BF16 inputs: an F32 a or b is first rounded to BF16 (round to
// nearest even) into scratch, as autocast would; accumulation and alpha/beta are F32.
#include "kernels/cuda/gemm/gemm.h"

#include <cuda_bf16.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/gemm/fp8_decode.h"
#include "kernels/cuda/gemm/grouped_gemm_fp8.h"
#include "kernels/cuda/gemm/grouped_gemm_mxfp4.h"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

// ---------------------------------------------------------------------------------------------
// Small kernels

__global__ void round_f32_to_bf16_kernel(__nv_bfloat16* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// y = alpha * x + beta * y over `chunks` chunks of kChunk elements; y is read only if read_y.
template <int kChunk>
__global__ void axpby_kernel(MutOperand y, ConstOperand x, float alpha, float beta, bool read_y, int64_t chunks) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = c * kChunk;
    float xv[kChunk], yv[kChunk];
    load_chunk<kChunk>(xv, x, i);
    if (read_y) {
      load_chunk<kChunk>(yv, y, i);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) yv[e] = alpha * xv[e] + beta * yv[e];
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) yv[e] = alpha * xv[e];
    }
    store_chunk<kChunk>(y, i, yv);
  }
}

// The sum of every thread's acc in a fixed order (a shuffle tree per warp, then warp 0 over the
// warps' sums), valid in thread 0. blockDim.x is a multiple of 32, at most 1024.
__device__ __forceinline__ double block_sum(double acc, double (&warp_sums)[32]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  return acc;
}

// Stage 1 of sum_squares: partial[block] = sum over this block's grid-stride share, in double.
template <int kChunk>
__global__ void sum_squares_partial_kernel(double* __restrict__ partial, ConstOperand x, int64_t chunks) {
  __shared__ double warp_sums[32];
  double acc = 0.0;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[kChunk];
    load_chunk<kChunk>(v, x, c * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) acc += static_cast<double>(v[e]) * static_cast<double>(v[e]);
  }
  acc = block_sum(acc, warp_sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Stage 2: one block of 32 * k threads sums the partials in a fixed order.
__global__ void sum_partials_kernel(double* __restrict__ total, const double* __restrict__ partial, int count) {
  __shared__ double warp_sums[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, warp_sums);
  if (threadIdx.x == 0) *total = acc;
}

struct ColumnCopyShape {
  int64_t rows, cols, dst_width, src_width, dst_col, src_col, src_row_repeat;
};

template <int kChunk>
__global__ void copy_columns_kernel(MutOperand dst, ConstOperand src, ColumnCopyShape s, bool accumulate) {
  const int64_t chunks_per_row = s.cols / kChunk;
  const int64_t total = s.rows * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, c = (i % chunks_per_row) * kChunk;
    const int64_t d = r * s.dst_width + s.dst_col + c;
    float v[kChunk];
    load_chunk<kChunk>(v, src, (r / s.src_row_repeat) * s.src_width + s.src_col + c);
    if (accumulate) {
      float old[kChunk];
      load_chunk<kChunk>(old, dst, d);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] = old[e] + v[e];
    }
    store_chunk<kChunk>(dst, d, v);
  }
}

struct BlockCopyShape {
  int64_t rows, cols, dst_rows, dst_width, src_rows, src_width, dst_row, dst_col, src_row, src_col;
};

// One chunk of kChunk columns per thread over batch x rows x cols / kChunk.
template <int kChunk>
__global__ void copy_block_kernel(MutOperand dst, ConstOperand src, BlockCopyShape s, float alpha, bool accumulate,
                                  int64_t total) {
  const int64_t chunks_per_row = s.cols / kChunk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row, c = (i % chunks_per_row) * kChunk;
    const int64_t b = row / s.rows, r = row % s.rows;
    const int64_t d = (b * s.dst_rows + s.dst_row + r) * s.dst_width + s.dst_col + c;
    float v[kChunk];
    load_chunk<kChunk>(v, src, (b * s.src_rows + s.src_row + r) * s.src_width + s.src_col + c);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] *= alpha;
    if (accumulate) {
      float old[kChunk];
      load_chunk<kChunk>(old, dst, d);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] += old[e];
    }
    store_chunk<kChunk>(dst, d, v);
  }
}

// dst[t, d] = sum_h src[t, h, d], heads added in order 0, 1, ... (as the CPU reference).
template <int kChunk>
__global__ void sum_over_heads_kernel(MutOperand dst, ConstOperand src, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t chunks_per_row = dim / kChunk;
  const int64_t total = tokens * chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks_per_row, d = (i % chunks_per_row) * kChunk;
    float acc[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) acc[e] = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
      float v[kChunk];
      load_chunk<kChunk>(v, src, (t * heads + h) * dim + d);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) acc[e] += v[e];
    }
    store_chunk<kChunk>(dst, t * dim + d, acc);
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM on BF16 inputs

cudaDataType_t cuda_type(DType dtype) { return dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

// Largest power of two (<= 256) dividing the address: what cuBLASLt may assume of a pointer.
uint32_t pointer_alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment >>= 1;
  return alignment;
}

// One row-major GEMM: c [m, n] (F32 or BF16) = alpha * op(a) . op(b) + beta * c, a and b BF16.
struct Bf16Gemm {
  void* c = nullptr;
  DType c_dtype = DType::kF32;
  const void* a = nullptr;
  const void* b = nullptr;
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  float alpha = 1.0f, beta = 0.0f;
};

// c = beta * c over `count` contiguous elements (k == 0: the product is empty).
void scale_contiguous(void* c, DType c_dtype, int64_t count, float beta, cudaStream_t stream) {
  if (count == 0) return;
  if (beta == 0.0f) {
    CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(count) * dtype_size(c_dtype), stream));
    return;
  }
  const MutOperand y{c, c_dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32};
  // alpha * y + 0 * ... : reuse axpby with x = y.
  axpby_kernel<1><<<grid_for(count, kThreads), kThreads, 0, stream>>>(y, y, beta, 0.0f, false, count);
  CUDA_CHECK_LAUNCH();
}

// RAII for the cuBLASLt descriptors of one GEMM shape.
struct LtDescriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

// The fallback when cuBLASLt's heuristic has no algorithm (odd leading dimensions, say).
void run_gemm_ex(const Bf16Gemm& g, const BlasContext& ctx, cudaStream_t stream) {
  MOETRAIN_CHECK(g.m <= INT32_MAX && g.n <= INT32_MAX && g.k <= INT32_MAX, ExitCode::kInternal,
                 "cuda gemm: no cuBLASLt algorithm and dimensions beyond cublasGemmEx's int range");
  CUBLAS_CHECK(cublasSetStream(ctx.blas, stream));
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  const int ld_b = g.transpose_b ? k : n;  // column-major leading dimension of our b
  const int ld_a = g.transpose_a ? m : k;
  CUBLAS_CHECK(cublasGemmEx(ctx.blas, g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                            n, m, k, &g.alpha, g.b, CUDA_R_16BF, ld_b, g.a, CUDA_R_16BF, ld_a, &g.beta, g.c,
                            cuda_type(g.c_dtype), n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// A plan's key: what the descriptors and the heuristic's choice depend on.
struct PlanKey {
  int64_t m, n, k;
  bool transpose_a, transpose_b;
  DType c_dtype;
  uint32_t align_a, align_b, align_c;
  bool operator==(const PlanKey& o) const {
    return m == o.m && n == o.n && k == o.k && transpose_a == o.transpose_a && transpose_b == o.transpose_b &&
           c_dtype == o.c_dtype && align_a == o.align_a && align_b == o.align_b && align_c == o.align_c;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = std::hash<int64_t>()(key.m);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<uint64_t>(key.n));
    mix(static_cast<uint64_t>(key.k));
    mix((key.transpose_a ? 1u : 0u) | (key.transpose_b ? 2u : 0u) | static_cast<uint64_t>(key.c_dtype) << 2);
    mix(static_cast<uint64_t>(key.align_a) | static_cast<uint64_t>(key.align_b) << 16 |
        static_cast<uint64_t>(key.align_c) << 32);
    return h;
  }
};

struct GemmPlan {
  LtDescriptors descriptors;
  bool has_algorithm = false;  // false: cuBLASLt offers none, run_gemm_ex runs the shape
  cublasLtMatmulAlgo_t algorithm{};
};

// Past this many shapes the cache starts over (shapes that change every step would otherwise
// grow it without bound; a model has a few dozen).
constexpr size_t kMaxPlans = 4096;

}  // namespace

struct GemmPlanCache::Plans {
  std::unordered_map<PlanKey, std::unique_ptr<GemmPlan>, PlanKeyHash> by_shape;
};

GemmPlanCache::GemmPlanCache() : plans_(std::make_unique<Plans>()) {}
GemmPlanCache::~GemmPlanCache() = default;

namespace {

std::unique_ptr<GemmPlan> build_plan(const Bf16Gemm& g, const PlanKey& key, const BlasContext& ctx) {
  auto plan = std::make_unique<GemmPlan>();
  LtDescriptors& d = plan->descriptors;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second));
  // Column-major views: our b is [n, k] (stored row-major [k, n]) or, transposed, stored [n, k]
  // row-major = column-major [k, n] read with TRANSA; likewise our a.
  const uint64_t m = static_cast<uint64_t>(g.m), n = static_cast<uint64_t>(g.n), k = static_cast<uint64_t>(g.k);
  if (g.transpose_b) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.first, CUDA_R_16BF, k, n, static_cast<int64_t>(k)));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.first, CUDA_R_16BF, n, k, static_cast<int64_t>(n)));
  }
  if (g.transpose_a) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.second, CUDA_R_16BF, m, k, static_cast<int64_t>(m)));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.second, CUDA_R_16BF, k, m, static_cast<int64_t>(k)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.out, cuda_type(g.c_dtype), n, m, static_cast<int64_t>(n)));

  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.preference));
  const size_t workspace_bytes = ctx.workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof workspace_bytes));
  // cuBLASLt assumes 256-byte aligned pointers unless told otherwise; views into tensors are not.
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                    &key.align_b, sizeof key.align_b));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                    &key.align_a, sizeof key.align_a));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                    &key.align_c, sizeof key.align_c));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                    &key.align_c, sizeof key.align_c));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(ctx.lt, d.matmul, d.first, d.second, d.out, d.out,
                                                               d.preference, 1, &heuristic, &found);
  plan->has_algorithm = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (plan->has_algorithm) plan->algorithm = heuristic.algo;
  return plan;
}

void run_bf16_gemm(const Bf16Gemm& g, const BlasContext& ctx, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    scale_contiguous(g.c, g.c_dtype, g.m * g.n, g.beta, stream);
    return;
  }
  const PlanKey key{g.m,       g.n, g.k, g.transpose_a, g.transpose_b, g.c_dtype, pointer_alignment(g.a),
                    pointer_alignment(g.b), pointer_alignment(g.c)};
  auto& plans = ctx.plans->plans().by_shape;
  auto found = plans.find(key);
  if (found == plans.end()) {
    if (plans.size() >= kMaxPlans) plans.clear();
    found = plans.emplace(key, build_plan(g, key, ctx)).first;
  }
  const GemmPlan& plan = *found->second;
  if (!plan.has_algorithm) {
    run_gemm_ex(g, ctx, stream);
    return;
  }
  const LtDescriptors& d = plan.descriptors;
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, d.matmul, &g.alpha, g.b, d.first, g.a, d.second, &g.beta, g.c, d.out, g.c,
                              d.out, &plan.algorithm, ctx.workspace, ctx.workspace_bytes, stream));
}

// An F32 operand with memory is rounded to BF16 for the tensor cores (an absent one, no data, is not).
bool rounds(const TensorView& t) { return t.dtype == DType::kF32 && t.data != nullptr; }

// BF16 device copies of the F32 ones among the operands (the others are passed through), in
// one scratch reservation: operands[i] becomes pointers[i]. `leading_bytes` more at the start of
// the reservation go to the caller through *leading (a decoded FP8 weight).
template <size_t kCount>
std::array<const void*, kCount> bf16_operands(const std::array<const TensorView*, kCount>& operands,
                                              const BlasContext& ctx, cudaStream_t stream,
                                              size_t leading_bytes = 0, void** leading = nullptr) {
  std::array<const void*, kCount> pointers{};
  std::array<size_t, kCount> offsets{};
  size_t bytes = DeviceScratch::round_up(leading_bytes);
  for (size_t i = 0; i < kCount; ++i) {
    pointers[i] = operands[i]->data;
    offsets[i] = bytes;
    if (rounds(*operands[i])) bytes += DeviceScratch::round_up(static_cast<size_t>(operands[i]->numel()) * 2);
  }
  if (bytes == 0) return pointers;
  char* base = static_cast<char*>(ctx.scratch->reserve(bytes));
  if (leading != nullptr) *leading = base;
  for (size_t i = 0; i < kCount; ++i) {
    const TensorView& t = *operands[i];
    if (!rounds(t)) continue;
    pointers[i] = base + offsets[i];
    if (t.numel() == 0) continue;
    round_f32_to_bf16_kernel<<<grid_for(t.numel(), kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<__nv_bfloat16*>(base + offsets[i]), static_cast<const float*>(t.data), t.numel());
    CUDA_CHECK_LAUNCH();
  }
  return pointers;
}

template <int kChunk>
bool chunk_fits(int64_t extent, std::initializer_list<const void*> pointers) {
  if (extent % kChunk != 0) return false;
  for (const void* p : pointers)
    if (!aligned16(p)) return false;
  return true;
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void gemm(const GemmArgs& args, const BlasContext& ctx, cudaStream_t stream) {
  Bf16Gemm g;
  g.m = args.c.size(0);
  g.n = args.c.size(1);
  g.k = args.transpose_a ? args.a.size(0) : args.a.size(1);
  if (g.m == 0 || g.n == 0) return;
  g.c = args.c.data;
  g.c_dtype = args.c.dtype;
  g.transpose_a = args.transpose_a;
  g.transpose_b = args.transpose_b;
  g.alpha = static_cast<float>(args.alpha);
  g.beta = static_cast<float>(args.beta);
  if (g.k > 0) {
    const auto in = bf16_operands<2>({&args.a, &args.b}, ctx, stream);
    g.a = in[0];
    g.b = in[1];
  }
  run_bf16_gemm(g, ctx, stream);
}

namespace {

// Where an F32 operand is rounded to BF16: scratch, whose regions are 256-byte aligned (what the
// path checks see of it before it exists).
const void* scratch_aligned() { return reinterpret_cast<const void*>(uintptr_t{256}); }

}  // namespace

// Dense products decode to scratch: the one-group mainloop kernel is slower than the decode pass
// plus cuBLASLt at DeepSeek-V3's dense shapes (docs/PERF.md), where a weight serves many rows.
Fp8GemmPath fp8_gemm_path(const GemmFp8Args&) { return Fp8GemmPath::kScratch; }

void gemm_fp8(const GemmFp8Args& args, const BlasContext& ctx, cudaStream_t stream) {
  const GemmArgs& p = args.product;
  if (p.c.size(0) == 0 || p.c.size(1) == 0) return;
  const auto* scales = static_cast<const float*>(args.b_scale.data);
  // The weight decoded into the scratch reservation that also holds a BF16 copy of an F32 a.
  void* decoded = nullptr;
  const size_t decoded_bytes = static_cast<size_t>(p.b.numel()) * 2;
  const auto in = bf16_operands<1>({&p.a}, ctx, stream, decoded_bytes, &decoded);
  launch_fp8_decode_bf16(decoded, p.b.data, scales, 1, p.b.size(0), p.b.size(1), stream);
  Bf16Gemm g;
  g.m = p.c.size(0);
  g.n = p.c.size(1);
  g.k = p.transpose_a ? p.a.size(0) : p.a.size(1);
  g.c = p.c.data;
  g.c_dtype = p.c.dtype;
  g.transpose_a = p.transpose_a;
  g.transpose_b = p.transpose_b;
  g.alpha = static_cast<float>(p.alpha);
  g.beta = static_cast<float>(p.beta);
  g.a = in[0];
  g.b = decoded;
  run_bf16_gemm(g, ctx, stream);
}

namespace {

GroupedGemmProblem grouped_problem(const GroupedGemmArgs& args) {
  GroupedGemmProblem p;
  p.kind = args.kind;
  p.c = args.c.data;
  p.c_dtype = args.c.dtype;
  p.a = args.a.data;
  p.b = args.b.data;
  p.group_offsets = static_cast<const int32_t*>(args.group_offsets.data);
  p.groups = args.group_offsets.numel() - 1;
  p.rows = args.a.size(0);
  if (args.kind == GroupedGemmKind::kMGrouped) {
    p.k = args.a.size(1);
    p.n = args.c.size(1);
  } else {
    p.n_out = args.a.size(1);
    p.n_in = args.b.size(1);
  }
  p.transpose_b = args.transpose_b;
  p.alpha = static_cast<float>(args.alpha);
  p.beta = static_cast<float>(args.beta);
  if (args.a2.data != nullptr) {
    p.a2 = args.a2.data;
    p.b2 = args.b2.data;
    p.k2 = args.a2.size(1);
  }
  return p;
}

}  // namespace

// An FP8 b (b_scale F32) as the FP8 kernel sees it, an F32 a as its BF16 copy in scratch.
GroupedGemmProblem grouped_fp8_problem(const GroupedGemmArgs& args) {
  GroupedGemmProblem p = grouped_problem(args);
  if (args.a.dtype == DType::kF32) p.a = scratch_aligned();
  return p;
}

Fp8GemmPath fp8_gemm_path(const GroupedGemmArgs& args) {
  return grouped_gemm_fp8_path(grouped_fp8_problem(args)) == GroupedGemmPath::kSm90 ? Fp8GemmPath::kMainloop
                                                                                    : Fp8GemmPath::kScratch;
}

// An FP8 b: decoded inside the FP8 kernel's mainloop, or for shapes it refuses to BF16 in scratch
// and then the BF16 grouped GEMM.
void grouped_gemm_fp8(const GroupedGemmArgs& args, const BlasContext& ctx, cudaStream_t stream) {
  GroupedGemmProblem p = grouped_problem(args);
  const auto* scales = static_cast<const float*>(args.b_scale.data);
  if (fp8_gemm_path(args) == Fp8GemmPath::kMainloop) {
    p.a = bf16_operands<1>({&args.a}, ctx, stream)[0];
    launch_grouped_gemm_fp8(p, scales, stream);
    return;
  }
  void* decoded = nullptr;
  const auto in = bf16_operands<1>({&args.a}, ctx, stream, static_cast<size_t>(args.b.numel()) * 2, &decoded);
  launch_fp8_decode_bf16(decoded, args.b.data, scales, args.b.size(0), args.b.size(1), args.b.size(2), stream);
  p.a = in[0];
  p.b = decoded;
  launch_grouped_gemm(p, stream);
}

void grouped_gemm(const GroupedGemmArgs& args, const BlasContext& ctx, cudaStream_t stream) {
  if (args.b_scale.data != nullptr && args.b_scale.dtype == DType::kF32) {
    grouped_gemm_fp8(args, ctx, stream);
    return;
  }
  GroupedGemmProblem p = grouped_problem(args);
  // An MXFP4 b (U8) passes through; absent a2 / b2 (no data, F32 by default) round nothing.
  const auto in = bf16_operands<4>({&args.a, &args.b, &args.a2, &args.b2}, ctx, stream);
  p.a = in[0];
  p.b = in[1];
  if (p.k2 > 0) {
    p.a2 = in[2];
    p.b2 = in[3];
  }
  if (args.b_scale.data != nullptr) {
    launch_grouped_gemm_mxfp4(p, args.b_scale.data, stream);
    return;
  }
  launch_grouped_gemm(p, stream);
}

GroupedGemmPath grouped_gemm_path(const GroupedGemmArgs& args) {
  GroupedGemmProblem p = grouped_problem(args);
  if (args.a.dtype == DType::kF32) p.a = scratch_aligned();
  if (args.b.dtype == DType::kF32) p.b = scratch_aligned();
  if (p.k2 > 0 && args.a2.dtype == DType::kF32) p.a2 = scratch_aligned();
  if (p.k2 > 0 && args.b2.dtype == DType::kF32) p.b2 = scratch_aligned();
  if (args.b_scale.data != nullptr && args.b_scale.dtype == DType::kF32) {
    if (grouped_gemm_fp8_path(p) == GroupedGemmPath::kSm90) return GroupedGemmPath::kSm90;
    p.b = scratch_aligned();  // decoded to BF16 in scratch first
    return grouped_gemm_path(p);
  }
  if (args.b_scale.data != nullptr) return grouped_gemm_mxfp4_path(p, args.b_scale.data);
  return grouped_gemm_path(p);
}

void axpby(const TensorView& y, const TensorView& x, double alpha, double beta, cudaStream_t stream) {
  const int64_t n = y.numel();
  if (n == 0) return;
  const MutOperand yo{y.data, kind_of(y.dtype)};
  const ConstOperand xo{x.data, kind_of(x.dtype)};
  const bool read_y = beta != 0.0;
  if (chunk_fits<8>(n, {y.data, x.data})) {
    axpby_kernel<8><<<grid_for(n / 8, kThreads), kThreads, 0, stream>>>(yo, xo, static_cast<float>(alpha),
                                                                        static_cast<float>(beta), read_y, n / 8);
  } else {
    axpby_kernel<1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(yo, xo, static_cast<float>(alpha),
                                                                    static_cast<float>(beta), read_y, n);
  }
  CUDA_CHECK_LAUNCH();
}

double sum_squares(const TensorView& x, DeviceScratch& scratch, cudaStream_t stream) {
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  const ConstOperand xo{x.data, kind_of(x.dtype)};
  const bool vector = chunk_fits<8>(n, {x.data});
  const int64_t chunks = vector ? n / 8 : n;
  // The block count depends on n only, so the summation order (and the result) is reproducible.
  const unsigned int blocks = grid_for(chunks, kThreads, 1024);
  auto* partial = static_cast<double*>(scratch.reserve(sizeof(double) * (blocks + 1)));
  double* total = partial + blocks;
  if (vector) {
    sum_squares_partial_kernel<8><<<blocks, kThreads, 0, stream>>>(partial, xo, chunks);
  } else {
    sum_squares_partial_kernel<1><<<blocks, kThreads, 0, stream>>>(partial, xo, chunks);
  }
  CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<1, 1024, 0, stream>>>(total, partial, static_cast<int>(blocks));
  CUDA_CHECK_LAUNCH();
  double result = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&result, total, sizeof result, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return result;
}

void copy_columns(const CopyColumnsArgs& args, cudaStream_t stream) {
  ColumnCopyShape s;
  s.dst_width = args.dst.size(-1);
  s.src_width = args.src.size(-1);
  s.rows = s.dst_width == 0 ? 0 : args.dst.numel() / s.dst_width;
  s.cols = args.cols;
  s.dst_col = args.dst_col;
  s.src_col = args.src_col;
  s.src_row_repeat = args.src_row_repeat;
  if (s.rows == 0 || s.cols == 0) return;
  const MutOperand dst{args.dst.data, kind_of(args.dst.dtype)};
  const ConstOperand src{args.src.data, kind_of(args.src.dtype)};
  const bool vector = s.cols % 8 == 0 && s.dst_width % 8 == 0 && s.src_width % 8 == 0 && s.dst_col % 8 == 0 &&
                      s.src_col % 8 == 0 && aligned16(dst.data) && aligned16(src.data);
  if (vector) {
    copy_columns_kernel<8><<<grid_for(s.rows * s.cols / 8, kThreads), kThreads, 0, stream>>>(dst, src, s, args.accumulate);
  } else {
    copy_columns_kernel<1><<<grid_for(s.rows * s.cols, kThreads), kThreads, 0, stream>>>(dst, src, s, args.accumulate);
  }
  CUDA_CHECK_LAUNCH();
}

void copy_block(const CopyBlockArgs& args, cudaStream_t stream) {
  BlockCopyShape s;
  s.rows = args.rows;
  s.cols = args.cols;
  s.dst_rows = args.dst.size(1);
  s.dst_width = args.dst.size(2);
  s.src_rows = args.src.size(1);
  s.src_width = args.src.size(2);
  s.dst_row = args.dst_row;
  s.dst_col = args.dst_col;
  s.src_row = args.src_row;
  s.src_col = args.src_col;
  const int64_t batch = args.dst.size(0);
  if (batch == 0 || s.rows == 0 || s.cols == 0) return;
  const MutOperand dst{args.dst.data, kind_of(args.dst.dtype)};
  const ConstOperand src{args.src.data, kind_of(args.src.dtype)};
  const float alpha = static_cast<float>(args.alpha);
  // Chunks of 8 need every chunk's start 16-byte aligned in both tensors.
  const bool vector = s.cols % 8 == 0 && s.dst_width % 8 == 0 && s.src_width % 8 == 0 && s.dst_col % 8 == 0 &&
                      s.src_col % 8 == 0 && aligned16(dst.data) && aligned16(src.data);
  const int64_t total = batch * s.rows * s.cols / (vector ? 8 : 1);
  if (vector) {
    copy_block_kernel<8><<<grid_for(total, kThreads), kThreads, 0, stream>>>(dst, src, s, alpha, args.accumulate, total);
  } else {
    copy_block_kernel<1><<<grid_for(total, kThreads), kThreads, 0, stream>>>(dst, src, s, alpha, args.accumulate, total);
  }
  CUDA_CHECK_LAUNCH();
}

void sum_over_heads(const TensorView& dst, const TensorView& src, cudaStream_t stream) {
  const int64_t dim = dst.size(-1);
  const int64_t tokens = dim == 0 ? 0 : dst.numel() / dim;
  if (tokens == 0 || dim == 0) return;
  const int64_t heads = src.numel() / (tokens * dim);
  const MutOperand d{dst.data, kind_of(dst.dtype)};
  const ConstOperand s{src.data, kind_of(src.dtype)};
  if (chunk_fits<8>(dim, {dst.data, src.data})) {
    sum_over_heads_kernel<8><<<grid_for(tokens * dim / 8, kThreads), kThreads, 0, stream>>>(d, s, tokens, heads, dim);
  } else {
    sum_over_heads_kernel<1><<<grid_for(tokens * dim, kThreads), kThreads, 0, stream>>>(d, s, tokens, heads, dim);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
