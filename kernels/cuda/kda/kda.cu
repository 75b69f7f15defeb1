// The KDA launchers: the chunk table, BF16 (and head-dim padded) copies of inputs the kernels
// cannot read as they are, the scratch buffers between the kernels, the kernels in order (see
// kda.h and each kernel file), and padded outputs copied back.
#include "kernels/cuda/kda/kda.h"

#include <cuda_bf16.h>

#include <cstddef>
#include <vector>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/kda/kda_common.cuh"

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

// dst[r, c] = c < src_width ? src[r, c] : 0 for c < dst_width: converts, pads head dims with zero
// columns, or takes the first columns back (any widths, any mix of BF16 and F32).
__global__ void kda_copy_columns_kernel(MutOperand dst, int dst_width, ConstOperand src, int src_width, int64_t rows) {
  const int64_t n = rows * dst_width;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / dst_width;
    const int c = static_cast<int>(i - r * dst_width);
    store_one(dst, i, c < src_width ? load_one(src, r * src_width + c) : 0.0f);
  }
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

void copy_columns(MutOperand dst, int dst_width, ConstOperand src, int src_width, int64_t rows, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t n = rows * dst_width;
  if (n == 0) return;
  kda_copy_columns_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dst, dst_width, src, src_width, rows);
  CUDA_CHECK_LAUNCH();
}

// The kernels take head dims of 64 or 128; smaller ones run zero-padded (zero key columns add
// nothing to any product and keep their state rows at zero; zero value columns give zero outputs).
int padded_dim(int64_t dim) { return dim <= 64 ? 64 : 128; }

// The memory the kernels read for an input: [rows, width] of `want` (BF16 for q, k, v, dout; F32
// for g), 16-byte aligned. The caller's tensor when it is that already, else a converted and padded
// copy carved from scratch (filled in the real pass).
template <typename T>
const T* stage_input(Carver& carver, const TensorView& t, DType want, int width, int64_t rows, bool fill,
                     cudaStream_t stream) {
  if (t.dtype == want && t.size(-1) == width && aligned16(t.data)) return static_cast<const T*>(t.data);
  T* copy = carver.take<T>(rows * width);
  if (fill) {
    copy_columns({copy, kind_of(want)}, width, {t.data, kind_of(t.dtype)}, static_cast<int>(t.size(-1)), rows,
                 stream);
  }
  return copy;
}

// An output the kernels write [rows, width]: the caller's tensor when its head dim is `width`, else
// an F32 buffer from scratch whose first columns `unstage` copies out after the kernels.
struct StagedOutput {
  MutOperand target;
  float* buffer = nullptr;
};
StagedOutput stage_output(Carver& carver, const TensorView& t, int width, int64_t rows) {
  StagedOutput o;
  o.target = {t.data, kind_of(t.dtype)};
  if (t.size(-1) != width) {
    o.buffer = carver.take<float>(rows * width);
    o.target = {o.buffer, ElemKind::kF32};
  }
  return o;
}
void unstage(const StagedOutput& o, const TensorView& t, int width, int64_t rows, cudaStream_t stream) {
  if (o.buffer != nullptr)
    copy_columns({t.data, kind_of(t.dtype)}, static_cast<int>(t.size(-1)), {o.buffer, ElemKind::kF32}, width, rows,
                 stream);
}

// Shapes as the kernels see them (head dims padded).
struct Dims {
  int tokens, heads, dk, dv, segments, capacity;
};

