// The device communicators on GPUs (run: mpirun -np 2 mpi_nccl_comm_test [nccl|host_staged]):
//   nccl         NcclCommunicator, one rank per GPU; exits 77 (CTest's skip) when this node has
//                fewer GPUs than ranks.
//   host_staged  HostStagedCommunicator, any number of ranks sharing the GPUs; exits 77 without
//                a GPU.
// 0 when every check passed. Sums use small integers, exact in every dtype, so the reduction
// order cannot matter.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/bf16.h"
#include "core/base/error.h"
#include "parallel/comm.h"
#include "parallel/host_staged_comm.h"
#include "parallel/mesh.h"
#include "parallel/nccl_comm.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw Error(ExitCode::kInternal, "check failed: " + what);
}

void cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(ExitCode::kInternal, std::string(what) + ": " + cudaGetErrorString(status));
}

// A device copy of a host vector, and back.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) { cuda(cudaMalloc(&ptr, sizeof(T) * (n > 0 ? n : 1)), "cudaMalloc"); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    cuda(cudaMemcpy(ptr, host.data(), sizeof(T) * count, cudaMemcpyHostToDevice), "copy in");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::vector<T> host() const {
    std::vector<T> out(count);
    cuda(cudaMemcpy(out.data(), ptr, sizeof(T) * count, cudaMemcpyDeviceToHost), "copy out");
    return out;
  }
};

int pair_count(int from, int to) { return (from + 2 * to) % 3; }

void check_all(Communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();

  // all_gather, F32, with a zero count first.
  for (int64_t count : {0, 5}) {
    std::vector<float> in(count);
    for (int64_t i = 0; i < count; ++i) in[i] = static_cast<float>(me * 100 + i);
    DeviceBuffer<float> d_in(in), d_out(static_cast<size_t>(count * n));
    comm.all_gather(d_out.ptr, d_in.ptr, count);
    comm.synchronize();
    std::vector<float> out = d_out.host();
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; ++i) expect(out[r * count + i] == r * 100 + i, "all_gather F32");
    }
  }

  // reduce_scatter and all_reduce sums: F32, F64 and BF16.
  std::vector<double> rs_in(static_cast<size_t>(3 * n));
  for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = static_cast<double>(i + me);
  DeviceBuffer<double> d_rs_in(rs_in), d_rs_out(3);
  comm.reduce_scatter(d_rs_out.ptr, d_rs_in.ptr, 3);
  comm.synchronize();
  std::vector<double> rs_out = d_rs_out.host();
  for (int e = 0; e < 3; ++e) expect(rs_out[e] == n * (me * 3 + e) + n * (n - 1) / 2, "reduce_scatter F64");

  std::vector<float> ar(7);
  for (int e = 0; e < 7; ++e) ar[e] = static_cast<float>(me + e);
  DeviceBuffer<float> d_ar(ar);
  comm.all_reduce(d_ar.ptr, 7);
  comm.synchronize();
  std::vector<float> ar_out = d_ar.host();
  for (int e = 0; e < 7; ++e) expect(ar_out[e] == n * e + n * (n - 1) / 2, "all_reduce F32");

  std::vector<Bf16Bits> bf(4);
  for (int e = 0; e < 4; ++e) bf[e] = Bf16Bits{float_to_bf16(static_cast<float>(me + e))};
  DeviceBuffer<Bf16Bits> d_bf(bf);
  comm.all_reduce(d_bf.ptr, 4);
  comm.synchronize();
  std::vector<Bf16Bits> bf_out = d_bf.host();
  for (int e = 0; e < 4; ++e) {
    expect(bf16_to_float(bf_out[e].bits) == n * e + n * (n - 1) / 2, "all_reduce BF16");
  }

  std::vector<int32_t> flags = {me, -me};
  DeviceBuffer<int32_t> d_flags(flags);
  comm.all_reduce(d_flags.ptr, 2, ReduceOp::kMax);
  comm.synchronize();
  std::vector<int32_t> flags_out = d_flags.host();
  expect(flags_out[0] == n - 1 && flags_out[1] == 0, "all_reduce max I32");

  // all_to_all_v of BF16 rows with uneven and zero counts.
  std::vector<int64_t> send_rows, recv_rows;
  for (int p = 0; p < n; ++p) {
    send_rows.push_back(pair_count(me, p));
    recv_rows.push_back(pair_count(p, me));
  }
  const int64_t width = 4;
  AllToAllLayout layout = AllToAllLayout::packed(send_rows, recv_rows, width);
  std::vector<Bf16Bits> tokens(static_cast<size_t>(layout.send_extent()));
  for (int p = 0; p < n; ++p) {
    for (int64_t e = 0; e < layout.send_counts[p]; ++e) {
      tokens[layout.send_offsets[p] + e] = Bf16Bits{static_cast<uint16_t>(me * 1000 + p * 100 + e)};
    }
  }
  DeviceBuffer<Bf16Bits> d_tokens(tokens), d_received(static_cast<size_t>(layout.recv_extent()));
  comm.all_to_all_v(d_received.ptr, d_tokens.ptr, layout);
  comm.synchronize();
  std::vector<Bf16Bits> received = d_received.host();
  for (int p = 0; p < n; ++p) {
    for (int64_t e = 0; e < layout.recv_counts[p]; ++e) {
      expect(received[layout.recv_offsets[p] + e].bits == p * 1000 + me * 100 + e, "all_to_all_v BF16");
    }
  }

  // broadcast from the last rank, ordered against the legacy default stream.
  std::vector<int64_t> values = {me, me + 1, me + 2};
  DeviceBuffer<int64_t> d_values(values);
  comm.wait_for(nullptr);
  comm.broadcast(d_values.ptr, 3, n - 1);
  comm.release_to(nullptr);
  cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<int64_t> values_out = d_values.host();
  for (int i = 0; i < 3; ++i) expect(values_out[i] == n - 1 + i, "broadcast I64");
  comm.barrier();
}

// Every check over the world and over a mesh's EP group (all ranks when ep = world).
template <typename DeviceCommunicator>
void check_world_and_ep(Runtime& runtime) {
  {
    DeviceCommunicator world(MPI_COMM_WORLD);
    check_all(world);
  }
  MeshShape parallel;
  parallel.fsdp = runtime.world();
  parallel.ep = runtime.world();
  DeviceMesh mesh(MeshLayout(runtime.world(), parallel, 2 * runtime.world()));
  DeviceCommunicator ep(mesh.ep_comm());
  check_all(ep);
}

int run(Runtime& runtime, int argc, char** argv) {
  const std::string kind = argc > 1 ? argv[1] : "nccl";
  expect(kind == "nccl" || kind == "host_staged", "the communicator is nccl or host_staged, not " + kind);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  // NCCL needs a GPU of its own per rank; the staged communicator shares them.
  int usable = (kind == "nccl" ? gpus >= runtime.info().local_world : gpus >= 1) ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &usable, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!usable) {
    if (runtime.is_root()) std::printf("SKIP: %d GPU(s) for %d ranks on this node\n", gpus, runtime.info().local_world);
    return 77;
  }
  if (kind == "nccl") {
    check_world_and_ep<NcclCommunicator>(runtime);
  } else {
    check_world_and_ep<HostStagedCommunicator>(runtime);
  }
  if (runtime.is_root()) std::printf("%s communicator: all checks passed on %d ranks\n", kind.c_str(), runtime.world());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_main(argc, argv, run); }
