#include "kernels/cuda/attention/attn_res.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMax = static_cast<int>(kMaxAttnResValues);

struct Values {
  ConstOperand v[kMax];
  int m = 0;
};
struct Gradients {
  MutOperand v[kMax];
};

// Per-row statistics shared by the block: r_i, s_i, p_i (and g_i backward).
struct RowStats {
  float r[kMax], s[kMax], p[kMax], g[kMax];
  float scratch[32];
};

// r_i and s_i of every value of row t into st (and g_i = dout . V_i when dout is given).
template <int kChunk>
__device__ void row_statistics(RowStats& st, const Values& values, ConstOperand norm_weight, ConstOperand query,
                               ConstOperand dout, bool with_dout, int64_t t, int64_t dim, float eps) {
  for (int i = 0; i < values.m; ++i) {
    float squares = 0.0f, dot = 0.0f, g = 0.0f;
    for (int64_t d = static_cast<int64_t>(threadIdx.x) * kChunk; d < dim; d += static_cast<int64_t>(blockDim.x) * kChunk) {
      float v[kChunk], w[kChunk], q[kChunk], o[kChunk];
      load_chunk<kChunk>(v, values.v[i], t * dim + d);
      load_chunk<kChunk>(w, norm_weight, d);
      load_chunk<kChunk>(q, query, d);
      if (with_dout) load_chunk<kChunk>(o, dout, t * dim + d);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        squares += v[e] * v[e];
        dot += w[e] * q[e] * v[e];
        if (with_dout) g += o[e] * v[e];
      }
    }
    squares = block_sum(squares, st.scratch);
    dot = block_sum(dot, st.scratch);
    if (with_dout) g = block_sum(g, st.scratch);
    if (threadIdx.x == 0) {
      st.r[i] = rsqrtf(squares / static_cast<float>(dim) + eps);
      st.s[i] = st.r[i] * dot;
      st.g[i] = g;
    }
  }
  __syncthreads();
}

template <int kChunk>
__global__ void attn_res_forward_kernel(MutOperand out, float* probs, Values values, ConstOperand norm_weight,
                                        ConstOperand query, int64_t rows, int64_t dim, float eps) {
  __shared__ RowStats st;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    row_statistics<kChunk>(st, values, norm_weight, query, ConstOperand{}, false, t, dim, eps);
    if (threadIdx.x == 0) {
      float top = st.s[0];
      for (int i = 1; i < values.m; ++i) top = fmaxf(top, st.s[i]);
      float total = 0.0f;
      for (int i = 0; i < values.m; ++i) total += (st.p[i] = expf(st.s[i] - top));
      for (int i = 0; i < values.m; ++i) probs[t * values.m + i] = (st.p[i] /= total);
    }
    __syncthreads();
    for (int64_t d = static_cast<int64_t>(threadIdx.x) * kChunk; d < dim; d += static_cast<int64_t>(blockDim.x) * kChunk) {
      float sum[kChunk] = {};
      for (int i = 0; i < values.m; ++i) {
        float v[kChunk];
        load_chunk<kChunk>(v, values.v[i], t * dim + d);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) sum[e] += st.p[i] * v[e];
      }
      store_chunk<kChunk>(out, t * dim + d, sum);
    }
    __syncthreads();  // st is rewritten for the next row
  }
}

template <int kChunk>
__global__ void attn_res_backward_kernel(Gradients dvalues, ConstOperand dout, Values values, ConstOperand norm_weight,
                                         ConstOperand query, const float* probs, int64_t rows, int64_t dim, float eps) {
  __shared__ RowStats st;
  __shared__ float ds[kMax];
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    row_statistics<kChunk>(st, values, norm_weight, query, dout, true, t, dim, eps);
    if (threadIdx.x == 0) {
      float mean_g = 0.0f;
      for (int i = 0; i < values.m; ++i) mean_g += (st.p[i] = probs[t * values.m + i]) * st.g[i];
      for (int i = 0; i < values.m; ++i) ds[i] = st.p[i] * (st.g[i] - mean_g);
    }
    __syncthreads();
    const float inv_dim = 1.0f / static_cast<float>(dim);
    for (int64_t d = static_cast<int64_t>(threadIdx.x) * kChunk; d < dim; d += static_cast<int64_t>(blockDim.x) * kChunk) {
      float o[kChunk], w[kChunk], q[kChunk];
      load_chunk<kChunk>(o, dout, t * dim + d);
      load_chunk<kChunk>(w, norm_weight, d);
      load_chunk<kChunk>(q, query, d);
      for (int i = 0; i < values.m; ++i) {
        float v[kChunk], dv[kChunk];
        load_chunk<kChunk>(v, values.v[i], t * dim + d);
        load_chunk<kChunk>(dv, dvalues.v[i], t * dim + d);
        const float coef = ds[i] * st.r[i], shrink = st.s[i] * st.r[i] * inv_dim;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dv[e] += st.p[i] * o[e] + coef * (w[e] * q[e] - shrink * v[e]);
        store_chunk<kChunk>(dvalues.v[i], t * dim + d, dv);
      }
    }
    __syncthreads();
  }
}

