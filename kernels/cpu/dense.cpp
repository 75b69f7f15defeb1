// Dense linear algebra and memory ops of the CPU reference backend (see kernels/ops.h for the
// contract of each). The GEMM packs transposed operands into contiguous
// buffers so that a single kernel (rows of c accumulated as sums of scaled rows of b, the i-k-j
// order, blocked over k and n to stay in cache) does every case; that inner loop is a plain
// saxpy the compiler vectorises. No threads: results depend only on the inputs.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/bf16.h"
#include "kernels/arg_checks.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/mxfp4.h"

namespace moetrain::kernels::cpu {
namespace {

constexpr int64_t kBlockK = 128;  // rows of the b panel kept hot
constexpr int64_t kBlockN = 256;  // columns of the b panel (and of one accumulator row)

// out [cols, rows] = in [rows, cols]^T
template <typename T>
void transpose_into(T* out, const T* in, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
}

// c[m, n] = alpha * a[m, k] . b[k, n] + beta * c, every operand contiguous row-major.
template <typename T>
void gemm_nn(T* c, const T* a, const T* b, int64_t m, int64_t n, int64_t k, T alpha, T beta) {
  std::vector<T> acc(static_cast<size_t>(std::min(n, kBlockN)));
  for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
    const int64_t nb = std::min(kBlockN, n - j0);
    for (int64_t i = 0; i < m; ++i) {
      T* __restrict acc_row = acc.data();
      std::fill(acc_row, acc_row + nb, T(0));
      const T* a_row = a + i * k;
      for (int64_t p0 = 0; p0 < k; p0 += kBlockK) {
        const int64_t p1 = std::min(k, p0 + kBlockK);
        int64_t p = p0;
        // Four rows of b per pass: a quarter of the accumulator loads and stores. The sum is
        // written left to right, so the rounding is that of the one-row-at-a-time loop.
        for (; p + 4 <= p1; p += 4) {
          const T a0 = a_row[p], a1 = a_row[p + 1], a2 = a_row[p + 2], a3 = a_row[p + 3];
          const T* __restrict b0 = b + p * n + j0;
          const T* __restrict b1 = b0 + n;
          const T* __restrict b2 = b1 + n;
          const T* __restrict b3 = b2 + n;
          for (int64_t j = 0; j < nb; ++j) acc_row[j] = acc_row[j] + a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
        }
        for (; p < p1; ++p) {
          const T a_ip = a_row[p];
          const T* __restrict b_row = b + p * n + j0;
          for (int64_t j = 0; j < nb; ++j) acc_row[j] += a_ip * b_row[j];
        }
      }
      T* c_row = c + i * n + j0;
      if (beta == T(0)) {
        for (int64_t j = 0; j < nb; ++j) c_row[j] = alpha * acc_row[j];
      } else {
        for (int64_t j = 0; j < nb; ++j) c_row[j] = alpha * acc_row[j] + beta * c_row[j];
      }
    }
  }
}

// c[m, n] = alpha * op(a) . op(b) + beta * c with a [m, k] or [k, m] (transpose_a), b [k, n] or
// [n, k] (transpose_b).
template <typename T>
void gemm_raw(T* c, const T* a, const T* b, int64_t m, int64_t n, int64_t k, bool transpose_a, bool transpose_b,
              double alpha, double beta) {
  if (m == 0 || n == 0) return;
  std::vector<T> a_packed, b_packed;
  if (transpose_a && m > 1) {
    a_packed.resize(static_cast<size_t>(m * k));
    transpose_into(a_packed.data(), a, k, m);
    a = a_packed.data();
  }
  if (transpose_b && n > 1) {
    b_packed.resize(static_cast<size_t>(k * n));
    transpose_into(b_packed.data(), b, n, k);
    b = b_packed.data();
  }
  // (A single row or column is the same memory either way, so it needs no packing.)
  gemm_nn(c, a, b, m, n, k, static_cast<T>(alpha), static_cast<T>(beta));
}

}  // namespace

// c = alpha * op(a) . op(b) + beta * c, accumulated in T. beta == 0 never reads c (so stale
// NaNs in an output buffer do not leak into it), as in BLAS.
template <typename T>
void gemm(const GemmArgs& args) {
  const int64_t m = args.c.size(0), n = args.c.size(1);
  const int64_t k = args.transpose_a ? args.a.size(0) : args.a.size(1);
  gemm_raw(args.c.ptr<T>(), args.a.ptr<T>(), args.b.ptr<T>(), m, n, k, args.transpose_a, args.transpose_b,
           args.alpha, args.beta);
}

