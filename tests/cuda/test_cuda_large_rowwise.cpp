// The row-wise CUDA ops at shapes past 2^31 elements (large_shape_support.h): embedding forward
// and backward, RMSNorm forward and backward (the row kernels and the two-pass ones), rope (the
// vector kernel and the staged one), the cross-entropy loss over a 163,840 vocabulary, the MoE
// gather and combine, and the memory ops (convert, sum_squares). Inputs repeat a random block of
// rows; the outputs of the first rows, of the rows around element 2^31 and of the last rows are
// held to the CPU reference of that block (or, for exact copies, to the block itself). Each case
// needs 5-20 GB of device memory and a few seconds on an H200.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "large_shape_support.h"

namespace moetrain::cuda_test {
namespace {

// A random F64 host block (values of magnitude [lo, hi], both signs).
Tensor random_block(Shape shape, uint64_t seed, double lo = 0.1, double hi = 1.0) {
  return testing::random_tensor(shape, DType::kF64, seed, lo, hi);
}

Tensor int_host(const std::vector<int32_t>& values) {
  Tensor t({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

// Each sampled range [start, start + block rows) of `device` against `expected` (the block's rows).
void expect_block_rows(const Tensor& device, const Tensor& expected, int64_t row_elements, Tolerance tol,
                       const std::string& name) {
  const int64_t block_rows = expected.shape()[0];
  for (int64_t start : sampled_block_starts(device.shape()[0], row_elements, block_rows)) {
    const Tensor got = download_rows(device, start, start + block_rows);
    const Result r = compare(got.view(), expected.view(), tol, name + " rows from " + std::to_string(start));
    INFO(r.message);
    CHECK(r.ok);
  }
}

TEST_CASE("cuda embedding forward and backward past 2^31 output elements") {
  const int64_t vocab = 1000, dim = 4096, tokens = kTwoPow31 / dim + 3001;  // 2.16e9 elements
  if (!device_has(10, "embedding past 2^31")) return;
  Tensor table_host = random_block({vocab, dim}, 100);
  round_host(table_host.view(), DType::kBF16);
  const Tensor table = upload(table_host.view(), DType::kBF16);
  std::vector<int32_t> id_values(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) id_values[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7 + 3) % vocab);
  const Tensor ids = upload(int_host(id_values).view(), DType::kI32);
  {
    Tensor out({tokens, dim}, DType::kBF16, cuda::device_allocator());
    gpu().fill(out, std::nan(""));
    gpu().embedding_forward(out, table, ids);
    // out[t] is table[ids[t]] bit for bit: the rows at and past element 2^31 included.
    for (int64_t start : {int64_t{0}, kTwoPow31 / dim - 4, tokens - 8}) {
      const Tensor got = download_rows(out, start, start + 8);
      int64_t wrong = 0;
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t id = id_values[static_cast<size_t>(start + r)];
        for (int64_t d = 0; d < dim; ++d)
          wrong += got.ptr<double>()[r * dim + d] != table_host.ptr<double>()[id * dim + d] ? 1 : 0;
      }
      INFO("embedding rows from " << start << ": " << wrong << " elements differ from their table rows");
      CHECK(wrong == 0);
    }
  }
  // dtable[v] = sum of dout[t] over the tokens t with id v; dout row t is block row t % 3.
  const int64_t period = 3;
  Tensor dout_block = random_block({period, dim}, 101);
  round_host(dout_block.view(), DType::kBF16);
  const Tensor dout = repeated_rows(dout_block.view(), tokens, DType::kBF16);
  Tensor dtable({vocab, dim}, DType::kF32, cuda::device_allocator());
  gpu().fill(dtable, 0.0);
  gpu().embedding_backward(dtable, dout, ids);
  std::vector<int64_t> count(static_cast<size_t>(vocab * period), 0);
  for (int64_t t = 0; t < tokens; ++t) ++count[static_cast<size_t>(id_values[static_cast<size_t>(t)] * period + t % period)];
  Tensor expected({vocab, dim}, DType::kF64);
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t d = 0; d < dim; ++d) {
      double sum = 0.0;
      for (int64_t j = 0; j < period; ++j)
        sum += static_cast<double>(count[static_cast<size_t>(v * period + j)]) * dout_block.ptr<double>()[j * dim + d];
      expected.ptr<double>()[v * dim + d] = sum;
    }
  // Each element sums about 530 values in F32.
  CUDA_TEST_EXPECT_CLOSE(dtable, expected.view(), (Tolerance{1e-4, 1e-3, 1e-4}), "embedding dtable");
}

// RMSNorm over rows x 4096 of a 3-row block; y in `y_dtype` (F32 takes the two-pass kernels).
void check_large_rmsnorm(DType y_dtype, bool backward) {
  const int64_t dim = 4096, period = 3, rows = (kTwoPow31 / dim / period + 1000) * period;
  const Tensor x_block = random_block({period, dim}, 200), w_block = random_block({dim}, 201, 0.5, 1.5);
  Tensor x_host = host_rows(x_block, 0, period), weight_host = host_rows(w_block, 0, dim);
  round_host(x_host.view(), DType::kBF16);
  round_host(weight_host.view(), DType::kBF16);
  const Tensor x = repeated_rows(x_host.view(), rows, DType::kBF16);
  const Tensor weight = upload(weight_host.view(), DType::kBF16);
  Tensor y({rows, dim}, y_dtype, cuda::device_allocator()), rstd({rows}, DType::kF32, cuda::device_allocator());
  gpu().fill(y, std::nan(""));
  gpu().rmsnorm_forward({y, rstd, x, weight, 1e-5});
  Tensor y_ref({period, dim}, DType::kF64), rstd_ref({period}, DType::kF64);
  cpu().rmsnorm_forward({y_ref, rstd_ref, x_host, weight_host, 1e-5});
  const std::string tag = std::string("rmsnorm ") + dtype_name(y_dtype) + " y";
  expect_block_rows(y, y_ref, dim, tolerance_for(y_dtype), tag);
  expect_block_rows(rstd, rstd_ref, dim, tolerance_for(DType::kF32), "rmsnorm rstd");
  if (!backward) return;
  Tensor dy_host = random_block({period, dim}, 202);
  round_host(dy_host.view(), DType::kBF16);
  const Tensor dy = repeated_rows(dy_host.view(), rows, DType::kBF16);
  y = Tensor();  // room for dx
  Tensor dx({rows, dim}, DType::kBF16, cuda::device_allocator()), dweight({dim}, DType::kF32, cuda::device_allocator());
  gpu().fill(dx, std::nan(""));
  kernels::RmsNormBackwardArgs args;
  args.dx = dx;
  args.dweight = dweight;
  args.dy = dy;
  args.x = x;
  args.weight = weight;
  args.rstd = rstd;
  gpu().rmsnorm_backward(args);
  Tensor dx_ref({period, dim}, DType::kF64), dweight_ref({dim}, DType::kF64);
  kernels::RmsNormBackwardArgs ref = args;
  ref.dx = dx_ref;
  ref.dweight = dweight_ref;
  ref.dy = dy_host;
  ref.x = x_host;
  ref.weight = weight_host;
  ref.rstd = rstd_ref;
  cpu().rmsnorm_backward(ref);
  expect_block_rows(dx, dx_ref, dim, tolerance_for(DType::kBF16), "rmsnorm dx");
  // Every block of 3 rows adds the block's dweight once.
  for (int64_t d = 0; d < dim; ++d) dweight_ref.ptr<double>()[d] *= static_cast<double>(rows / period);
  CUDA_TEST_EXPECT_CLOSE(dweight, dweight_ref.view(), (Tolerance{1e-4, 1e-3, 1e-4}), "rmsnorm dweight");
}

TEST_CASE("cuda rmsnorm forward and backward past 2^31 elements (row kernels)") {
  if (!device_has(20, "rmsnorm past 2^31")) return;
  check_large_rmsnorm(DType::kBF16, /*backward=*/true);
}

TEST_CASE("cuda rmsnorm forward past 2^31 elements (two-pass kernels)") {
  if (!device_has(16, "two-pass rmsnorm past 2^31")) return;
  check_large_rmsnorm(DType::kF32, /*backward=*/false);
}

// Rope over tokens x 128 heads x 192 columns (MLA's layout) of a 3-token block, positions
// t % 4096. col_offset 128 takes the vector kernel (in place), 4 the staged one (out of place).
void check_large_rope(int64_t col_offset, bool in_place) {
  const int64_t heads = 128, width = 192, rope_dim = 64, half = rope_dim / 2, period = 3, max_positions = 4096;
  const int64_t tokens = (kTwoPow31 / (heads * width) / period + 500) * period;
  const std::string tag = "rope col_offset " + std::to_string(col_offset) + (in_place ? " in place" : "");
  Tensor x_host = random_block({period * heads, width}, 300 + col_offset);
  round_host(x_host.view(), DType::kBF16);
  Tensor x = repeated_rows(x_host.view(), tokens * heads, DType::kBF16);
  Tensor cos_host({max_positions, half}, DType::kF64), sin_host({max_positions, half}, DType::kF64);
  for (int64_t p = 0; p < max_positions; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -static_cast<double>(i) / half);
      cos_host.ptr<double>()[p * half + i] = std::cos(angle);
      sin_host.ptr<double>()[p * half + i] = std::sin(angle);
    }
  round_host(cos_host.view(), DType::kF32);
  round_host(sin_host.view(), DType::kF32);
  const Tensor cos = upload(cos_host.view(), DType::kF32), sin = upload(sin_host.view(), DType::kF32);
  std::vector<int32_t> position_values(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) position_values[static_cast<size_t>(t)] = static_cast<int32_t>(t % max_positions);
  const Tensor positions = upload(int_host(position_values).view(), DType::kI32);
  Tensor out;
  if (!in_place) {
    out = Tensor(x.shape(), DType::kBF16, cuda::device_allocator());
    gpu().fill(out, std::nan(""));
  }
  kernels::RopeArgs args;
  args.out = in_place ? x.view() : out.view();
  args.x = x;
  args.positions = positions;
  args.cos = cos;
  args.sin = sin;
  args.heads = heads;
  args.col_offset = col_offset;
  args.rope_dim = rope_dim;
  args.layout = kernels::RopeLayout::kInterleaved;
  gpu().rope(args);
  const Tensor& result = in_place ? x : out;
  // The CPU reference of each sampled 3-token range: the block's rows at that range's positions.
  for (int64_t start : sampled_block_starts(tokens, heads * width, period)) {
    std::vector<int32_t> here(position_values.begin() + start, position_values.begin() + start + period);
    const Tensor positions_here = int_host(here);
    Tensor expected({period * heads, width}, DType::kF64);
    kernels::RopeArgs ref = args;
    ref.out = expected;
    ref.x = x_host;
    ref.positions = positions_here;
    ref.cos = cos_host;
    ref.sin = sin_host;
    cpu().rope(ref);
    const Tensor got = download_rows(result, start * heads, (start + period) * heads);
    const Result r = compare(got.view(), expected.view(), tolerance_for(DType::kBF16),
                             tag + " tokens from " + std::to_string(start));
    INFO(r.message);
    CHECK(r.ok);
  }
}

TEST_CASE("cuda rope past 2^31 elements: the vector kernel in place, the staged one out of place") {
  if (!device_has(10, "rope past 2^31")) return;
  check_large_rope(/*col_offset=*/128, /*in_place=*/true);
  check_large_rope(/*col_offset=*/4, /*in_place=*/false);
}

TEST_CASE("cuda cross_entropy past 2^31 logits (vocab 163,840), loss only and in place") {
  const int64_t vocab = 163840, period = 3, rows = (kTwoPow31 / vocab / period + 100) * period;
  if (!device_has(8, "cross_entropy past 2^31")) return;
  Tensor logits_host = random_block({period, vocab}, 400, 0.01, 8.0);
  round_host(logits_host.view(), DType::kBF16);
  Tensor logits = repeated_rows(logits_host.view(), rows, DType::kBF16);
  std::vector<int32_t> label_values(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    label_values[static_cast<size_t>(r)] = r % 5 == 2 ? -1 : static_cast<int32_t>((r * 7919 + 11) % vocab);
  const Tensor labels = upload(int_host(label_values).view(), DType::kI32);
  const double grad_scale = 1e-3;
  Tensor loss({rows}, DType::kF32, cuda::device_allocator());
  for (bool with_grad : {false, true}) {
    gpu().fill(loss, std::nan(""));
    gpu().cross_entropy({loss, with_grad ? logits.view() : TensorView{}, logits, labels, grad_scale});
    for (int64_t start : sampled_block_starts(rows, vocab, period)) {
      std::vector<int32_t> here(label_values.begin() + start, label_values.begin() + start + period);
      const Tensor labels_here = int_host(here);
      Tensor loss_ref({period}, DType::kF64), dlogits_ref({period, vocab}, DType::kF64);
      cpu().cross_entropy({loss_ref, dlogits_ref, logits_host, labels_here, grad_scale});
      const std::string tag = std::string(with_grad ? "in place" : "loss only") + " rows from " + std::to_string(start);
      const Tensor got_loss = download(loss.view().slice_rows(start, start + period));
      const Result r = compare(got_loss.view(), loss_ref.view(), tolerance_for(DType::kF32), "loss " + tag);
      INFO(r.message);
      CHECK(r.ok);
      if (!with_grad) continue;
      const Tensor got = download_rows(logits, start, start + period);
      const Result g = compare(got.view(), dlogits_ref.view(), tolerance_for(DType::kBF16), "dlogits " + tag);
      INFO(g.message);
      CHECK(g.ok);
    }
  }
}

TEST_CASE("cuda moe permute and combine past 2^31 expert-row elements") {
  const int64_t dim = 7168, top_k = 8, experts = 64, period = 3;
  const int64_t tokens = (kTwoPow31 / (dim * top_k) / period + 500) * period;  // 2.2e9 expert-row elements
  if (!device_has(12, "moe gather past 2^31")) return;
  Tensor x_host = random_block({period, dim}, 500);
  round_host(x_host.view(), DType::kBF16);
  const Tensor x = repeated_rows(x_host.view(), tokens, DType::kBF16);
  std::vector<int32_t> expert_values(static_cast<size_t>(tokens * top_k));
  for (int64_t p = 0; p < tokens * top_k; ++p)
    expert_values[static_cast<size_t>(p)] = static_cast<int32_t>((p * 37 + p / top_k) % experts);
  const Tensor topk = upload(int_host(expert_values).view().reshaped({tokens, top_k}), DType::kI32);
  Tensor offsets({experts + 1}, DType::kI32, cuda::device_allocator());
  Tensor sorted_pair({tokens * top_k}, DType::kI32, cuda::device_allocator());
  Tensor pair_row({tokens * top_k}, DType::kI32, cuda::device_allocator());
  gpu().moe_permutation({offsets, sorted_pair, pair_row, topk, experts});
  const Tensor sorted = download(sorted_pair);
  Tensor rows({tokens * top_k, dim}, DType::kBF16, cuda::device_allocator());
  gpu().fill(rows, std::nan(""));
  gpu().moe_permute(rows, x, sorted_pair, top_k);
  // rows[p] = x[sorted_pair[p] / top_k], exactly: x row t is block row t % 3.
  for (int64_t start : {int64_t{0}, kTwoPow31 / dim - 8, tokens * top_k - 16}) {
    const Tensor got = download_rows(rows, start, start + 16);
    int64_t wrong = 0;
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t token = sorted.ptr<int32_t>()[start + r] / top_k;
      for (int64_t d = 0; d < dim; ++d)
        wrong += got.ptr<double>()[r * dim + d] != x_host.ptr<double>()[(token % period) * dim + d] ? 1 : 0;
    }
    INFO("moe_permute rows from " << start << ": " << wrong << " elements differ from their tokens' rows");
    CHECK(wrong == 0);
  }
  // out[t] = sum_j weight[t, j] rows[pair_row[t, j]] = x[t] * sum_j weight[t, j]: weights 1/8 each.
  Tensor weight_host({tokens, top_k}, DType::kF64);
  std::fill(weight_host.ptr<double>(), weight_host.ptr<double>() + weight_host.numel(), 1.0 / top_k);
  const Tensor weight = upload(weight_host.view(), DType::kF32);
  Tensor out({tokens, dim}, DType::kBF16, cuda::device_allocator());
  gpu().fill(out, std::nan(""));
  gpu().moe_combine({out, rows, weight, pair_row});
  expect_block_rows(out, x_host, dim, tolerance_for(DType::kBF16), "moe_combine out");
}

TEST_CASE("cuda convert and sum_squares past 2^31 elements") {
  const int64_t period = 997, n = kTwoPow31 + 4099;
  if (!device_has(14, "convert past 2^31")) return;
  Tensor block = random_block({period}, 600);
  round_host(block.view(), DType::kBF16);
  const Tensor x = repeated_rows(block.view(), n, DType::kBF16);
  Tensor wide({n}, DType::kF32, cuda::device_allocator());
  gpu().fill(wide, std::nan(""));
  gpu().convert(wide, x);
  // Ranges of whole blocks at the start, across element 2^31 and at the end.
  for (int64_t start : {int64_t{0}, kTwoPow31 / period * period, (n / period - 1) * period}) {
    const Tensor got = download_rows(wide, start, start + period);
    int64_t wrong = 0;
    for (int64_t i = 0; i < period; ++i) wrong += got.ptr<double>()[i] != block.ptr<double>()[i] ? 1 : 0;
    INFO("convert elements from " << start << ": " << wrong << " differ");
    CHECK(wrong == 0);
  }
  double block_sum = 0.0, tail_sum = 0.0;
  for (int64_t i = 0; i < period; ++i) {
    const double v = block.ptr<double>()[i];
    block_sum += v * v;
    if (i < n % period) tail_sum += v * v;
  }
  const double expected = static_cast<double>(n / period) * block_sum + tail_sum;
  const double got = gpu().sum_squares(x);
  INFO("sum_squares " << got << ", expected " << expected);
  CHECK(std::fabs(got - expected) <= 1e-9 * expected);
}

}  // namespace
}  // namespace moetrain::cuda_test
