// The KDA ops at shapes past 2^31 elements (large_shape_support.h): the chunked KDA forward and
// backward over [tokens, 32 heads, 128] with tokens x heads x 128 past 2^31 (its per-token
// scratch, its per-chunk states past 2^31 too), and the short convolution past 2^31 elements and
// past 65,535 token tiles (gridDim.y's limit). The input is one random segment repeated as every
// segment of cu_seqlens, so that every segment's outputs (and the sum of their weight gradients)
// follow from the CPU reference of one segment; the first segments, those around element 2^31
// and the last are compared with it. The backward needs about 125 GB: an H200 (141 GB).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "large_shape_support.h"

namespace moetrain::cuda_test {
namespace {

// The tolerances of test_cuda_kda.cpp: KDA's tensor-core products round operands to BF16.
constexpr Tolerance kKdaOut{1e-2, 5e-2, 1.5e-2};
constexpr Tolerance kKdaGrad{1.5e-2, 1e-1, 2e-2};

std::vector<int32_t> repeated_segments(int64_t segments, int64_t length) {
  std::vector<int32_t> cu(static_cast<size_t>(segments + 1));
  for (int64_t s = 0; s <= segments; ++s) cu[static_cast<size_t>(s)] = static_cast<int32_t>(s * length);
  return cu;
}

Tensor int_host(const std::vector<int32_t>& values) {
  Tensor t({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

// Random values of magnitude [lo, hi] with random signs, rounded to `dtype`.
Tensor rounded_block(Shape shape, uint64_t seed, DType dtype, double lo = 0.05, double hi = 1.0) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, lo, hi);
  round_host(t.view(), dtype);
  return t;
}

// Values uniform in [lo, hi] (one sign), rounded to F32: log decays g < 0, beta in (0, 1).
Tensor uniform_block(Shape shape, uint64_t seed, double lo, double hi) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, 0.0, 1.0);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = lo + (hi - lo) * std::fabs(t.ptr<double>()[i]);
  round_host(t.view(), DType::kF32);
  return t;
}

// Rows of the last dim at unit L2 norm (KDA's q and k come out of an l2norm), rounded to BF16.
Tensor unit_block(Shape shape, uint64_t seed) {
  Tensor t = testing::random_tensor(shape, DType::kF64, seed, 0.05, 1.0);
  const int64_t dim = shape[shape.ndim() - 1];
  double* p = t.ptr<double>();
  for (int64_t r = 0; r < t.numel() / dim; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < dim; ++j) sum += p[r * dim + j] * p[r * dim + j];
    for (int64_t j = 0; j < dim; ++j) p[r * dim + j] /= std::sqrt(sum);
  }
  round_host(t.view(), DType::kBF16);
  return t;
}

// Each sampled segment of `device` ([tokens, ...], segments of `length` rows) against `expected`.
void expect_segments(const Tensor& device, const Tensor& expected, int64_t row_elements, Tolerance tol,
                     const std::string& name) {
  const int64_t length = expected.shape()[0];
  for (int64_t start : sampled_block_starts(device.shape()[0], row_elements, length)) {
    const Tensor got = download_rows(device, start, start + length);
    const Result r = compare(got.view(), expected.view(), tol, name + " segment at token " + std::to_string(start));
    INFO(r.message);
    CHECK(r.ok);
  }
}

// One KDA segment (the block) and the whole input made of it.
struct KdaInputs {
  static constexpr int64_t kLength = 200;  // not a multiple of the 64-token chunk
  static constexpr int64_t kHeads = 32, kDim = 128;
  int64_t segments = 0, tokens = 0;
  Tensor q_host, k_host, v_host, g_host, beta_host, cu_host;  // one segment, F64 (cu I32)
  Tensor q, k, v, g, beta, cu;                                 // device, every segment
  double scale = 1.0 / std::sqrt(static_cast<double>(kDim));

  KdaInputs() {
    segments = kTwoPow31 / (kLength * kHeads * kDim) + 30;  // 2.19e9 elements per [tokens, heads, 128]
    tokens = segments * kLength;
    const Shape one{kLength, kHeads, kDim};
    q_host = unit_block(one, 700);
    k_host = unit_block(one, 701);
    v_host = rounded_block(one, 702, DType::kBF16);
    g_host = uniform_block(one, 703, -0.5, -0.01);
    beta_host = uniform_block({kLength, kHeads}, 704, 0.05, 0.95);
    cu_host = int_host({0, static_cast<int32_t>(kLength)});
    q = repeated_rows(q_host.view(), tokens, DType::kBF16);
    k = repeated_rows(k_host.view(), tokens, DType::kBF16);
    v = repeated_rows(v_host.view(), tokens, DType::kBF16);
    g = repeated_rows(g_host.view(), tokens, DType::kF32);
    beta = repeated_rows(beta_host.view(), tokens, DType::kF32);
    cu = upload(int_host(repeated_segments(segments, kLength)).view(), DType::kI32);
  }
};