// Both MoE layouts (see GroupedGemmArgs). Empty groups are normal: kMGrouped has nothing to do
// for them; kKGrouped sets c[g] = beta * c[g] (zero for beta == 0). An MXFP4 or FP8 b (b_scale
// U8 or F32) is dequantized first (grouped_gemm_mxfp4, grouped_gemm_fp8), which then runs this
// plain form.
template <typename T>
void grouped_gemm(const GroupedGemmArgs& args) {
  if (given(args.b_scale)) {
    if (args.b_scale.dtype == DType::kF32) {
      grouped_gemm_fp8<T>(args);
    } else {
      grouped_gemm_mxfp4<T>(args);
    }
    return;
  }
  const int32_t* offsets = args.group_offsets.ptr<int32_t>();
  const int64_t groups = args.group_offsets.numel() - 1;
  T* c = args.c.ptr<T>();
  const T* a = args.a.ptr<T>();
  const T* b = args.b.ptr<T>();
  if (args.kind == GroupedGemmKind::kMGrouped) {
    // a [rows, k], b [G, n, k] (transpose_b) or [G, k, n], c [rows, n]
    const int64_t k = args.a.size(1), n = args.c.size(1);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t row0 = offsets[g], rows = offsets[g + 1] - offsets[g];
      gemm_raw(c + row0 * n, a + row0 * k, b + g * n * k, rows, n, k, false, args.transpose_b, args.alpha,
               args.beta);
      if (args.a2.data == nullptr) continue;
      const int64_t k2 = args.a2.size(1);
      gemm_raw(c + row0 * n, args.a2.ptr<T>() + row0 * k2, args.b2.ptr<T>() + g * n * k2, rows, n, k2, false,
               args.transpose_b, args.alpha, 1.0);
    }
  } else {
    // a [rows, n_out], b [rows, n_in], c [G, n_out, n_in]: c[g] = alpha * a_g^T . b_g + beta * c[g]
    const int64_t n_out = args.a.size(1), n_in = args.b.size(1);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t row0 = offsets[g], rows = offsets[g + 1] - offsets[g];
      gemm_raw(c + g * n_out * n_in, a + row0 * n_out, b + row0 * n_in, n_out, n_in, rows, true, false,
               args.alpha, args.beta);
    }
  }
}

// y = alpha * x + beta * y; beta == 0 never reads y.
template <typename T>
void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) {
  T* yp = y.ptr<T>();
  const T* xp = x.ptr<T>();
  const T a = static_cast<T>(alpha), b = static_cast<T>(beta);
  const int64_t n = y.numel();
  if (beta == 0.0) {
    for (int64_t i = 0; i < n; ++i) yp[i] = a * xp[i];
  } else {
    for (int64_t i = 0; i < n; ++i) yp[i] = a * xp[i] + b * yp[i];
  }
}

// Sum of squares in double, in index order.
template <typename T>
double sum_squares(const TensorView& x) {
  const T* xp = x.ptr<T>();
  double sum = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) sum += static_cast<double>(xp[i]) * static_cast<double>(xp[i]);
  return sum;
}

// Rows are the tensor's elements grouped by its last dimension.
template <typename T>
void copy_columns(const CopyColumnsArgs& args) {
  const int64_t dst_width = args.dst.size(-1), src_width = args.src.size(-1);
  const int64_t rows = dst_width == 0 ? 0 : args.dst.numel() / dst_width;
  T* dst = args.dst.ptr<T>();
  const T* src = args.src.ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    T* out = dst + r * dst_width + args.dst_col;
    const T* in = src + (r / args.src_row_repeat) * src_width + args.src_col;
    if (args.accumulate) {
      for (int64_t c = 0; c < args.cols; ++c) out[c] += in[c];
    } else {
      for (int64_t c = 0; c < args.cols; ++c) out[c] = in[c];
    }
  }
}

// CopyBlockArgs (kernels/ops.h): dst and src of one dtype, the product alpha * src in T.
template <typename T>
void copy_block(const CopyBlockArgs& args) {
  const int64_t batch = args.dst.size(0);
  const int64_t dst_rows = args.dst.size(1), dst_width = args.dst.size(2);
  const int64_t src_rows = args.src.size(1), src_width = args.src.size(2);
  const T alpha = static_cast<T>(args.alpha);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < args.rows; ++i) {
      T* out = args.dst.ptr<T>() + (b * dst_rows + args.dst_row + i) * dst_width + args.dst_col;
      const T* in = args.src.ptr<T>() + (b * src_rows + args.src_row + i) * src_width + args.src_col;
      for (int64_t j = 0; j < args.cols; ++j) out[j] = args.accumulate ? out[j] + alpha * in[j] : alpha * in[j];
    }
  }
}

