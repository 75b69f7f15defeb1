// CUDA rmsnorm, rope, embedding and swiglu against the CPU reference (F64), in F32 and BF16,
// at widths that take each kernel layout (the vector/row kernels and the fallbacks).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

// A second operand holding `source`'s values (a host copy and its own upload in `dtype`): the
// buffer of an in-place run, which starts as the input.
Operand copy_of(const Operand& source, DType dtype) {
  Tensor host(source.host.shape(), DType::kF64);
  std::copy(source.host.ptr<double>(), source.host.ptr<double>() + source.host.numel(), host.ptr<double>());
  return operand_from_host(std::move(host), dtype);
}

// RMSNorm forward, then backward (dx = and +=, with and without dweight) on both backends. x, dx
// and the weight in `dtype`, y and dy in `out_dtype` (another dtype than x's takes the two-pass
// kernels). in_place: y over x, and dx over dy (without dweight, which the backends refuse).
void check_rmsnorm(int64_t rows, int64_t dim, DType dtype, DType out_dtype, bool in_place, uint64_t& seed) {
  const std::string tag = std::string(dtype_name(dtype)) + "/" + dtype_name(out_dtype) + " rows " +
                          std::to_string(rows) + " dim " + std::to_string(dim) + (in_place ? " in place" : "");
  Operand x = random_operand({rows, dim}, dtype, ++seed);
  const Operand weight = random_operand({dim}, dtype, ++seed, 0.5, 1.5);
  Operand y = output_operand({rows, dim}, out_dtype);
  Operand rstd = output_operand({rows}, DType::kF32);
  const auto forward_args = [&](BackendSide on) {
    kernels::RmsNormArgs args;
    args.eps = 1e-5;
    args.y = on.device && in_place ? on(x) : on(y);
    args.rstd = on(rstd);
    args.x = on(x);
    args.weight = on(weight);
    return args;
  };
  gpu().rmsnorm_forward(forward_args(kGpu));
  cpu().rmsnorm_forward(forward_args(kCpu));
  CUDA_TEST_EXPECT_CLOSE(in_place ? x.dev : y.dev, y.host.view(), tolerance_for(out_dtype), "rmsnorm y " + tag);
  CUDA_TEST_EXPECT_CLOSE(rstd.dev, rstd.host.view(), tolerance_for(DType::kF32), "rmsnorm rstd " + tag);
  if (in_place) x.dev = upload(x.host.view(), dtype);  // the backward's x

  for (bool accumulate : {false, true})
    for (bool with_dweight : {true, false}) {
      if (in_place && with_dweight) continue;
      Operand dy = random_operand({rows, dim}, out_dtype, ++seed);
      Operand dx = accumulate ? random_operand({rows, dim}, dtype, ++seed) : output_operand({rows, dim}, dtype);
      if (in_place) {
        // dx is dy's memory on the GPU, holding dx's start values when accumulating: dx += f(dy)
        // with dx and dy one tensor is dx = dx + f(dx), so the CPU gets dy = dx's values too.
        dy = accumulate ? copy_of(dx, dtype) : copy_of(dy, dtype);
      }
      Operand dweight = output_operand({dim}, DType::kF32);
      const auto backward_args = [&](BackendSide on) {
        kernels::RmsNormBackwardArgs args;
        args.accumulate = accumulate;
        args.dx = on.device && in_place ? on(dy) : on(dx);
        args.dweight = with_dweight ? on(dweight) : TensorView{};
        args.dy = on(dy);
        args.x = on(x);
        args.weight = on(weight);
        args.rstd = on(rstd);  // the GPU gets the rstd it computed (F32); the CPU its own (F64)
        return args;
      };
      gpu().rmsnorm_backward(backward_args(kGpu));
      cpu().rmsnorm_backward(backward_args(kCpu));
      const std::string btag = tag + (accumulate ? " +=" : "") + (with_dweight ? " with dweight" : "");
      CUDA_TEST_EXPECT_CLOSE(in_place ? dy.dev : dx.dev, dx.host.view(), tolerance_for(dtype), "rmsnorm dx " + btag);
      if (with_dweight)
        CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32), "rmsnorm dweight " + btag);
    }
}