Dims dims_of(const TensorView& q, const TensorView& v, const TensorView& cu_seqlens) {
  Dims d;
  d.tokens = static_cast<int>(q.size(0));
  d.heads = static_cast<int>(q.size(1));
  d.dk = padded_dim(q.size(2));
  d.dv = padded_dim(v.size(2));
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
// The first carvings of both passes: the chunk table, then BF16 (padded) q, k and v.
void stage_chunks_qkv(KdaParams& p, Carver& carver, const TensorView& q, const TensorView& k, const TensorView& v,
                      const Dims& d, int64_t rows, bool fill, cudaStream_t stream) {
  p.chunk_offsets = carver.take<int32_t>(d.segments + 1);
  p.q = stage_input<bf16>(carver, q, DType::kBF16, d.dk, rows, fill, stream);
  p.k = stage_input<bf16>(carver, k, DType::kBF16, d.dk, rows, fill, stream);
  p.v = stage_input<bf16>(carver, v, DType::kBF16, d.dv, rows, fill, stream);
}

Tensor call_scratch(size_t bytes) {
  return Tensor(Shape{static_cast<int64_t>(bytes)}, DType::kU8, cuda::device_allocator());
}

// The optional states (F32, checked by the backend) at the caller's head dims.
void fill_states(KdaParams& p, const TensorView& q, const TensorView& v, const TensorView& initial_state) {
  p.state_dk = static_cast<int>(q.size(2));
  p.state_dv = static_cast<int>(v.size(2));
  p.initial_state = static_cast<const float*>(initial_state.data);
}

// A state output of a call without tokens or segments, which the kernels never reach: every
// segment is empty, so the output is its input when there is one segment (first and last at once)
// and the input is given, else zero (ops.h overwrites a given output whole).
void pass_state_through(const TensorView& out, const TensorView& in, int segments, cudaStream_t stream) {
  if (out.data == nullptr) return;
  const size_t bytes = static_cast<size_t>(out.numel()) * sizeof(float);
  if (segments == 1 && in.data != nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(out.data, in.data, bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    CUDA_CHECK(cudaMemsetAsync(out.data, 0, bytes, stream));
  }
}

void build_chunk_table(const KdaParams& p, cudaStream_t stream) {
  kda_chunk_table_kernel<<<1, kTableThreads, 0, stream>>>(const_cast<int32_t*>(p.chunk_offsets), p.cu_seqlens,
                                                          p.segments, p.tokens, p.capacity);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool kda_head_dims_supported(int64_t k_dim, int64_t v_dim) {
  return k_dim >= 1 && k_dim <= 128 && v_dim >= 1 && v_dim <= 128;
}

void kda_forward(const KdaArgs& args, cudaStream_t stream) {
  const Dims d = dims_of(args.q, args.v, args.cu_seqlens);
  if (d.tokens == 0 || d.heads == 0 || d.segments <= 0) {
    pass_state_through(args.final_state, args.initial_state, d.segments, stream);
    return;
  }
  KdaParams p;
  fill_common(p, d, args.scale, args.beta, args.cu_seqlens);
  fill_states(p, args.q, args.v, args.initial_state);
  p.final_state = static_cast<float*>(args.final_state.data);
  const int64_t rows = static_cast<int64_t>(d.tokens) * d.heads;

  // Two passes over the same carving: sizes, then pointers into one allocation.
  Tensor scratch;
  StagedOutput out;
  for (int pass = 0; pass < 2; ++pass) {
    Carver carver(pass == 0 ? nullptr : static_cast<char*>(scratch.data()));
    const bool fill = pass == 1;
    stage_chunks_qkv(p, carver, args.q, args.k, args.v, d, rows, fill, stream);
    p.g = stage_input<float>(carver, args.g, DType::kF32, d.dk, rows, fill, stream);
    out = stage_output(carver, args.out, d.dv, rows);
    carve_forward(p, d, carver);
    if (pass == 0) scratch = call_scratch(carver.bytes());
  }
  p.out = out.target;
  build_chunk_table(p, stream);
  kda::launch_kda_intra(p, d.dk, d.dv, /*for_backward=*/false, stream);
  kda::launch_kda_state_forward(p, d.dk, d.dv, /*save=*/false, stream);
  unstage(out, args.out, d.dv, rows, stream);
}

void kda_backward(const KdaBackwardArgs& args, cudaStream_t stream) {
  const Dims d = dims_of(args.q, args.v, args.cu_seqlens);
  if (d.tokens == 0 || d.heads == 0 || d.segments <= 0) {
    pass_state_through(args.dinitial_state, args.dfinal_state, d.segments, stream);
    return;
  }
  KdaParams p;
  fill_common(p, d, args.scale, args.beta, args.cu_seqlens);
  fill_states(p, args.q, args.v, args.initial_state);
  p.dfinal_state = static_cast<const float*>(args.dfinal_state.data);
  p.dinitial_state = static_cast<float*>(args.dinitial_state.data);
  p.dbeta = static_cast<float*>(args.dbeta.data);
  const int64_t rows = static_cast<int64_t>(d.tokens) * d.heads;
  const int64_t states = static_cast<int64_t>(d.capacity) * d.heads * d.dk * d.dv;

  Tensor scratch;
  StagedOutput dq, dk, dv, dg;
  for (int pass = 0; pass < 2; ++pass) {
    Carver carver(pass == 0 ? nullptr : static_cast<char*>(scratch.data()));
    const bool fill = pass == 1;
    stage_chunks_qkv(p, carver, args.q, args.k, args.v, d, rows, fill, stream);
    p.dout = stage_input<bf16>(carver, args.dout, DType::kBF16, d.dv, rows, fill, stream);
    p.g = stage_input<float>(carver, args.g, DType::kF32, d.dk, rows, fill, stream);
    dq = stage_output(carver, args.dq, d.dk, rows);
    dk = stage_output(carver, args.dk, d.dk, rows);
    dv = stage_output(carver, args.dv, d.dv, rows);
    dg = stage_output(carver, args.dg, d.dk, rows);
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
    if (pass == 0) scratch = call_scratch(carver.bytes());
  }
  p.dq = dq.target;
  p.dk = dk.target;
  p.dv = dv.target;
  p.dg = static_cast<float*>(dg.target.data);
  build_chunk_table(p, stream);
  kda::launch_kda_intra(p, d.dk, d.dv, /*for_backward=*/true, stream);
  kda::launch_kda_state_forward(p, d.dk, d.dv, /*save=*/true, stream);
  kda::launch_kda_state_backward(p, d.dk, d.dv, stream);
  kda::launch_kda_wy_backward(p, d.dk, d.dv, stream);
  kda::launch_kda_intra_backward(p, d.dk, d.dv, stream);
  unstage(dq, args.dq, d.dk, rows, stream);
  unstage(dk, args.dk, d.dk, rows, stream);
  unstage(dv, args.dv, d.dv, rows, stream);
  unstage(dg, args.dg, d.dk, rows, stream);
}

}  // namespace moetrain::kernels::cuda_ops
