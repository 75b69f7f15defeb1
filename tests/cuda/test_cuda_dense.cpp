// CUDA dense ops against the CPU reference (F64): gemm (every transpose, BF16/F32 operands,
// alpha/beta, k = 0), grouped_gemm (M- and K-grouped, empty groups), axpby, sum_squares,
// copy_columns, sum_over_heads, and the memory ops (copy, convert, fill).
// GEMM inputs are rounded to BF16 on both sides: the GPU rounds F32 operands to BF16 before the
// tensor-core product (ops.h), so the reference starts from the same values.
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

using kernels::GemmArgs;
using kernels::GroupedGemmArgs;
using kernels::GroupedGemmKind;

struct DtypeCase {
  DType a, b, c;
};

// The GEMM `settings` describes (transposes, alpha, beta) of a, b into c, on the GPU and on the
// CPU reference.
void gemm_on_both(const GemmArgs& settings, const Operand& a, const Operand& b, Operand& c) {
  const auto gemm_args = [&](BackendSide on) {
    GemmArgs args = settings;
    args.a = on(a);
    args.b = on(b);
    args.c = on(c);
    return args;
  };
  gpu().gemm(gemm_args(kGpu));
  cpu().gemm(gemm_args(kCpu));
}

TEST_CASE("cuda gemm matches the CPU for every transpose, dtype mix and beta") {
  const std::vector<DtypeCase> dtypes = {{DType::kBF16, DType::kBF16, DType::kBF16},
                                         {DType::kBF16, DType::kBF16, DType::kF32},
                                         {DType::kF32, DType::kF32, DType::kF32},
                                         {DType::kF32, DType::kBF16, DType::kBF16}};
  struct Dims {
    int64_t m, n, k;
  };
  const std::vector<Dims> sizes = {{37, 23, 45}, {1, 19, 33}, {70, 1, 9}, {64, 48, 80}};
  uint64_t seed = 100;
  for (const DtypeCase& dt : dtypes)
    for (const Dims& d : sizes)
      for (int transposes = 0; transposes < 4; ++transposes)
        for (double beta : {0.0, 0.5}) {
          const bool ta = transposes & 1, tb = transposes & 2;
          const Operand a = gemm_input(ta ? Shape{d.k, d.m} : Shape{d.m, d.k}, dt.a, ++seed);
          const Operand b = gemm_input(tb ? Shape{d.n, d.k} : Shape{d.k, d.n}, dt.b, ++seed);
          // beta == 0: c starts as NaN on the GPU (it must not be read); else random values.
          Operand c = beta == 0.0 ? output_operand({d.m, d.n}, dt.c) : random_operand({d.m, d.n}, dt.c, ++seed);
          GemmArgs settings;
          settings.transpose_a = ta;
          settings.transpose_b = tb;
          settings.alpha = 1.5;
          settings.beta = beta;
          gemm_on_both(settings, a, b, c);
          const std::string name = std::string("gemm ") + dtype_name(dt.a) + "/" + dtype_name(dt.b) + "->" +
                                   dtype_name(dt.c) + " m" + std::to_string(d.m) + " n" + std::to_string(d.n) + " k" +
                                   std::to_string(d.k) + (ta ? " aT" : "") + (tb ? " bT" : "") + " beta " +
                                   std::to_string(beta);
          CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(dt.c), name);
        }
}

TEST_CASE("cuda gemm with k = 0 writes beta * c") {
  for (DType c_dtype : {DType::kF32, DType::kBF16}) {
    for (double beta : {0.0, 0.5}) {
      const Operand a = gemm_input({5, 0}, DType::kBF16, 1);
      const Operand b = gemm_input({0, 7}, DType::kBF16, 2);
      Operand c = beta == 0.0 ? output_operand({5, 7}, c_dtype) : random_operand({5, 7}, c_dtype, 3);
      GemmArgs settings;
      settings.beta = beta;
      gemm_on_both(settings, a, b, c);
      CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(c_dtype), "gemm k=0 beta " + std::to_string(beta));
    }
  }
}