TEST_CASE("cuda rmsnorm forward and backward match the CPU") {
  uint64_t seed = 2000;
  // Widths for each row layout: odd (two-pass, scalar), one segment of 4 / 8 / 32 lanes, a warp
  // with 2-16 chunks per lane, rows over several warps, and rows too long for the registers.
  for (int64_t dim : {37, 24, 64, 256, 520, 1536, 4096, 7168})
    for (DType dtype : {DType::kF32, DType::kBF16}) check_rmsnorm(19, dim, dtype, dtype, false, seed);
  check_rmsnorm(3, 40000, DType::kBF16, DType::kBF16, false, seed);
  // Mixed dtypes (two-pass) and in place.
  check_rmsnorm(19, 1536, DType::kBF16, DType::kF32, false, seed);
  for (int64_t dim : {64, 4096}) check_rmsnorm(19, dim, DType::kBF16, DType::kBF16, true, seed);
}

TEST_CASE("cuda rmsnorm dweight over many rows (several partial rows) matches the CPU, reproducibly") {
  struct Shape2 {
    int64_t rows, dim;
  };
  for (Shape2 k : {Shape2{1000, 24}, Shape2{3000, 1024}, Shape2{1100, 4096}}) {
    const std::string tag = std::to_string(k.rows) + " x " + std::to_string(k.dim);
    const Operand x = random_operand({k.rows, k.dim}, DType::kBF16, 1);
    const Operand weight = random_operand({k.dim}, DType::kBF16, 2);
    const Operand dy = random_operand({k.rows, k.dim}, DType::kBF16, 3);
    const Operand rstd = random_operand({k.rows}, DType::kF32, 4, 0.5, 2.0);
    Operand dx = output_operand({k.rows, k.dim}, DType::kBF16);
    Operand dweight = output_operand({k.dim}, DType::kF32);
    const auto backward_args = [&](BackendSide on) {
      kernels::RmsNormBackwardArgs args;
      args.dx = on(dx);
      args.dweight = on(dweight);
      args.dy = on(dy);
      args.x = on(x);
      args.weight = on(weight);
      args.rstd = on(rstd);
      return args;
    };
    gpu().rmsnorm_backward(backward_args(kGpu));
    const Tensor first = download(dweight.dev);
    gpu().rmsnorm_backward(backward_args(kGpu));
    const Tensor second = download(dweight.dev);
    CHECK(std::equal(first.ptr<double>(), first.ptr<double>() + first.numel(), second.ptr<double>()));
    cpu().rmsnorm_backward(backward_args(kCpu));
    CUDA_TEST_EXPECT_CLOSE(dweight.dev, dweight.host.view(), tolerance_for(DType::kF32), "rmsnorm dweight " + tag);
    CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tolerance_for(DType::kBF16), "rmsnorm dx " + tag);
  }
}

// A rank can hold no tokens: the backward then zeroes dweight and writes nothing else. Empty dx
// and dy have no memory (both null) and must not count as aliases.
TEST_CASE("cuda rmsnorm backward with no rows zeroes dweight") {
  const int64_t dim = 64;
  const Operand x = random_operand({0, dim}, DType::kBF16, 1);
  const Operand weight = random_operand({dim}, DType::kBF16, 2);
  const Operand dy = random_operand({0, dim}, DType::kBF16, 3);
  const Operand rstd = random_operand({0}, DType::kF32, 4);
  Operand dx = output_operand({0, dim}, DType::kBF16);
  Operand dweight = output_operand({dim}, DType::kF32);  // poisoned: NaN until written
  gpu().rmsnorm_backward(kernels::RmsNormBackwardArgs{dx.dev, dweight.dev, dy.dev, x.dev, weight.dev, rstd.dev, false});
  const Tensor written = download(dweight.dev);
  for (int64_t j = 0; j < dim; ++j) CHECK(written.ptr<double>()[j] == 0.0);
}

// cos/sin tables [positions, half] of a plain rope (any angles do for the comparison), F32.
void rope_tables(Operand& cos, Operand& sin, int64_t positions, int64_t half) {
  Tensor cos_host({positions, half}, DType::kF64), sin_host({positions, half}, DType::kF64);
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -static_cast<double>(i) / static_cast<double>(half));
      cos_host.ptr<double>()[p * half + i] = std::cos(angle);
      sin_host.ptr<double>()[p * half + i] = std::sin(angle);
    }
  cos = operand_from_host(std::move(cos_host), DType::kF32);
  sin = operand_from_host(std::move(sin_host), DType::kF32);
}

