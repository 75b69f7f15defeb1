// The FP8 block-scaled GEMMs on the GPU (ops.h gemm_fp8 and grouped_gemm with an F32 b_scale:
// kernels/cuda/gemm/grouped_gemm_fp8.h decoding inside the mainloop, fp8_decode.h's decode to
// scratch for the shapes it refuses) against the CPU reference in F64 and against the BF16 GEMMs
// on the same GPU fed the weight decoded on the host: the device decoding of every E4M3 code
// equals the host's exact product rounded once to BF16, bit for bit; the dense GEMM x W^T and the
// input gradient dy W at shapes with partial 128-blocks on both edges (k and n multiples of 16 for
// the mainloop kernel, of 8 only for the scratch path), BF16 and F32 operands, beta 0 and 1; the
// grouped GEMM over uneven and empty groups, on both paths.
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_support.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/gemm/fp8_decode.h"
#include "kernels/cuda/gemm/gemm.h"

namespace moetrain::cuda_test {
namespace {

using kernels::GemmArgs;
using kernels::GemmFp8Args;
using kernels::GroupedGemmArgs;
using kernels::fp8_blocks;

// An FP8 weight [groups, rows, cols] (no NaN codes) on both sides, and its decoded values: F64 on
// the host, BF16 on the device (rounded once from the exact F64 values).
struct Fp8Weight {
  Tensor codes_host, scales_host, decoded_host;
  Tensor codes, scales, decoded;
};

Fp8Weight fp8_weight(int64_t groups, int64_t rows, int64_t cols, uint64_t seed) {
  Fp8Weight w;
  w.codes_host = Tensor({groups, rows, cols}, DType::kU8);
  w.scales_host = Tensor({groups, fp8_blocks(rows), fp8_blocks(cols)}, DType::kF32);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<double> scale(0.5, 2.0);
  auto* codes = static_cast<uint8_t*>(w.codes_host.data());
  for (int64_t i = 0; i < w.codes_host.numel(); ++i) {
    do codes[i] = static_cast<uint8_t>(byte(rng));
    while ((codes[i] & 0x7F) == 0x7F);
  }
  for (int64_t i = 0; i < w.scales_host.numel(); ++i) w.scales_host.ptr<float>()[i] = static_cast<float>(scale(rng) / 256);
  w.decoded_host = Tensor({groups, rows, cols}, DType::kF64);
  const int64_t per_scale = fp8_blocks(rows) * fp8_blocks(cols);
  for (int64_t g = 0; g < groups; ++g) {
    kernels::cpu::fp8_dequantize(w.decoded_host.ptr<double>() + g * rows * cols, codes + g * rows * cols,
                                 w.scales_host.ptr<float>() + g * per_scale, rows, cols);
  }
  w.codes = upload(w.codes_host.view(), DType::kU8);
  w.scales = upload(w.scales_host.view(), DType::kF32);
  w.decoded = upload(w.decoded_host.view(), DType::kBF16);
  return w;
}

TensorView matrix(const Tensor& t) { return t.view().reshaped({t.size(1), t.size(2)}); }

using kernels::cuda_ops::Fp8GemmPath;

const char* path_name(Fp8GemmPath path) {
  return path == Fp8GemmPath::kMainloop ? ": mainloop decode" : ": decode to scratch";
}

// Against the BF16 GEMM on the host-decoded weight: the same products (each rounded once to BF16
// on both sides), summed in F32 by another kernel in another order. F32 rounding, and for a BF16
// c an output rounding that may land on the other side: one BF16 ulp, 2^-7 relative at most.
Tolerance same_products(DType c_dtype) {
  if (c_dtype == DType::kBF16) return {1e-4, 8e-3, 1e-4};
  return {1e-5, 1e-4, 1e-5};
}

}  // namespace

TEST_CASE("cuda fp8 decode: every E4M3 code times block scales equals the host's value in BF16") {
  // 258 rows of all 256 codes (NaN codes included) under 3 x 2 blocks, the last row block
  // partial; scales whose products with the codes need the single rounding to BF16.
  Tensor codes_host({1, 258, 256}, DType::kU8);
  for (int64_t i = 0; i < codes_host.numel(); ++i) static_cast<uint8_t*>(codes_host.data())[i] = static_cast<uint8_t>(i);
  Tensor scales_host({1, 3, 2}, DType::kF32);
  const float scale_values[6] = {1.0f, 0x1.fffffep-1f, 3.0f / 7.0f, 1e-3f, 0x1.000002p+10f, 0.1f};
  for (int i = 0; i < 6; ++i) scales_host.ptr<float>()[i] = scale_values[i];
  Tensor expected_wide({258, 256}, DType::kF64);
  kernels::cpu::fp8_dequantize(expected_wide.ptr<double>(), static_cast<const uint8_t*>(codes_host.data()),
                               scales_host.ptr<float>(), 258, 256);
  Tensor expected({258, 256}, DType::kBF16);
  convert_host(expected.view(), expected_wide.view());
  const Tensor scales = upload(scales_host.view(), DType::kF32);
  for (int64_t cols : {int64_t{256}, int64_t{255}}) {  // the 8-code and the 1-code kernels
    INFO("cols " << cols);
    Tensor out({258 * cols}, DType::kBF16, cuda::device_allocator());
    Tensor packed_codes_host({258, cols}, DType::kU8);
    Tensor packed_expected({258, cols}, DType::kBF16);
    for (int64_t r = 0; r < 258; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        static_cast<uint8_t*>(packed_codes_host.data())[r * cols + c] = static_cast<uint8_t>(r * 256 + c);
        packed_expected.view().ptr_u16()[r * cols + c] = expected.view().ptr_u16()[r * 256 + c];
      }
    const Tensor packed_codes = upload(packed_codes_host.view(), DType::kU8);
    CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the backend's stream
    kernels::cuda_ops::launch_fp8_decode_bf16(out.data(), packed_codes.data(), static_cast<const float*>(scales.data()),
                                              1, 258, cols, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    Tensor got({258, cols}, DType::kBF16);
    gpu().copy(got, out.view().reshaped({258, cols}));
    int64_t differ = 0;
    for (int64_t i = 0; i < got.numel(); ++i) {
      const uint16_t a = got.view().ptr_u16()[i], e = packed_expected.view().ptr_u16()[i];
      const bool nan_a = (a & 0x7F80) == 0x7F80 && (a & 0x7F), nan_e = (e & 0x7F80) == 0x7F80 && (e & 0x7F);
      differ += nan_e ? !nan_a : a != e;
    }
    CHECK(differ == 0);
  }
}

TEST_CASE("cuda gemm_fp8: x W^T and dy W with partial blocks against the CPU and the BF16 GEMM") {
  struct Run {
    DType a, c;
    bool transpose_b;
    double beta;
  };
  const Run runs[] = {{DType::kBF16, DType::kBF16, true, 0.0}, {DType::kF32, DType::kF32, true, 1.0},
                      {DType::kBF16, DType::kF32, false, 1.0}, {DType::kF32, DType::kBF16, false, 0.0}};
  struct Shape {
    int64_t out, in, rows;
    bool mainloop;  // the kernel that decodes in its mainloop takes it (on an sm_90 device)
  };
  // 2 x 2 blocks, both partial at the far edge, 37 rows (part of one tile) and 300 (two, the
  // second partial): dense products always decode to scratch (gemm.cu fp8_gemm_path).
  const Shape shapes[] = {{208, 144, 37, false}, {208, 144, 300, false}, {200, 136, 37, false}};
  uint64_t seed = 10;
  for (const Shape& shape : shapes) {
    const Fp8Weight w = fp8_weight(1, shape.out, shape.in, 5 + shape.rows);
    for (const Run& run : runs) {
      const int64_t k = run.transpose_b ? shape.in : shape.out, n = run.transpose_b ? shape.out : shape.in;
      const int64_t rows = shape.rows;
      const Operand a = gemm_input({rows, k}, run.a, seed += 10);
      Operand c = run.beta == 0.0 ? output_operand({rows, n}, run.c) : random_operand({rows, n}, run.c, seed + 1);
      const GemmFp8Args args{GemmArgs{c.dev, a.dev, matrix(w.codes), false, run.transpose_b, 0.75, run.beta},
                             matrix(w.scales)};
      const Fp8GemmPath path = kernels::cuda_ops::fp8_gemm_path(args);
      const std::string what = std::to_string(rows) + " x " + std::to_string(k) + " -> " + std::to_string(n) + " " +
                               dtype_name(run.a) + "->" + dtype_name(run.c) +
                               (run.transpose_b ? " x.W^T" : " dy.W") + " beta " + std::to_string(run.beta) +
                               path_name(path);
      INFO(what);
      if (device_is_sm90()) CHECK((path == Fp8GemmPath::kMainloop) == shape.mainloop);
      const Tensor reference_c = upload(download(c.dev).view(), run.c);
      gpu().gemm(GemmArgs{reference_c, a.dev, matrix(w.decoded), false, run.transpose_b, 0.75, run.beta});
      gpu().gemm_fp8(args);
      const Tensor same_gpu = download(reference_c);
      CUDA_TEST_EXPECT_CLOSE(c.dev, same_gpu.view(), same_products(run.c), what + " vs bf16 gemm");
      cpu().gemm_fp8(GemmFp8Args{GemmArgs{c.host, a.host, matrix(w.codes_host), false, run.transpose_b, 0.75,
                                          run.beta},
                                 matrix(w.scales_host)});
      // The GPU decodes code x scale to BF16 for the tensor cores, the CPU spec keeps it in F64:
      // the weight's BF16 rounding is the difference, whatever c's dtype.
      CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), tolerance_for(DType::kBF16), what + " vs CPU F64");
    }
  }
}

