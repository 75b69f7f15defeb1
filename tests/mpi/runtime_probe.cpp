// One program, several modes, each run by CTest under mpirun at some rank count (or as a plain
// process). The checking modes exit 0 only if every rank saw what it should; the failing modes
// exist to show that one failing rank ends the whole job with its exit code (see
// tests/mpi/CMakeLists.txt, which asserts the codes and the time taken).
//
//   runtime_probe ranks N plain|launched   rank/world/local rank/device as expected for N ranks
//   runtime_probe collectives              allreduce, broadcast, allgather, all-to-all, barrier
//   runtime_probe mpi_check                a failing MPI call becomes an Error naming it
//   runtime_probe fail_one                 rank 1 throws a bad-data Error, the others wait
//   runtime_probe fail_std                 rank 1 throws a std::runtime_error, the others wait
//   runtime_probe fail_all                 every rank throws a bad-config Error
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/base/error.h"
#include "parallel/checks.h"
#include "parallel/runtime.h"

#ifdef MOETRAIN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace moetrain;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw Error(ExitCode::kInternal, "check failed: " + what);
}

void check_ranks(const Runtime& runtime, int expected_world, bool expect_launcher) {
  const RuntimeInfo& info = runtime.info();
  expect(info.world == expected_world,
         "world " + std::to_string(info.world) + " != expected " + std::to_string(expected_world));
  expect(info.rank >= 0 && info.rank < info.world, "rank " + std::to_string(info.rank) + " out of range");
  expect(info.under_launcher == expect_launcher,
         std::string("under_launcher is ") + (info.under_launcher ? "true" : "false"));
  int mpi_rank = -1;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank));
  expect(mpi_rank == info.rank, "runtime rank differs from MPI_Comm_rank");

  // Every rank contributes its rank: the sum says all ranks took part, each exactly once.
  int64_t my_rank = info.rank;
  int64_t rank_sum = -1;
  MPI_CHECK(MPI_Allreduce(&my_rank, &rank_sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD));
  const int64_t n = expected_world;
  expect(rank_sum == n * (n - 1) / 2, "sum of ranks " + std::to_string(rank_sum));

  // Local ranks, checked against the host names (independent of how the runtime found them):
  // on each host, the local ranks are exactly 0..local_world-1 and local_world is the count.
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_length = 0;
  MPI_CHECK(MPI_Get_processor_name(host, &host_length));
  std::vector<char> hosts(static_cast<size_t>(info.world) * MPI_MAX_PROCESSOR_NAME);
  MPI_CHECK(MPI_Allgather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME,
                          MPI_CHAR, MPI_COMM_WORLD));
  const int mine[2] = {info.local_rank, info.local_world};
  std::vector<int> locals(2 * static_cast<size_t>(info.world));
  MPI_CHECK(MPI_Allgather(mine, 2, MPI_INT, locals.data(), 2, MPI_INT, MPI_COMM_WORLD));
  std::map<std::string, std::set<int>> local_ranks_by_host;
  std::map<std::string, std::set<int>> local_worlds_by_host;
  for (int r = 0; r < info.world; ++r) {
    const std::string name(&hosts[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    expect(local_ranks_by_host[name].insert(locals[2 * r]).second,
           "two ranks on " + name + " share local rank " + std::to_string(locals[2 * r]));
    local_worlds_by_host[name].insert(locals[2 * r + 1]);
  }
  for (const auto& [name, ranks] : local_ranks_by_host) {
    const std::set<int>& worlds = local_worlds_by_host[name];
    expect(worlds.size() == 1 && *worlds.begin() == static_cast<int>(ranks.size()),
           "local_world on " + name + " does not match its " + std::to_string(ranks.size()) + " ranks");
    expect(*ranks.begin() == 0 && *ranks.rbegin() == static_cast<int>(ranks.size()) - 1,
           "local ranks on " + name + " are not 0..n-1");
  }

#ifdef MOETRAIN_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (count == 0) {
    expect(info.device == -1, "device bound without a GPU");
  } else {
    int current = -1;
    expect(cudaGetDevice(&current) == cudaSuccess, "cudaGetDevice failed");
    expect(info.device == info.local_rank % count && current == info.device,
           "device " + std::to_string(info.device) + " (current " + std::to_string(current) +
               ") is not local rank % " + std::to_string(count));
  }
#else
  expect(info.device == -1, "device bound in a build without CUDA");
#endif
  if (runtime.is_root()) std::printf("ranks: world %d ok\n", info.world);
}