TEST_CASE("cuda rope matches the CPU: both layouts, inverse, in place and not") {
  const int64_t max_positions = 40;
  struct Case {
    int64_t tokens, heads, width, col_offset, rope_dim;
  };
  uint64_t seed = 3000;
  // Vector kernel: 1, 2, 4 (MLA's 64 of 192 columns), 8 and 32 threads per row; 1 and 2 rows
  // per thread, heads that fill the last rows partly (3, 5), and 11 heads over 300 tokens: 6 head
  // groups, no power of two, for the kernel's multiply-shift division. Staged kernel: the odd shape.
  for (Case k : {Case{11, 3, 64, 0, 64}, Case{11, 3, 40, 8, 16}, Case{11, 3, 23, 5, 6}, Case{9, 32, 192, 128, 64},
                 Case{7, 5, 96, 32, 64}, Case{13, 1, 64, 0, 64}, Case{6, 4, 256, 128, 128}, Case{5, 2, 512, 0, 512},
                 Case{300, 11, 48, 16, 32}}) {
    std::vector<int32_t> position_values;
    for (int64_t t = 0; t < k.tokens; ++t) position_values.push_back(static_cast<int32_t>((t * 7) % max_positions));
    const Operand positions = int_operand(position_values, {k.tokens});
    const int64_t rows = k.tokens * k.heads;
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (auto layout : {kernels::RopeLayout::kInterleaved, kernels::RopeLayout::kHalfSplit})
        for (bool inverse : {false, true})
          for (bool in_place : {false, true}) {
            Operand cos, sin;
            rope_tables(cos, sin, max_positions, k.rope_dim / 2);
            const Operand x = random_operand({rows, k.width}, dtype, ++seed);
            // In place, out holds x's values and is rotated where it stands.
            const Operand out = in_place ? copy_of(x, dtype) : output_operand({rows, k.width}, dtype);
            const auto rope_args = [&](BackendSide on) {
              kernels::RopeArgs args;
              args.heads = k.heads;
              args.col_offset = k.col_offset;
              args.rope_dim = k.rope_dim;
              args.layout = layout;
              args.inverse = inverse;
              args.out = on(out);
              args.x = in_place ? on(out) : on(x);
              args.positions = on(positions);
              args.cos = on(cos);
              args.sin = on(sin);
              return args;
            };
            gpu().rope(rope_args(kGpu));
            cpu().rope(rope_args(kCpu));
            CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tolerance_for(dtype),
                                   std::string("rope ") + dtype_name(dtype) + " heads " + std::to_string(k.heads) +
                                       " width " + std::to_string(k.width) + " rope " + std::to_string(k.rope_dim) +
                                       (layout == kernels::RopeLayout::kInterleaved ? " interleaved" : " half-split") +
                                       (inverse ? " inverse" : "") + (in_place ? " in place" : ""));
          }
  }
}

TEST_CASE("cuda rope writes NaN into the rotated columns of a position outside the table, and nothing else") {
  const int64_t max_positions = 8, heads = 2;
  const Operand positions = int_operand({3, 8, -1, 0}, {4});  // tokens 1 and 2 are outside
  struct Case {
    int64_t width, col_offset, rope_dim;  // the vector kernel, then the staged one
  };
  for (Case k : {Case{96, 32, 64}, Case{23, 5, 6}}) {
    Operand cos, sin;
    rope_tables(cos, sin, max_positions, k.rope_dim / 2);
    const Operand x = random_operand({4 * heads, k.width}, DType::kBF16, 7);
    const Tensor q = upload(x.host.view(), DType::kBF16);
    kernels::RopeArgs args;
    args.out = q;
    args.x = q;
    args.positions = positions.dev;
    args.cos = cos.dev;
    args.sin = sin.dev;
    args.heads = heads;
    args.col_offset = k.col_offset;
    args.rope_dim = k.rope_dim;
    gpu().rope(args);
    const Tensor got = download(q);
    int64_t wrong = 0;
    for (int64_t r = 0; r < 4 * heads; ++r) {
      const bool outside = r / heads == 1 || r / heads == 2;
      for (int64_t c = 0; c < k.width; ++c) {
        const double value = got.ptr<double>()[r * k.width + c];
        const bool rotated = c >= k.col_offset && c < k.col_offset + k.rope_dim;
        if (rotated && outside) {
          wrong += !std::isnan(value);
        } else if (!rotated) {
          wrong += value != x.host.ptr<double>()[r * k.width + c];
        } else {
          wrong += std::isnan(value);
        }
      }
    }
    INFO("width " << k.width << ": " << wrong << " wrong values");
    CHECK(wrong == 0);
  }
}