TEST_CASE("cuda grouped_gemm M-grouped matches the CPU, with empty groups") {
  const std::vector<int32_t> sizes = {0, 7, 0, 13, 1, 0};
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back(), k = 37, n = 29;
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  uint64_t seed = 500;
  for (DtypeCase dt : {DtypeCase{DType::kBF16, DType::kBF16, DType::kBF16}, DtypeCase{DType::kF32, DType::kF32, DType::kF32},
                       DtypeCase{DType::kBF16, DType::kBF16, DType::kF32}})
    for (bool tb : {true, false})
      for (double beta : {0.0, 0.75}) {
        const Operand a = gemm_input({rows, k}, dt.a, ++seed);
        const Operand b = gemm_input(tb ? Shape{groups, n, k} : Shape{groups, k, n}, dt.b, ++seed);
        Operand c = beta == 0.0 ? output_operand({rows, n}, dt.c) : random_operand({rows, n}, dt.c, ++seed);
        const auto grouped_args = [&](BackendSide on) {
          GroupedGemmArgs args;
          args.kind = GroupedGemmKind::kMGrouped;
          args.transpose_b = tb;
          args.alpha = 0.5;
          args.beta = beta;
          args.a = on(a);
          args.b = on(b);
          args.c = on(c);
          args.group_offsets = on(group_offsets);
          // Half the cases pass the offsets' host copy, which the backend then does not read back.
          args.host_group_offsets = tb ? offsets.data() : nullptr;
          return args;
        };
        gpu().grouped_gemm(grouped_args(kGpu));
        cpu().grouped_gemm(grouped_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(dt.c),
                               std::string("grouped M ") + dtype_name(dt.a) + "->" + dtype_name(dt.c) +
                                   (tb ? " bT (host offsets)" : "") + " beta " + std::to_string(beta));
      }
}

TEST_CASE("cuda grouped_gemm K-grouped matches the CPU; empty groups get beta * c") {
  const std::vector<int32_t> sizes = {5, 0, 11, 0, 1};
  const std::vector<int32_t> offsets = prefix_sums(sizes);
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = offsets.back(), n_out = 19, n_in = 27;
  const Operand group_offsets = int_operand(offsets, {groups + 1});
  uint64_t seed = 700;
  for (DtypeCase dt : {DtypeCase{DType::kBF16, DType::kBF16, DType::kF32}, DtypeCase{DType::kF32, DType::kF32, DType::kF32},
                       DtypeCase{DType::kBF16, DType::kBF16, DType::kBF16}})
    for (double beta : {0.0, 1.0}) {
      const Operand a = gemm_input({rows, n_out}, dt.a, ++seed);
      const Operand b = gemm_input({rows, n_in}, dt.b, ++seed);
      Operand c = beta == 0.0 ? output_operand({groups, n_out, n_in}, dt.c)
                              : random_operand({groups, n_out, n_in}, dt.c, ++seed);
      const auto grouped_args = [&](BackendSide on) {
        GroupedGemmArgs args;
        args.kind = GroupedGemmKind::kKGrouped;
        args.beta = beta;
        args.a = on(a);
        args.b = on(b);
        args.c = on(c);
        args.group_offsets = on(group_offsets);
        return args;
      };
      gpu().grouped_gemm(grouped_args(kGpu));
      cpu().grouped_gemm(grouped_args(kCpu));
      CUDA_TEST_EXPECT_CLOSE(c.dev, c.host.view(), gemm_tolerance(dt.c),
                             std::string("grouped K ") + dtype_name(dt.a) + "->" + dtype_name(dt.c) + " beta " +
                                 std::to_string(beta));
    }
}

TEST_CASE("cuda grouped_gemm rejects host offsets that do not cover the rows") {
  // The caller's host copy is checked; device offsets alone are never read back (see
  // test_cuda_grouped_gemm.cpp for what the kernel does with wrong ones).
  const std::vector<int32_t> bad = {0, 3, 2};
  const Operand group_offsets = int_operand(bad, {3});
  const Operand a = gemm_input({2, 4}, DType::kBF16, 1);
  const Operand b = gemm_input({2, 5, 4}, DType::kBF16, 2);
  Operand c = output_operand({2, 5}, DType::kF32);
  GroupedGemmArgs args;
  args.a = a.dev;
  args.b = b.dev;
  args.c = c.dev;
  args.group_offsets = group_offsets.dev;
  args.host_group_offsets = bad.data();
  CHECK(testing::contains(testing::error_message([&] { gpu().grouped_gemm(args); }), "group_offsets decreases"));
}

TEST_CASE("cuda axpby matches the CPU (scalar and vector paths, beta 0 does not read y)") {
  uint64_t seed = 900;
  for (int64_t n : {int64_t{1001}, int64_t{4096}})
    for (DType y_dtype : {DType::kF32, DType::kBF16})
      for (DType x_dtype : {DType::kF32, DType::kBF16})
        for (double beta : {0.0, -0.25}) {
          const Operand x = random_operand({n}, x_dtype, ++seed);
          Operand y = beta == 0.0 ? output_operand({n}, y_dtype) : random_operand({n}, y_dtype, ++seed);
          gpu().axpby(y.dev, x.dev, 1.75, beta);
          cpu().axpby(y.host, x.host, 1.75, beta);
          CUDA_TEST_EXPECT_CLOSE(y.dev, y.host.view(), tolerance_for(y_dtype),
                                 std::string("axpby ") + dtype_name(y_dtype) + "+=" + dtype_name(x_dtype) + " n " +
                                     std::to_string(n) + " beta " + std::to_string(beta));
        }
}