TEST_CASE("cuda grouped_gemm FP8: uneven and empty groups, partial blocks, both layouts, both paths") {
  // Groups of 0, 300 (a tile of 256 and a partial one), 129 and 1 rows: none a multiple of a tile.
  const std::vector<int32_t> sizes = {0, 300, 0, 129, 1, 64};
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back();
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  struct Shape {
    int64_t out, in;
    bool mainloop;
  };
  // 3 x 2 blocks, the last of each partial; 272 x 144: the mainloop kernel (a third column tile of
  // 16 columns, a last K step of 16), 272 x 136: the scratch path (136 not a multiple of 16).
  const Shape shapes[] = {{272, 144, true}, {272, 136, false}};
  uint64_t seed = 100;
  for (const Shape& shape : shapes) {
    const Fp8Weight w = fp8_weight(groups, shape.out, shape.in, 7 + shape.in);
    for (bool transpose_b : {true, false}) {
      for (DType c_dtype : {DType::kBF16, DType::kF32}) {
        const int64_t k = transpose_b ? shape.in : shape.out, n = transpose_b ? shape.out : shape.in;
        const Operand a = gemm_input({rows, k}, DType::kBF16, seed += 10);
        Operand c = random_operand({rows, n}, c_dtype, seed + 1);
        const Tensor reference_c = upload(download(c.dev).view(), c_dtype);
        GroupedGemmArgs args;
        args.transpose_b = transpose_b;
        args.alpha = 0.5;
        args.beta = 1.0;
        args.a = a.dev;
        args.group_offsets = group_offsets.dev;
        args.b = w.decoded;
        args.c = reference_c;
        gpu().grouped_gemm(args);
        args.b = w.codes;
        args.b_scale = w.scales;
        args.c = c.dev;
        const Fp8GemmPath path = kernels::cuda_ops::fp8_gemm_path(args);
        const std::string what = std::to_string(k) + " -> " + std::to_string(n) + " " +
                                 (transpose_b ? "x.W^T" : "dy.W") + " -> " + dtype_name(c_dtype) + path_name(path);
        INFO(what);
        if (device_is_sm90()) CHECK((path == Fp8GemmPath::kMainloop) == shape.mainloop);
        gpu().grouped_gemm(args);
        const Tensor same_gpu = download(reference_c);
        CUDA_TEST_EXPECT_CLOSE(c.dev, same_gpu.view(), same_products(c_dtype), what + " vs bf16 grouped GEMM");
        args.a = a.host;
        args.b = w.codes_host;
        args.b_scale = w.scales_host;
        args.c = c.host;
        args.group_offsets = group_offsets.host;
        args.host_group_offsets = offsets.data();
        cpu().grouped_gemm(args);
        // As in the dense case: the decoded weight's BF16 rounding.
        CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), tolerance_for(DType::kBF16), what + " vs CPU F64");
      }
    }
  }
}

}  // namespace moetrain::cuda_test
