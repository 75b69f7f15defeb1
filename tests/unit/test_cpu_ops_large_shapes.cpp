// CPU reference ops at shapes past 2^31 elements: sum_squares, the cross-entropy loss over a
// 163,840 vocabulary, the embedding backward and the MoE unpermute-sum. Each large F32 input is
// one 6 MiB block of memory mapped again and again over the whole tensor (a memfd mapped at
// consecutive addresses), so element i reads block element i mod 1,572,864 and an 8.6 GB tensor
// costs 6 MiB of memory and 17 MB of page tables. The period is not a power of two: an index
// wrapped at 2^32 elements reads another block element than the right one (and a negative one
// leaves the mapping), so the results, computed here from the block, differ. Each case reads
// every element once, a few seconds; the CTest label `large` (`ctest -LE large`) or the Catch
// tag ("~[large]") leaves them out.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch.h"
#include "kernels/ops.h"
#include "tests/support/gradcheck.h"
#include "tests/support/op_test_helpers.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

constexpr int64_t kTwoPow31 = int64_t{1} << 31;

// An F32 host tensor of `shape` whose element i is block()[i % kPeriod].
class PeriodicF32 {
 public:
  static constexpr int64_t kPeriod = 3 << 19;  // 6 MiB of floats: 384 rows of 4096
  explicit PeriodicF32(Shape shape) : shape_(shape) {
    const size_t period_bytes = kPeriod * sizeof(float);
    const size_t bytes = static_cast<size_t>(shape.numel()) * sizeof(float);
    copies_ = (bytes + period_bytes - 1) / period_bytes;
    fd_ = memfd_create("moetrain-periodic", 0);
    if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(period_bytes)) != 0) return;
    void* base = mmap(nullptr, copies_ * period_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return;
    data_ = base;
    for (size_t i = 0; i < copies_; ++i) {
      void* at = static_cast<char*>(base) + i * period_bytes;
      if (mmap(at, period_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd_, 0) != at) {
        ok_ = false;
        return;
      }
    }
    ok_ = true;
  }
  ~PeriodicF32() {
    if (data_ != nullptr) munmap(data_, copies_ * kPeriod * sizeof(float));
    if (fd_ >= 0) close(fd_);
  }
  PeriodicF32(const PeriodicF32&) = delete;
  PeriodicF32& operator=(const PeriodicF32&) = delete;

  bool mapped() const { return ok_; }
  float* block() const { return static_cast<float*>(data_); }
  float at(int64_t i) const { return block()[i % kPeriod]; }
  TensorView view() const { return TensorView{data_, DType::kF32, Device::kCPU, shape_}; }

  // The block filled with small distinct values, (i * 7919) % 1009 / 256 - 2.
  void fill_block() const {
    for (int64_t i = 0; i < kPeriod; ++i) block()[i] = static_cast<float>((i * 7919) % 1009) / 256.0f - 2.0f;
  }

 private:
  Shape shape_;
  size_t copies_ = 0;
  int fd_ = -1;
  void* data_ = nullptr;
  bool ok_ = false;
};

// Rows at the start, across element 2^31 and at the end of a [rows, width] tensor.
std::vector<int64_t> sampled_rows(int64_t rows, int64_t width) {
  const int64_t at_limit = kTwoPow31 / width;
  return {0, 1, at_limit - 1, at_limit, at_limit + 1, rows - 1};
}

}  // namespace

TEST_CASE("sum_squares over 2^31 + 4099 F32 elements", "[cpu_ops][large]") {
  auto backend = make_cpu_backend();
  const int64_t n = kTwoPow31 + 4099, period = PeriodicF32::kPeriod;
  PeriodicF32 x(Shape{n});
  REQUIRE(x.mapped());
  x.fill_block();
  double block_sum = 0.0, tail_sum = 0.0;
  for (int64_t i = 0; i < period; ++i) {
    const double v = x.block()[i];
    block_sum += v * v;
    if (i < n % period) tail_sum += v * v;
  }
  const double expected = static_cast<double>(n / period) * block_sum + tail_sum;
  const double got = backend->sum_squares(x.view());
  INFO("sum_squares " << got << ", expected " << expected);
  CHECK(std::fabs(got - expected) <= 1e-9 * expected);
}

