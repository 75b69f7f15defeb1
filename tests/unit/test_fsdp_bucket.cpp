// FsdpBucket's stream ordering, through a communicator that records its calls (the ordering
// calls are no-ops on MPI and only matter on NCCL, where no CPU test can watch them): a gather
// is queued after the compute so far (wait_for) and compute is ordered after it only at ready()
// (release_to), so a prefetched gather can run while the current layer computes.
#include <cstring>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/fsdp_bucket.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

// Rank `r` of 2 (0 by default); the other rank's shard is taken to equal this one's.
class RecordingComm final : public Communicator {
 public:
  explicit RecordingComm(int r = 0) : rank_(r) {}
  std::vector<std::string> calls;
  int rank() const override { return rank_; }
  int size() const override { return 2; }
  Device device() const override { return Device::kCPU; }
  void barrier() override { calls.push_back("barrier"); }
  void synchronize() override { calls.push_back("synchronize"); }
  void wait_for(void*) override { calls.push_back("wait_for"); }
  void release_to(void*) override { calls.push_back("release_to"); }

 protected:
  void all_gather_elements(void* out, const void* in, int64_t count, DType dtype) override {
    calls.push_back("all_gather");
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    for (int r = 0; r < 2; ++r) std::memcpy(static_cast<char*>(out) + r * bytes, in, bytes);
  }
  void reduce_scatter_elements(void*, const void*, int64_t, DType) override { FAIL("unexpected"); }
  void all_reduce_elements(void*, int64_t, DType, ReduceOp) override { FAIL("unexpected"); }
  void all_to_all_v_elements(void*, const void*, const AllToAllLayout&, DType) override { FAIL("unexpected"); }
  void broadcast_elements(void*, int64_t, DType, int) override { FAIL("unexpected"); }

 private:
  int rank_;
};

}  // namespace

TEST_CASE("an FSDP gather is queued after the compute so far and awaited only from ready()") {
  auto backend = kernels::make_cpu_backend();
  RecordingComm comm;
  Tensor a({3, 2}, DType::kF32), b({5}, DType::kF32);
  FsdpBucket bucket("layer", {&a, &b}, comm, *backend);
  CHECK(bucket.shard_bytes() == 24);  // 11 F32 elements, padded to 12, over 2 ranks
  CHECK(a.data() == nullptr);           // placeholders until gathered

  bucket.gather();
  CHECK(comm.calls == std::vector<std::string>({"wait_for", "all_gather"}));
  REQUIRE(a.data() != nullptr);  // members point into the gathered buffer
  CHECK(a.shape() == Shape({3, 2}));
  bucket.gather();  // already gathered: nothing more
  CHECK(comm.calls.size() == 2);

  bucket.ready();
  bucket.ready();  // once per gather
  CHECK(comm.calls == std::vector<std::string>({"wait_for", "all_gather", "release_to"}));

  bucket.release();
  CHECK(a.data() == nullptr);
  CHECK_FALSE(bucket.gathered());
  CHECK(comm.calls.size() == 3);  // no host wait on the communicator: the backend's queue waited for it
}

TEST_CASE("a prefetched bucket released unused is still ordered before its buffer is freed") {
  auto backend = kernels::make_cpu_backend();
  RecordingComm comm;
  Tensor a({4}, DType::kF32);
  FsdpBucket bucket("layer", {&a}, comm, *backend);
  bucket.gather();
  bucket.release();
  CHECK(comm.calls == std::vector<std::string>({"wait_for", "all_gather", "release_to"}));
  CHECK_THROWS(bucket.ready());  // ready() needs a gathered bucket
}

TEST_CASE("an FSDP bucket holds members of different dtypes, each shard part whole elements") {
  auto backend = kernels::make_cpu_backend();
  // Codes 40 B at 0, scales 12 B at 40, the norm 40 B at 52: 92 B, in 4-byte units 48 B a rank;
  // rank 0 of 2 owns [0, 48): the codes and two of the three scales.
  RecordingComm comm;
  Tensor codes({5, 8}, DType::kU8), scales({3}, DType::kF32), norm({10}, DType::kF32);
  FsdpBucket bucket("layer", {&codes, &scales, &norm}, comm, *backend);
  CHECK(bucket.full_bytes() == 92);
  CHECK(bucket.shard_bytes() == 48);
  const FsdpBucket::OwnedPart* code_part = bucket.owned_part(&codes);
  const FsdpBucket::OwnedPart* scale_part = bucket.owned_part(&scales);
  const FsdpBucket::OwnedPart* norm_part = bucket.owned_part(&norm);
  REQUIRE((code_part && scale_part && norm_part));
  CHECK((code_part->begin == 0 && code_part->end == 40 && code_part->dst.dtype == DType::kU8));
  CHECK((scale_part->begin == 0 && scale_part->end == 2 && scale_part->dst.dtype == DType::kF32));
  CHECK((norm_part->begin == 0 && norm_part->end == 0));  // its 40 bytes start at 52: rank 1's
  for (int i = 0; i < 40; ++i) static_cast<uint8_t*>(code_part->dst.data)[i] = static_cast<uint8_t>(i);
  for (int i = 0; i < 2; ++i) scale_part->dst.ptr<float>()[i] = 0.5f * (i + 1);
  bucket.gather();
  REQUIRE(codes.data() != nullptr);
  CHECK(codes.dtype() == DType::kU8);
  CHECK(scales.dtype() == DType::kF32);
  CHECK(static_cast<const uint8_t*>(codes.data())[39] == 39);
  CHECK(scales.ptr<float>()[1] == 1.0f);
  CHECK(static_cast<const char*>(scales.data()) - static_cast<const char*>(codes.data()) == 40);
}

TEST_CASE("an FSDP member wholly on another rank owns an empty part") {
  auto backend = kernels::make_cpu_backend();
  RecordingComm comm(1);  // rank 1 owns bytes [48, 96): the last scale and the norm
  Tensor codes({5, 8}, DType::kU8), scales({3}, DType::kF32), norm({10}, DType::kF32);
  FsdpBucket bucket("layer", {&codes, &scales, &norm}, comm, *backend);
  const FsdpBucket::OwnedPart* code_part = bucket.owned_part(&codes);
  const FsdpBucket::OwnedPart* norm_part = bucket.owned_part(&norm);
  REQUIRE((code_part && norm_part));
  CHECK(code_part->end == code_part->begin);
  CHECK(code_part->dst.numel() == 0);
  CHECK((norm_part->begin == 0 && norm_part->end == 10 && norm_part->dst.dtype == DType::kF32));
  const FsdpBucket::OwnedPart* scale_part = bucket.owned_part(&scales);
  CHECK((scale_part->begin == 2 && scale_part->end == 3));
}
