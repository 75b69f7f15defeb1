// ParameterGroup's flat layout, worked out by hand: aligned offsets, the padded even split into
// shards, the segments of a rank's shard, and the parameters becoming views of the buffers.
// (The collectives over these shards are tested end to end by tests/distributed.)
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/parameter_group.h"
#include "kernels/ops.h"

using moetrain::Communicator;
using moetrain::DType;
using moetrain::Parameter;
using moetrain::ParameterGroup;
using moetrain::Tensor;

namespace {

// A group membership without a transport: ParameterGroup only asks for rank and size.
class FakeGroup final : public Communicator {
 public:
  FakeGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  moetrain::Device device() const override { return moetrain::Device::kCPU; }
  void barrier() override { FAIL("no collectives expected"); }
  void synchronize() override {}

 protected:
  void all_gather_elements(void*, const void*, int64_t, DType) override { FAIL("no collectives expected"); }
  void reduce_scatter_elements(void*, const void*, int64_t, DType) override { FAIL("no collectives expected"); }
  void all_reduce_elements(void*, int64_t, DType, moetrain::ReduceOp) override { FAIL("no collectives expected"); }
  void all_to_all_v_elements(void*, const void*, const moetrain::AllToAllLayout&, DType) override {
    FAIL("no collectives expected");
  }
  void broadcast_elements(void*, int64_t, DType, int) override { FAIL("no collectives expected"); }

 private:
  int rank_, size_;
};

Parameter make_param(const std::string& name, moetrain::Shape shape, double first) {
  Parameter p;
  p.name = name;
  p.value = Tensor(shape, DType::kF32);
  p.grad = Tensor::zeros(shape, DType::kF32);
  for (int64_t i = 0; i < p.value.numel(); ++i) p.value.ptr<float>()[i] = static_cast<float>(first + i);
  return p;
}

}  // namespace

TEST_CASE("a parameter group lays parameters out aligned and splits them evenly over its ranks") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter a = make_param("a", {5}, 1.0), b = make_param("b", {7, 10}, 100.0), c = make_param("c", {3}, -3.0);
  FakeGroup comm(/*rank=*/1, /*size=*/3);
  ParameterGroup group("test", {&a, &b, &c}, &comm, nullptr, *backend);

  // a at 0, b at 64 (5 rounded up), c at 192 (64 + 70 rounded up); 195 elements in 3 shards of
  // ceil(195 / 3) = 65 rounded up to 128: the flat buffers hold 384.
  CHECK(group.offsets() == std::vector<int64_t>({0, 64, 192}));
  CHECK(group.sharded());
  CHECK(group.shard_numel() == 128);
  CHECK(group.values().numel() == 384);
  CHECK(group.grads().numel() == 384);

  // The parameters are views of the flat buffers, with their values moved in.
  CHECK(b.value.data() == group.values().ptr<float>() + 64);
  CHECK(b.grad.data() == group.grads().ptr<float>() + 64);
  CHECK(b.value.shape() == moetrain::Shape({7, 10}));
  CHECK_FALSE(b.value.owns_memory());
  CHECK(b.value.ptr<float>()[69] == 169.0f);
  CHECK(c.value.ptr<float>()[2] == -1.0f);
  CHECK(group.values().ptr<float>()[5] == 0.0f);  // padding is zero

  // Rank 1 owns [128, 256): the last 6 elements of b, and all of c.
  const auto& segments = group.segments();
  REQUIRE(segments.size() == 2);
  CHECK(segments[0].param == &b);
  CHECK(segments[0].param_offset == 64);
  CHECK(segments[0].shard_offset == 0);
  CHECK(segments[0].count == 6);
  CHECK(segments[1].param == &c);
  CHECK(segments[1].param_offset == 0);
  CHECK(segments[1].shard_offset == 64);
  CHECK(segments[1].count == 3);
  CHECK(group.value_shard().ptr<float>() == group.values().ptr<float>() + 128);
}

TEST_CASE("without a group of ranks, one shard holds every parameter whole") {
  auto backend = moetrain::kernels::make_cpu_backend();
  Parameter a = make_param("a", {2, 3}, 0.0), b = make_param("b", {130}, 0.0);
  ParameterGroup group("test", {&a, &b}, nullptr, nullptr, *backend);
  CHECK_FALSE(group.sharded());
  CHECK(group.shard_numel() == 64 + 192);
  const auto& segments = group.segments();
  REQUIRE(segments.size() == 2);
  CHECK((segments[0].param == &a && segments[0].param_offset == 0 && segments[0].count == 6));
  CHECK((segments[1].param == &b && segments[1].shard_offset == 64 && segments[1].count == 130));
}