TEST_CASE("cross_entropy loss past 2^31 logits (vocab 163,840)", "[cpu_ops][large]") {
  auto backend = make_cpu_backend();
  const int64_t vocab = 163840, rows = kTwoPow31 / vocab + 50;
  PeriodicF32 logits(Shape{rows, vocab});
  REQUIRE(logits.mapped());
  logits.fill_block();
  // Only the sampled rows are targets; the others (label -1) are not read.
  std::vector<int32_t> labels(static_cast<size_t>(rows), -1);
  const std::vector<int64_t> targets = sampled_rows(rows, vocab);
  for (int64_t r : targets) labels[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919 + 11) % vocab);
  Tensor label_tensor = make_i32(labels);
  Tensor loss({rows}, DType::kF32);
  backend->cross_entropy({loss, TensorView{}, logits.view(), label_tensor, 1.0});
  for (int64_t r : targets) {
    double max_logit = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j) max_logit = std::max(max_logit, static_cast<double>(logits.at(r * vocab + j)));
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(logits.at(r * vocab + j) - max_logit);
    const double expected = max_logit + std::log(sum) - logits.at(r * vocab + labels[static_cast<size_t>(r)]);
    // The reference sums 163,840 exponentials in float: about 1e-4 of relative error.
    INFO("row " << r << ": loss " << loss.ptr<float>()[r] << ", expected " << expected);
    CHECK(std::fabs(loss.ptr<float>()[r] - expected) <= 1e-3 * std::fabs(expected) + 1e-3);
  }
  CHECK(loss.ptr<float>()[2] == 0.0f);  // not a target
}

TEST_CASE("embedding_backward past 2^31 dout elements", "[cpu_ops][large]") {
  auto backend = make_cpu_backend();
  const int64_t vocab = 64, dim = 4096, tokens = kTwoPow31 / dim + 100;
  const int64_t period_rows = PeriodicF32::kPeriod / dim;  // dout row t is block row t % 384
  PeriodicF32 dout(Shape{tokens, dim});
  REQUIRE(dout.mapped());
  dout.fill_block();
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  std::vector<double> count(static_cast<size_t>(vocab * period_rows), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 5 + t / 1000) % vocab);
    count[static_cast<size_t>(ids[static_cast<size_t>(t)] * period_rows + t % period_rows)] += 1;
  }
  Tensor expected = Tensor::zeros({vocab, dim}, DType::kF64);
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t k = 0; k < period_rows; ++k) {
      const double c = count[static_cast<size_t>(v * period_rows + k)];
      if (c == 0) continue;
      for (int64_t d = 0; d < dim; ++d) expected.ptr<double>()[v * dim + d] += c * dout.block()[k * dim + d];
    }
  Tensor dtable = Tensor::zeros({vocab, dim}, DType::kF32);
  Tensor id_tensor = make_i32(ids);
  backend->embedding_backward(dtable, dout.view(), id_tensor);
  // dtable rows sum about 8,000 tokens' values in float.
  auto c = compare_tensors(dtable, expected, 1e-4, 1e-2, "dtable");
  INFO(c.message);
  CHECK(c.ok);
}

TEST_CASE("moe_unpermute_sum past 2^31 expert-row elements", "[cpu_ops][large]") {
  auto backend = make_cpu_backend();
  const int64_t dim = 4096, top_k = 8, tokens = kTwoPow31 / (dim * top_k) + 50, pairs = tokens * top_k;
  const int64_t period_rows = PeriodicF32::kPeriod / dim;
  PeriodicF32 drows(Shape{pairs, dim});
  REQUIRE(drows.mapped());
  drows.fill_block();
  // pair_row: the pairs in reverse order (token 0's pairs take the last rows, past element 2^31).
  std::vector<int32_t> pair_row(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) pair_row[static_cast<size_t>(p)] = static_cast<int32_t>(pairs - 1 - p);
  Tensor dx({tokens, dim}, DType::kF32);
  Tensor pair_tensor = make_i32(pair_row);
  backend->moe_unpermute_sum(dx, drows.view(), pair_tensor, top_k, /*accumulate=*/false);
  for (int64_t t : {int64_t{0}, int64_t{1}, tokens / 2, tokens - 1}) {
    Tensor expected = Tensor::zeros({1, dim}, DType::kF64), got({1, dim}, DType::kF64);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = pair_row[static_cast<size_t>(t * top_k + j)];
      for (int64_t d = 0; d < dim; ++d) expected.ptr<double>()[d] += drows.block()[(row % period_rows) * dim + d];
    }
    for (int64_t d = 0; d < dim; ++d) got.ptr<double>()[d] = dx.ptr<float>()[t * dim + d];
    auto c = compare_tensors(got, expected, 1e-6, 1e-6, "dx row " + std::to_string(t));
    INFO(c.message);
    CHECK(c.ok);
  }
}