TEST_CASE("cuda embedding forward and backward match the CPU, repeated ids in token order") {
  const int64_t vocab = 29, tokens = 50;
  std::vector<int32_t> id_values;
  for (int64_t t = 0; t < tokens; ++t) id_values.push_back(static_cast<int32_t>((t * t + 3) % 13));  // repeats
  const Operand ids = int_operand(id_values, {tokens});
  uint64_t seed = 4000;
  for (int64_t dim : {int64_t{17}, int64_t{32}})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const Operand table = random_operand({vocab, dim}, dtype, ++seed);
      Operand out = output_operand({tokens, dim}, dtype);
      gpu().embedding_forward(out.dev, table.dev, ids.dev);
      cpu().embedding_forward(out.host, table.host, ids.host);
      const std::string tag = std::string(dtype_name(dtype)) + " dim " + std::to_string(dim);
      CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tolerance_for(dtype), "embedding forward " + tag);

      // dtable accumulates (+=): start from random values, F32 as a parameter gradient.
      Operand dtable = random_operand({vocab, dim}, DType::kF32, ++seed);
      const Operand dout = random_operand({tokens, dim}, dtype, ++seed);
      gpu().embedding_backward(dtable.dev, dout.dev, ids.dev);
      cpu().embedding_backward(dtable.host, dout.host, ids.host);
      CUDA_TEST_EXPECT_CLOSE(dtable.dev, dtable.host.view(), tolerance_for(DType::kF32), "embedding backward " + tag);
    }
  const Operand bad = int_operand({0, 29}, {2});
  const Operand table = random_operand({vocab, 8}, DType::kF32, 1);
  Operand out = output_operand({2, 8}, DType::kF32);
  CHECK(testing::contains(testing::error_message([&] { gpu().embedding_forward(out.dev, table.dev, bad.dev); }),
                          "token id 29 at token position 1"));
}

TEST_CASE("cuda swiglu forward and backward match the CPU") {
  uint64_t seed = 5000;
  for (int64_t width : {int64_t{13}, int64_t{64}})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t rows = 21;
      // Gates over a wide range, so that the sigmoid's tails are exercised.
      const Operand gate_up = random_operand({rows, 2 * width}, dtype, ++seed, 0.05, 6.0);
      Operand h = output_operand({rows, width}, dtype);
      gpu().swiglu_forward(h.dev, gate_up.dev);
      cpu().swiglu_forward(h.host, gate_up.host);
      const std::string tag = std::string(dtype_name(dtype)) + " width " + std::to_string(width);
      CUDA_TEST_EXPECT_CLOSE(h.dev, h.host.view(), tolerance_for(dtype), "swiglu forward " + tag);

      const Operand dh = random_operand({rows, width}, dtype, ++seed);
      Operand dgate_up = output_operand({rows, 2 * width}, dtype);
      const auto backward_args = [&](BackendSide on) {
        kernels::SwigluBackwardArgs args;
        args.dgate_up = on(dgate_up);
        args.dh = on(dh);
        args.gate_up = on(gate_up);
        return args;
      };
      gpu().swiglu_backward(backward_args(kGpu));
      cpu().swiglu_backward(backward_args(kCpu));
      CUDA_TEST_EXPECT_CLOSE(dgate_up.dev, dgate_up.host.view(), tolerance_for(dtype), "swiglu backward " + tag);

      // In place: dgate_up over gate_up (a device copy of it).
      const Tensor inplace = upload(gate_up.host.view(), dtype);
      kernels::SwigluBackwardArgs in_place = backward_args(kGpu);
      in_place.dgate_up = inplace;
      in_place.gate_up = inplace;
      gpu().swiglu_backward(in_place);
      CUDA_TEST_EXPECT_CLOSE(inplace, dgate_up.host.view(), tolerance_for(dtype), "swiglu backward in place " + tag);
    }
}

}  // namespace
}  // namespace moetrain::cuda_test