ConstOperand operand(const TensorView& t, const char* name) { return {t.data, elem_kind("attn_res", name, t.dtype)}; }

Values values_of(const std::vector<TensorView>& views) {
  Values values;
  values.m = static_cast<int>(views.size());
  for (size_t i = 0; i < views.size(); ++i) values.v[i] = operand(views[i], "value");
  return values;
}

// The 8-wide path needs every row operand 16-byte aligned and dim a multiple of 8.
bool vector_ok(int64_t dim, std::initializer_list<const void*> pointers, const std::vector<TensorView>& a,
               const std::vector<TensorView>* b) {
  if (dim % 8 != 0) return false;
  for (const void* p : pointers) if (!aligned16(p)) return false;
  for (const TensorView& v : a) if (!aligned16(v.data)) return false;
  if (b != nullptr) for (const TensorView& v : *b) if (!aligned16(v.data)) return false;
  return true;
}

}  // namespace

void attn_res_forward(const AttnResArgs& args, cudaStream_t stream) {
  const int64_t dim = args.out.size(-1);
  const int64_t rows = args.out.size(0);
  if (rows == 0 || dim == 0) return;
  const MutOperand out{args.out.data, elem_kind("attn_res_forward", "out", args.out.dtype)};
  const Values values = values_of(args.values);
  const ConstOperand nw = operand(args.norm_weight, "norm_weight"), q = operand(args.query, "query");
  const unsigned blocks = grid_for(rows, 1, 1 << 16);
  float* probs = static_cast<float*>(args.probs.data);
  const float eps = static_cast<float>(args.eps);
  if (vector_ok(dim, {out.data, nw.data, q.data}, args.values, nullptr)) {
    attn_res_forward_kernel<8><<<blocks, kThreads, 0, stream>>>(out, probs, values, nw, q, rows, dim, eps);
  } else {
    attn_res_forward_kernel<1><<<blocks, kThreads, 0, stream>>>(out, probs, values, nw, q, rows, dim, eps);
  }
  CUDA_CHECK_LAUNCH();
}

void attn_res_backward(const AttnResBackwardArgs& args, cudaStream_t stream) {
  const int64_t dim = args.dout.size(-1);
  const int64_t rows = args.dout.size(0);
  if (rows == 0 || dim == 0) return;
  Gradients grads;
  for (size_t i = 0; i < args.dvalues.size(); ++i) {
    grads.v[i] = MutOperand{args.dvalues[i].data, elem_kind("attn_res_backward", "dvalue", args.dvalues[i].dtype)};
  }
  const ConstOperand dout = operand(args.dout, "dout");
  const Values values = values_of(args.values);
  const ConstOperand nw = operand(args.norm_weight, "norm_weight"), q = operand(args.query, "query");
  const unsigned blocks = grid_for(rows, 1, 1 << 16);
  const float* probs = static_cast<const float*>(args.probs.data);
  const float eps = static_cast<float>(args.eps);
  if (vector_ok(dim, {dout.data, nw.data, q.data}, args.values, &args.dvalues)) {
    attn_res_backward_kernel<8><<<blocks, kThreads, 0, stream>>>(grads, dout, values, nw, q, probs, rows, dim, eps);
  } else {
    attn_res_backward_kernel<1><<<blocks, kThreads, 0, stream>>>(grads, dout, values, nw, q, probs, rows, dim, eps);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
