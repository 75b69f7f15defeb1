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

// Rank 0 of 2; the other rank's shard is taken to equal this one's.
class RecordingComm final : public Communicator {
 public:
  std::vector<std::string> calls;
  int rank() const override { return 0; }
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
};

}  // namespace

TEST_CASE("an FSDP gather is queued after the compute so far and awaited only from ready()") {
  auto backend = kernels::make_cpu_backend();
  RecordingComm comm;
  Tensor a({3, 2}, DType::kF32), b({5}, DType::kF32);
  FsdpBucket bucket("layer", {&a, &b}, comm, *backend);
  CHECK(bucket.shard_elements() == 6);  // 11 elements, padded to 12, over 2 ranks
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