TEST_CASE("cuda sum_squares matches the CPU and is reproducible") {
  uint64_t seed = 1000;
  for (int64_t n : {int64_t{1}, int64_t{12345}, int64_t{1} << 20})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const Operand x = random_operand({n}, dtype, ++seed);
      const double expected = cpu().sum_squares(x.host);
      const double first = gpu().sum_squares(x.dev);
      const double second = gpu().sum_squares(x.dev);
      INFO("n " << n << " " << dtype_name(dtype) << ": gpu " << first << ", cpu " << expected);
      CHECK(std::fabs(first - expected) <= 1e-10 * expected);  // exact squares summed in double
      CHECK(std::memcmp(&first, &second, sizeof first) == 0);
    }
  CHECK(gpu().sum_squares(poisoned({0}, DType::kF32)) == 0.0);
}

TEST_CASE("cuda copy_columns matches the CPU (aligned and odd columns, repeat, accumulate)") {
  struct Case {
    int64_t src_rows, repeat, dst_width, src_width, dst_col, src_col, cols;
  };
  const std::vector<Case> cases = {{9, 1, 40, 24, 8, 8, 16}, {7, 3, 13, 11, 3, 5, 6}, {5, 4, 64, 64, 0, 0, 64}};
  uint64_t seed = 1100;
  for (const Case& k : cases)
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (bool accumulate : {false, true}) {
        const Operand src = random_operand({k.src_rows, k.src_width}, dtype, ++seed);
        // Columns outside the copied range must keep their values, so dst starts random.
        Operand dst = random_operand({k.src_rows * k.repeat, k.dst_width}, dtype, ++seed);
        const auto copy_args = [&](BackendSide on) {
          kernels::CopyColumnsArgs args;
          args.dst_col = k.dst_col;
          args.src_col = k.src_col;
          args.cols = k.cols;
          args.src_row_repeat = k.repeat;
          args.accumulate = accumulate;
          args.dst = on(dst);
          args.src = on(src);
          return args;
        };
        gpu().copy_columns(copy_args(kGpu));
        cpu().copy_columns(copy_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(dst.dev, dst.host.view(), tolerance_for(dtype),
                               std::string("copy_columns ") + dtype_name(dtype) + " cols " + std::to_string(k.cols) +
                                   (accumulate ? " +=" : ""));
      }
}

TEST_CASE("cuda copy_block matches the CPU (mixed dtypes, aligned and odd blocks, scale, accumulate)") {
  struct Case {
    int64_t batch, dst_rows, dst_width, src_rows, src_width, dst_row, dst_col, src_row, src_col, rows, cols;
  };
  // The adapter packing's shapes in small (a block-diagonal [G, 2F, 2r] from [G, F, r]), and odd ones.
  const std::vector<Case> cases = {{3, 64, 32, 32, 16, 32, 16, 0, 0, 32, 16},
                                   {2, 9, 13, 7, 11, 1, 3, 2, 5, 4, 6},
                                   {4, 32, 24, 64, 48, 0, 8, 16, 24, 16, 16}};
  const std::vector<std::pair<DType, DType>> dtypes = {
      {DType::kF32, DType::kF32}, {DType::kBF16, DType::kF32}, {DType::kBF16, DType::kBF16}};
  uint64_t seed = 1150;
  for (const Case& k : cases)
    for (const auto& [dst_dtype, src_dtype] : dtypes)
      for (bool accumulate : {false, true}) {
        const Operand src = random_operand({k.batch, k.src_rows, k.src_width}, src_dtype, ++seed);
        Operand dst = random_operand({k.batch, k.dst_rows, k.dst_width}, dst_dtype, ++seed);
        kernels::CopyBlockArgs args{dst.dev, src.dev, k.dst_row, k.dst_col, k.src_row,
                                    k.src_col, k.rows,   k.cols,    2.0,     accumulate};
        gpu().copy_block(args);
        args.dst = dst.host;
        args.src = src.host;
        cpu().copy_block(args);
        CUDA_TEST_EXPECT_CLOSE(dst.dev, dst.host.view(), tolerance_for(dst_dtype),
                               std::string("copy_block ") + dtype_name(dst_dtype) + " <- " + dtype_name(src_dtype) +
                                   " cols " + std::to_string(k.cols) + (accumulate ? " +=" : ""));
      }
}

TEST_CASE("cuda sum_over_heads matches the CPU") {
  uint64_t seed = 1200;
  for (Shape shape : {Shape{7, 3, 13}, Shape{5, 4, 16}, Shape{3, 1, 8}})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const Operand src = random_operand(shape, dtype, ++seed);
      Operand dst = output_operand({shape[0], shape[2]}, dtype);
      gpu().sum_over_heads(dst.dev, src.dev);
      cpu().sum_over_heads(dst.host, src.host);
      CUDA_TEST_EXPECT_CLOSE(dst.dev, dst.host.view(), tolerance_for(dtype),
                             std::string("sum_over_heads ") + dtype_name(dtype) + " " + shape.str());
    }
}