void check_collectives(const Runtime& runtime) {
  const int rank = runtime.rank();
  const int world = runtime.world();

  // Allreduce: element j on rank r is r * 1000 + j; exact in double at these sizes.
  const int length = 1000;
  std::vector<double> values(length), sums(length, -1.0);
  for (int j = 0; j < length; ++j) values[j] = rank * 1000.0 + j;
  MPI_CHECK(MPI_Allreduce(values.data(), sums.data(), length, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  const double rank_total = world * (world - 1) / 2.0;
  for (int j = 0; j < length; ++j) {
    expect(sums[j] == rank_total * 1000.0 + world * static_cast<double>(j), "allreduce element " + std::to_string(j));
  }

  // Broadcast from the last rank (a non-zero root where world > 1).
  const int root = world - 1;
  std::vector<int> broadcast(257, -1);
  if (rank == root) {
    for (int j = 0; j < 257; ++j) broadcast[j] = 7 * j + 3;
  }
  MPI_CHECK(MPI_Bcast(broadcast.data(), 257, MPI_INT, root, MPI_COMM_WORLD));
  for (int j = 0; j < 257; ++j) expect(broadcast[j] == 7 * j + 3, "broadcast element " + std::to_string(j));

  // Allgather of rank^2, in rank order.
  const int square = rank * rank;
  std::vector<int> squares(world, -1);
  MPI_CHECK(MPI_Allgather(&square, 1, MPI_INT, squares.data(), 1, MPI_INT, MPI_COMM_WORLD));
  for (int r = 0; r < world; ++r) expect(squares[r] == r * r, "allgather from rank " + std::to_string(r));

  // All-to-all (expert dispatch's pattern): rank s sends s * 100 + d to rank d.
  std::vector<int> send(world), receive(world, -1);
  for (int d = 0; d < world; ++d) send[d] = rank * 100 + d;
  MPI_CHECK(MPI_Alltoall(send.data(), 1, MPI_INT, receive.data(), 1, MPI_INT, MPI_COMM_WORLD));
  for (int s = 0; s < world; ++s) expect(receive[s] == s * 100 + rank, "all-to-all from rank " + std::to_string(s));

  MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  if (runtime.is_root()) std::printf("collectives: world %d ok\n", world);
}

// A broadcast from a root that does not exist must come back as an Error naming the call,
// the file and the rank (MPI_ERRORS_RETURN is set by the runtime), not kill the job.
void check_mpi_check_macro(const Runtime& runtime) {
  int value = 0;
  std::string message;
  try {
    MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT, runtime.world() + 5, MPI_COMM_WORLD));
  } catch (const Error& error) {
    expect(error.code() == ExitCode::kInternal, "MPI_CHECK threw a non-internal code");
    message = error.what();
  }
  expect(!message.empty(), "MPI_CHECK did not throw for an invalid root");
  for (const std::string& part : {std::string("MPI_Bcast"), std::string("runtime_probe.cpp:"),
                                  "rank " + std::to_string(runtime.rank())}) {
    expect(message.find(part) != std::string::npos, "MPI_CHECK message lacks '" + part + "': " + message);
  }
  MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  if (runtime.is_root()) std::printf("mpi_check: ok (%s)\n", message.c_str());
}

// Rank 1 (rank 0 when alone) fails; every other rank blocks in a barrier that can never
// complete, so only an abort ends the job.
int fail_one(const Runtime& runtime, bool moetrain_error) {
  const int failing = runtime.world() > 1 ? 1 : 0;
  if (runtime.rank() == failing) {
    // Give the others time to be inside the barrier.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (moetrain_error) {
      MOETRAIN_CHECK(false, ExitCode::kBadData, "token id 999 >= vocab 512 in shard 0 (probe)");
    }
    throw std::runtime_error("a plain std::exception (probe)");
  }
  MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  std::printf("rank %d: barrier returned, which it must not\n", runtime.rank());
  return 0;
}

int run_mode(Runtime& runtime, int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "ranks" && argc == 4) {
    check_ranks(runtime, std::stoi(argv[2]), std::string(argv[3]) == "launched");
  } else if (mode == "collectives") {
    check_collectives(runtime);
  } else if (mode == "mpi_check") {
    check_mpi_check_macro(runtime);
  } else if (mode == "fail_one") {
    return fail_one(runtime, true);
  } else if (mode == "fail_std") {
    return fail_one(runtime, false);
  } else if (mode == "fail_all") {
    throw Error(ExitCode::kBadConfig, "parallel.fsdp = 3 does not divide world (probe, every rank)");
  } else {
    throw Error(ExitCode::kBadConfig, "usage: runtime_probe ranks N plain|launched | collectives | "
                                      "mpi_check | fail_one | fail_std | fail_all");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_main(argc, argv, run_mode); }
