// The KDA launchers: the chunk table, BF16 copies of F32 (or misaligned) inputs, the scratch
// buffers between the kernels, and the kernels in order (see kda.h and each kernel file).
#include "kernels/cuda/kda.h"

#include <cuda_bf16.h>

#include <cstddef>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/kda_common.cuh"
#include "kernels/cuda/memory.h"

namespace moetrain::kernels::cuda_ops {
namespace {

using kda::bf16;
using kda::KdaParams;

constexpr int kTableThreads = 1024;

// chunk_offsets[s] = chunks of the segments before s (each ceil(length / 64)), capped at
// `capacity` so that no chunk number can exceed the per-chunk buffers even for malformed
// cu_seqlens; chunk_offsets[segments] = the total. One block.
__global__ void kda_chunk_table_kernel(int32_t* chunk_offsets, const int32_t* cu_seqlens, int segments, int tokens,
                                       int capacity) {
  __shared__ int warp_totals[kTableThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (segments + kTableThreads - 1) / kTableThreads;
  const int s_begin = min(segments, tid * per), s_end = min(segments, s_begin + per);
  auto chunks_of = [&](int s) {
    const kda::Span span = kda::segment_span(cu_seqlens, s, tokens);
    return (span.end - span.begin + kda::kChunk - 1) / kda::kChunk;
  };
  int local = 0;
  for (int s = s_begin; s < s_end; ++s) local += chunks_of(s);
  // Exclusive scan over the block: within warps, then over the warp totals.
  int inclusive = local;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int total = warp_totals[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, total, offset);
      if (lane >= offset) total += other;
    }
    warp_totals[lane] = total;  // inclusive over warps
  }
  __syncthreads();
  int run = inclusive - local + (warp > 0 ? warp_totals[warp - 1] : 0);
  for (int s = s_begin; s < s_end; ++s) {
    chunk_offsets[s] = min(run, capacity);
    run += chunks_of(s);
  }
  if (tid == kTableThreads - 1) chunk_offsets[segments] = min(run, capacity);
}

// Device memory for one call, carved into 256-byte aligned pieces: a sizing pass (base null)
// then the real one.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    offset_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// The BF16 operand the kernels read: the caller's tensor when it is BF16 and 16-byte aligned,
// else a BF16 copy in scratch (`copy` non-null in the real pass).
const bf16* bf16_input(const TensorView& t, bf16* copy, cudaStream_t stream) {
  if (t.dtype == DType::kBF16 && aligned16(t.data)) return static_cast<const bf16*>(t.data);
  if (copy != nullptr) {
    TensorView dst = t;
    dst.data = copy;
    dst.dtype = DType::kBF16;
    convert(dst, t, stream);
  }
  return copy;
}
bool needs_copy(const TensorView& t) { return !(t.dtype == DType::kBF16 && aligned16(t.data)); }

// g (F32) is read 16 bytes at a time: the caller's tensor when aligned, else a copy.
const float* g_input(const TensorView& g, float* copy, cudaStream_t stream) {
  if (aligned16(g.data)) return static_cast<const float*>(g.data);
  if (copy != nullptr) CUDA_CHECK(cudaMemcpyAsync(copy, g.data, g.nbytes(), cudaMemcpyDeviceToDevice, stream));
  return copy;
}

MutOperand out_operand(const char* op, const char* name, const TensorView& t) {
  return {t.data, elem_kind(op, name, t.dtype)};
}

struct Dims {
  int tokens, heads, dk, dv, segments, capacity;
};

Dims dims_of(const TensorView& q, const TensorView& v, const TensorView& cu_seqlens) {
  Dims d;
  d.tokens = static_cast<int>(q.size(0));
  d.heads = static_cast<int>(q.size(1));
  d.dk = static_cast<int>(q.size(2));
  d.dv = static_cast<int>(v.size(2));
  d.segments = static_cast<int>(cu_seqlens.numel() - 1);
  d.capacity = (d.tokens + kda::kChunk - 1) / kda::kChunk + d.segments;
  return d;
}

// Buffers of the forward (and the part of the backward that recomputes it).
void carve_forward(KdaParams& p, const Dims& d, Carver& carver) {
  const int64_t rows = static_cast<int64_t>(d.tokens) * d.heads;
  p.w = carver.take<bf16>(rows * d.dk);
  p.u = carver.take<bf16>(rows * d.dv);
  p.qg = carver.take<bf16>(rows * d.dk);
  p.kt = carver.take<bf16>(rows * d.dk);
  p.aqk = carver.take<bf16>(rows * kda::kChunk);
  p.decay = carver.take<float>(static_cast<int64_t>(d.capacity) * d.heads * d.dk);
}

void fill_common(KdaParams& p, const Dims& d, double scale, const TensorView& beta, const TensorView& cu_seqlens) {
  p.tokens = d.tokens;
  p.heads = d.heads;
  p.segments = d.segments;
  p.capacity = d.capacity;
  p.scale = static_cast<float>(scale);
  p.cu_seqlens = static_cast<const int32_t*>(cu_seqlens.data);
  p.beta = static_cast<const float*>(beta.data);
}

// The call's scratch from the backend's device allocator. Handing it back as the call returns,
// before its kernels have run, is safe as for any temporary tensor: every user of a block is on
// the backend's one stream (kernels/caching_allocator.h), and a same-sized call reuses the block.
Tensor call_scratch(size_t bytes) {
  return Tensor(Shape{static_cast<int64_t>(bytes)}, DType::kU8, cuda::device_allocator());
}

void build_chunk_table(const KdaParams& p, cudaStream_t stream) {
  kda_chunk_table_kernel<<<1, kTableThreads, 0, stream>>>(const_cast<int32_t*>(p.chunk_offsets), p.cu_seqlens,
                                                          p.segments, p.tokens, p.capacity);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool kda_head_dims_supported(int64_t k_dim, int64_t v_dim) {
  return (k_dim == 64 || k_dim == 128) && (v_dim == 64 || v_dim == 128);
}

void kda_forward(const KdaArgs& args, cudaStream_t stream) {
  const Dims d = dims_of(args.q, args.v, args.cu_seqlens);
  if (d.tokens == 0 || d.heads == 0 || d.segments <= 0) return;
  KdaParams p;
  fill_common(p, d, args.scale, args.beta, args.cu_seqlens);
  p.out = out_operand("kda_forward", "out", args.out);
  const int64_t rows = static_cast<int64_t>(d.tokens) * d.heads;

  // Two passes over the same carving: sizes, then pointers into one allocation.
  Tensor scratch;
  char* base = nullptr;
  for (int pass = 0; pass < 2; ++pass) {
    Carver carver(base);
    p.chunk_offsets = carver.take<int32_t>(d.segments + 1);
    bf16* q16 = needs_copy(args.q) ? carver.take<bf16>(rows * d.dk) : nullptr;
    bf16* k16 = needs_copy(args.k) ? carver.take<bf16>(rows * d.dk) : nullptr;
    bf16* v16 = needs_copy(args.v) ? carver.take<bf16>(rows * d.dv) : nullptr;
    float* g32 = aligned16(args.g.data) ? nullptr : carver.take<float>(rows * d.dk);
    carve_forward(p, d, carver);
    if (pass == 0) {
      scratch = call_scratch(carver.bytes());
      base = static_cast<char*>(scratch.data());
    } else {
      p.q = bf16_input(args.q, q16, stream);
      p.k = bf16_input(args.k, k16, stream);
      p.v = bf16_input(args.v, v16, stream);
      p.g = g_input(args.g, g32, stream);
    }
  }
  build_chunk_table(p, stream);
  kda::launch_kda_intra(p, d.dk, d.dv, /*for_backward=*/false, stream);
  kda::launch_kda_state_forward(p, d.dk, d.dv, /*save=*/false, stream);
}

void kda_backward(const KdaBackwardArgs& args, cudaStream_t stream) {
  const Dims d = dims_of(args.q, args.v, args.cu_seqlens);
  if (d.tokens == 0 || d.heads == 0 || d.segments <= 0) return;
  KdaParams p;
  fill_common(p, d, args.scale, args.beta, args.cu_seqlens);
  p.dq = out_operand("kda_backward", "dq", args.dq);
  p.dk = out_operand("kda_backward", "dk", args.dk);
  p.dv = out_operand("kda_backward", "dv", args.dv);
  p.dg = static_cast<float*>(args.dg.data);
  p.dbeta = static_cast<float*>(args.dbeta.data);
  const int64_t rows = static_cast<int64_t>(d.tokens) * d.heads;
  const int64_t states = static_cast<int64_t>(d.capacity) * d.heads * d.dk * d.dv;

  Tensor scratch;
  char* base = nullptr;
  for (int pass = 0; pass < 2; ++pass) {
    Carver carver(base);
    p.chunk_offsets = carver.take<int32_t>(d.segments + 1);
    bf16* q16 = needs_copy(args.q) ? carver.take<bf16>(rows * d.dk) : nullptr;
    bf16* k16 = needs_copy(args.k) ? carver.take<bf16>(rows * d.dk) : nullptr;
    bf16* v16 = needs_copy(args.v) ? carver.take<bf16>(rows * d.dv) : nullptr;
    bf16* dout16 = needs_copy(args.dout) ? carver.take<bf16>(rows * d.dv) : nullptr;
    float* g32 = aligned16(args.g.data) ? nullptr : carver.take<float>(rows * d.dk);
    carve_forward(p, d, carver);
    p.pkk = carver.take<float>(rows * kda::kChunk);
    p.minv = carver.take<bf16>(rows * kda::kChunk);
    p.kg = carver.take<bf16>(rows * d.dk);
    p.state = carver.take<bf16>(states);
    p.dstate = carver.take<bf16>(states);
    p.vnew = carver.take<bf16>(rows * d.dv);
    p.dvnew = carver.take<bf16>(rows * d.dv);
    p.dpkk = carver.take<float>(rows * kda::kChunk);
    p.dkg = carver.take<float>(rows * d.dk);
    if (pass == 0) {
      scratch = call_scratch(carver.bytes());
      base = static_cast<char*>(scratch.data());
    } else {
      p.q = bf16_input(args.q, q16, stream);
      p.k = bf16_input(args.k, k16, stream);
      p.v = bf16_input(args.v, v16, stream);
      p.dout = bf16_input(args.dout, dout16, stream);
      p.g = g_input(args.g, g32, stream);
    }
  }
  build_chunk_table(p, stream);
  kda::launch_kda_intra(p, d.dk, d.dv, /*for_backward=*/true, stream);
  kda::launch_kda_state_forward(p, d.dk, d.dv, /*save=*/true, stream);
  kda::launch_kda_state_backward(p, d.dk, d.dv, stream);
  kda::launch_kda_wy_backward(p, d.dk, d.dv, stream);
  kda::launch_kda_intra_backward(p, d.dk, d.dv, stream);
}

}  // namespace moetrain::kernels::cuda_ops