TEST_CASE("cuda copy moves bytes between host and device both ways") {
  const Tensor host = testing::random_tensor({1003}, DType::kF32, 5);
  Tensor device(host.shape(), DType::kF32, cuda::device_allocator());
  Tensor device2(host.shape(), DType::kF32, cuda::device_allocator());
  Tensor back(host.shape(), DType::kF32);
  gpu().copy(device, host);
  gpu().copy(device2, device);
  gpu().copy(back, device2);
  CHECK(std::memcmp(back.data(), host.data(), host.nbytes()) == 0);
}

TEST_CASE("cuda convert matches the host conversion") {
  const Tensor source = testing::random_tensor({1001}, DType::kF32, 6, 1e-3, 300.0);
  const Tensor device_f32 = upload(source.view(), DType::kF32);
  for (DType target : {DType::kBF16, DType::kF16, DType::kF64}) {
    Tensor converted = poisoned(source.shape(), target);
    gpu().convert(converted, device_f32);
    Tensor expected(source.shape(), target);
    convert_host(expected.view(), source.view());
    Tensor actual(source.shape(), target);
    gpu().copy(actual, converted);
    INFO("F32 -> " << dtype_name(target));
    CHECK(std::memcmp(actual.data(), expected.data(), expected.nbytes()) == 0);
    // And back to F32: BF16/F16/F64 values are exact in F32 (or, F64, the original values).
    Tensor round_trip = poisoned(source.shape(), DType::kF32);
    gpu().convert(round_trip, converted);
    Tensor expected_back(source.shape(), DType::kF32);
    convert_host(expected_back.view(), expected.view());
    Tensor actual_back(source.shape(), DType::kF32);
    gpu().copy(actual_back, round_trip);
    CHECK(std::memcmp(actual_back.data(), expected_back.data(), expected_back.nbytes()) == 0);
  }
  std::vector<int32_t> ids = {0, -5, 7, 2147483647, -2147483647};
  const Operand i32 = int_operand(ids, {5});
  Tensor i64 = poisoned({5}, DType::kI64);
  gpu().convert(i64, i32.dev);
  Tensor back = poisoned({5}, DType::kI32);
  gpu().convert(back, i64);
  const Tensor wide = download(i64), narrow = download(back);
  for (int i = 0; i < 5; ++i) {
    CHECK(wide.ptr<int64_t>()[i] == ids[static_cast<size_t>(i)]);
    CHECK(narrow.ptr<int32_t>()[i] == ids[static_cast<size_t>(i)]);
  }
}

TEST_CASE("cuda fill writes the CPU's element bytes in every dtype") {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI32, DType::kI64, DType::kU8}) {
    const double value = is_floating(dtype) ? 0.3 : 7.0;
    Tensor device = poisoned({37}, dtype);
    gpu().fill(device, value);
    Tensor expected({37}, dtype);
    cpu().fill(expected, value);
    Tensor actual({37}, dtype);
    gpu().copy(actual, device);
    INFO("fill " << dtype_name(dtype));
    CHECK(std::memcmp(actual.data(), expected.data(), expected.nbytes()) == 0);
  }
}

TEST_CASE("cuda backend rejects host tensors and non-float dtypes") {
  const Tensor host = testing::random_tensor({4}, DType::kF32, 1);
  Tensor device = poisoned({4}, DType::kF32);
  CHECK(testing::contains(testing::error_message([&] { gpu().axpby(device, host, 1.0, 0.0); }), "is on cpu, not cuda"));
  Tensor ints = poisoned({4}, DType::kI32);
  CHECK(testing::contains(testing::error_message([&] { gpu().axpby(device, ints, 1.0, 0.0); }), "expected BF16 or F32"));
}

}  // namespace
}  // namespace moetrain::cuda_test