TEST_CASE("cuda kda forward past 2^31 elements per tensor (repeated 200-token segments)") {
  if (!device_has(55, "kda forward past 2^31")) return;
  const KdaInputs in;
  const int64_t row_elements = KdaInputs::kHeads * KdaInputs::kDim;
  Tensor out({in.tokens, KdaInputs::kHeads, KdaInputs::kDim}, DType::kBF16, cuda::device_allocator());
  gpu().fill(out, std::nan(""));
  gpu().kda_forward({out, in.q, in.k, in.v, in.g, in.beta, in.cu, in.scale});
  Tensor out_ref(in.v_host.shape(), DType::kF64);
  cpu().kda_forward({out_ref, in.q_host, in.k_host, in.v_host, in.g_host, in.beta_host, in.cu_host, in.scale});
  expect_segments(out, out_ref, row_elements, kKdaOut, "kda out");
}

TEST_CASE("cuda kda backward past 2^31 elements per tensor (repeated 200-token segments)") {
  if (!device_has(128, "kda backward past 2^31")) return;
  const KdaInputs in;
  const int64_t row_elements = KdaInputs::kHeads * KdaInputs::kDim;
  const Shape shape{in.tokens, KdaInputs::kHeads, KdaInputs::kDim};
  const Tensor dout_host = rounded_block(in.v_host.shape(), 705, DType::kBF16);
  const Tensor dout = repeated_rows(dout_host.view(), in.tokens, DType::kBF16);
  Tensor dq(shape, DType::kBF16, cuda::device_allocator()), dk(shape, DType::kBF16, cuda::device_allocator()),
      dv(shape, DType::kBF16, cuda::device_allocator()), dg(shape, DType::kF32, cuda::device_allocator()),
      dbeta({in.tokens, KdaInputs::kHeads}, DType::kF32, cuda::device_allocator());
  for (Tensor* t : {&dq, &dk, &dv, &dg, &dbeta}) gpu().fill(*t, std::nan(""));
  gpu().kda_backward({dq, dk, dv, dg, dbeta, dout, in.q, in.k, in.v, in.g, in.beta, in.cu, in.scale});
  const Shape one = in.v_host.shape();
  Tensor dq_ref(one, DType::kF64), dk_ref(one, DType::kF64), dv_ref(one, DType::kF64), dg_ref(one, DType::kF64),
      dbeta_ref(in.beta_host.shape(), DType::kF64);
  cpu().kda_backward({dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dout_host, in.q_host, in.k_host, in.v_host,
                      in.g_host, in.beta_host, in.cu_host, in.scale});
  expect_segments(dq, dq_ref, row_elements, kKdaGrad, "kda dq");
  expect_segments(dk, dk_ref, row_elements, kKdaGrad, "kda dk");
  expect_segments(dv, dv_ref, row_elements, kKdaGrad, "kda dv");
  expect_segments(dg, dg_ref, row_elements, kKdaGrad, "kda dg");
  expect_segments(dbeta, dbeta_ref, row_elements, kKdaGrad, "kda dbeta");
}

TEST_CASE("cuda short_conv forward and backward past 2^31 elements and 65,535 token tiles") {
  const int64_t length = 1000, channels = 512, width = 4;
  const int64_t segments = 4500;  // 4.5M tokens: 70,313 tiles of 64, 2.3e9 elements
  const int64_t tokens = segments * length;
  if (!device_has(24, "short_conv past 2^31")) return;
  const Tensor x_host = rounded_block({length, channels}, 800, DType::kBF16);
  const Tensor weight_host = rounded_block({channels, width}, 801, DType::kBF16, 0.1, 0.8);
  const Tensor dy_host = rounded_block({length, channels}, 802, DType::kBF16);
  const Tensor cu_host = int_host({0, static_cast<int32_t>(length)});
  const Tensor x = repeated_rows(x_host.view(), tokens, DType::kBF16);
  const Tensor weight = upload(weight_host.view(), DType::kBF16);
  const Tensor cu = upload(int_host(repeated_segments(segments, length)).view(), DType::kI32);
  {
    Tensor y({tokens, channels}, DType::kBF16, cuda::device_allocator());
    gpu().fill(y, std::nan(""));
    gpu().short_conv_forward({y, x, weight, cu, /*silu=*/true});
    Tensor y_ref({length, channels}, DType::kF64);
    cpu().short_conv_forward({y_ref, x_host, weight_host, cu_host, true});
    expect_segments(y, y_ref, channels, tolerance_for(DType::kBF16), "short_conv y");
  }
  const Tensor dy = repeated_rows(dy_host.view(), tokens, DType::kBF16);
  Tensor dx({tokens, channels}, DType::kBF16, cuda::device_allocator());
  Tensor dweight({channels, width}, DType::kF32, cuda::device_allocator());
  gpu().fill(dx, std::nan(""));
  gpu().short_conv_backward({dx, dweight, dy, x, weight, cu, true});
  Tensor dx_ref({length, channels}, DType::kF64), dweight_ref({channels, width}, DType::kF64);
  cpu().short_conv_backward({dx_ref, dweight_ref, dy_host, x_host, weight_host, cu_host, true});
  expect_segments(dx, dx_ref, channels, tolerance_for(DType::kBF16), "short_conv dx");
  // Every segment adds the one segment's dweight.
  for (int64_t i = 0; i < dweight_ref.numel(); ++i) dweight_ref.ptr<double>()[i] *= static_cast<double>(segments);
  CUDA_TEST_EXPECT_CLOSE(dweight, dweight_ref.view(), (Tolerance{1e-4, 1e-3, 1e-4}), "short_conv dweight");
}

}  // namespace
}  // namespace moetrain::cuda_test