// dst [tokens, dim] = sum over h of src [tokens, heads, dim] (src may be given as
// [tokens * heads, dim]: row r of src belongs to token r / heads).
template <typename T>
void sum_over_heads(const TensorView& dst, const TensorView& src) {
  const int64_t dim = dst.size(-1);
  const int64_t tokens = dim == 0 ? 0 : dst.numel() / dim;
  const int64_t heads = tokens == 0 ? 0 : src.numel() / (tokens * dim);
  T* out = dst.ptr<T>();
  const T* in = src.ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = out + t * dim;
    std::fill(row, row + dim, T(0));
    for (int64_t h = 0; h < heads; ++h) {
      const T* part = in + (t * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) row[d] += part[d];
    }
  }
}

namespace {

// Rounds a double to float such that a later round-to-nearest-even to bf16/f16 equals the
// direct rounding of the double: round to odd (truncate, then set the last bit if inexact).
float round_to_odd_float(double value) {
  float f = static_cast<float>(value);
  if (std::isnan(value) || static_cast<double>(f) == value) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::fabs(static_cast<double>(f)) > std::fabs(value)) bits -= 1;  // step toward zero
  bits |= 1u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

double load_element(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return static_cast<const float*>(t.data)[i];
    case DType::kF64: return static_cast<const double*>(t.data)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(t.data)[i]);
    case DType::kI32: return static_cast<const int32_t*>(t.data)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(t.data)[i]);
    case DType::kU8: return static_cast<const uint8_t*>(t.data)[i];
    case DType::kBool: return static_cast<const uint8_t*>(t.data)[i] != 0 ? 1.0 : 0.0;
  }
  return 0.0;
}

void store_element(const TensorView& t, int64_t i, double value) {
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[i] = static_cast<float>(value); return;
    case DType::kF64: static_cast<double*>(t.data)[i] = value; return;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[i] = float_to_bf16(round_to_odd_float(value)); return;
    case DType::kF16: static_cast<uint16_t*>(t.data)[i] = float_to_f16(round_to_odd_float(value)); return;
    case DType::kI32: static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(value); return;
    case DType::kI64: static_cast<int64_t*>(t.data)[i] = static_cast<int64_t>(value); return;
    case DType::kU8: static_cast<uint8_t*>(t.data)[i] = static_cast<uint8_t>(value); return;
    case DType::kBool: static_cast<uint8_t*>(t.data)[i] = value != 0.0 ? 1 : 0; return;
  }
}

}  // namespace

// Any dtype: floating values are rounded to nearest (bf16/f16 nearest-even), integer ones
// truncated toward zero.
void fill(const TensorView& dst, double value) {
  if (dst.numel() == 0) return;
  store_element(dst, 0, value);
  const size_t width = dtype_size(dst.dtype);
  char* bytes = static_cast<char*>(dst.data);
  for (int64_t i = 1; i < dst.numel(); ++i) std::memcpy(bytes + i * width, bytes, width);
}

// Byte copy of two host tensors of the same dtype and element count.
void copy(const TensorView& dst, const TensorView& src) {
  if (dst.nbytes() > 0 && dst.data != src.data) std::memmove(dst.data, src.data, dst.nbytes());
}

// Element conversion between F32, F64, BF16, F16, I32 and I64 (host tensors, same element
// count). To bf16/f16 rounds to nearest even (through float for F64: double rounding, which
// can differ from a direct F64 -> bf16 rounding in the last bit in rare halfway cases).
void convert(const TensorView& dst, const TensorView& src) {
  // The two common cases get a direct loop; every other pair goes through double, which holds
  // each source value exactly (I64 beyond 2^53 excepted).
  if (src.dtype == DType::kBF16 && dst.dtype == DType::kF32) {
    const uint16_t* in = src.ptr_u16();
    float* out = dst.ptr<float>();
    for (int64_t i = 0; i < src.numel(); ++i) out[i] = bf16_to_float(in[i]);
    return;
  }
  if (src.dtype == DType::kF32 && dst.dtype == DType::kBF16) {
    const float* in = src.ptr<float>();
    uint16_t* out = dst.ptr_u16();
    for (int64_t i = 0; i < src.numel(); ++i) out[i] = float_to_bf16(in[i]);
    return;
  }
  for (int64_t i = 0; i < src.numel(); ++i) store_element(dst, i, load_element(src, i));
}

#define MOETRAIN_INSTANTIATE_DENSE(T)                                                         \
  template void gemm<T>(const GemmArgs&);                                                     \
  template void grouped_gemm<T>(const GroupedGemmArgs&);                                      \
  template void axpby<T>(const TensorView&, const TensorView&, double, double);              \
  template double sum_squares<T>(const TensorView&);                                          \
  template void copy_columns<T>(const CopyColumnsArgs&);                                      \
  template void copy_block<T>(const CopyBlockArgs&);                                          \
  template void sum_over_heads<T>(const TensorView&, const TensorView&);
MOETRAIN_INSTANTIATE_DENSE(float)
MOETRAIN_INSTANTIATE_DENSE(double)
#undef MOETRAIN_INSTANTIATE_DENSE

}  // namespace moetrain::kernels::cpu
