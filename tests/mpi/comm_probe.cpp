// The typed communicators and the device mesh under mpirun (2 and 4 ranks). Exits 0 only if
// every check passed on every rank; a failed check throws and run_main ends the job with 1.
//
//   comm_probe collectives              every collective of MpiCommunicator over MPI_COMM_WORLD:
//                                       every dtype it accepts, uneven and zero counts
//   comm_probe mesh FSDP EP EXPERTS     DeviceMesh groups checked against the layout, and
//                                       collectives on each sub-communicator
//
// Expected values come from closed forms or from a serial loop over ranks here, never from
// another run of the code under test.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/base/error.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"
#include "parallel/runtime.h"

using namespace moetrain;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw Error(ExitCode::kInternal, "check failed: " + what);
}

// A value of element type T that encodes (a, b, c) exactly (small integers).
template <typename T>
T encode(int a, int b, int c) {
  const int code = a * 100 + b * 10 + c;
  if constexpr (std::is_same_v<T, Bf16Bits>) {
    return Bf16Bits{static_cast<uint16_t>(code)};
  } else {
    return static_cast<T>(code % (std::is_same_v<T, uint8_t> ? 251 : 1000000));
  }
}

template <typename T>
bool same_bits(const T& x, const T& y) {
  return std::memcmp(&x, &y, sizeof(T)) == 0;
}

// Floats of many magnitudes and both signs, so that the order of a sum changes its rounding.
template <typename T>
T messy(int rank, int64_t i, int salt) {
  uint64_t h = static_cast<uint64_t>(rank * 7919 + i * 104729 + salt * 1299709) * 6364136223846793005ull + 1;
  h ^= h >> 29;
  const double mantissa = 1.0 + static_cast<double>(h % 1000003) / 1000003.0;
  const int exponent = static_cast<int>((h >> 20) % 41) - 20;
  const double sign = (h >> 40) & 1 ? -1.0 : 1.0;
  return static_cast<T>(sign * std::ldexp(mantissa, exponent));
}

template <typename T>
void check_all_gather(Communicator& comm, const char* name) {
  const int n = comm.size();
  for (int64_t count : {0, 1, 5}) {
    std::vector<T> in(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) in[i] = encode<T>(comm.rank(), static_cast<int>(i), 1);
    std::vector<T> out(static_cast<size_t>(count * n) + 1, encode<T>(9, 9, 9));
    comm.all_gather(out.data(), in.data(), count);
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        expect(same_bits(out[r * count + i], encode<T>(r, static_cast<int>(i), 1)),
               std::string("all_gather ") + name + " element " + std::to_string(i) + " of rank " + std::to_string(r));
      }
    }
    expect(same_bits(out.back(), encode<T>(9, 9, 9)), std::string("all_gather ") + name + " wrote past the end");
  }
}

// Rank s sends (s + 2 p) % 3 elements to rank p: uneven, and zero for some pairs. Receive
// blocks are placed in reverse rank order with a one-element gap, so offsets matter.
int pair_count(int from, int to) { return (from + 2 * to) % 3; }

template <typename T>
void check_all_to_all_v(Communicator& comm, const char* name) {
  const int n = comm.size();
  const int me = comm.rank();
  AllToAllLayout layout;
  int64_t send_total = 0;
  for (int p = 0; p < n; ++p) {
    layout.send_counts.push_back(pair_count(me, p));
    layout.send_offsets.push_back(send_total);
    send_total += pair_count(me, p);
  }
  int64_t recv_total = 0;
  layout.recv_counts.assign(n, 0);
  layout.recv_offsets.assign(n, 0);
  for (int p = n - 1; p >= 0; --p) {
    layout.recv_counts[p] = pair_count(p, me);
    layout.recv_offsets[p] = recv_total;
    recv_total += pair_count(p, me) + 1;
  }
  std::vector<T> in(static_cast<size_t>(send_total));
  for (int p = 0; p < n; ++p) {
    for (int j = 0; j < pair_count(me, p); ++j) in[layout.send_offsets[p] + j] = encode<T>(me, p, j);
  }
  const T sentinel = encode<T>(9, 9, 9);
  std::vector<T> out(static_cast<size_t>(recv_total), sentinel);
  comm.all_to_all_v(out.data(), in.data(), layout);
  for (int p = 0; p < n; ++p) {
    for (int j = 0; j < pair_count(p, me); ++j) {
      expect(same_bits(out[layout.recv_offsets[p] + j], encode<T>(p, me, j)),
             std::string("all_to_all_v ") + name + " element " + std::to_string(j) + " from rank " + std::to_string(p));
    }
    expect(same_bits(out[layout.recv_offsets[p] + pair_count(p, me)], sentinel),
           std::string("all_to_all_v ") + name + " wrote into the gap after rank " + std::to_string(p));
  }
}

// Sums in rank order must equal a serial loop over ranks bit for bit, on every rank.
template <typename T>
void check_sums(Communicator& comm, const char* name) {
  const int n = comm.size();
  const int me = comm.rank();
  for (int64_t count : {0, 1, 3, 13}) {
    // reduce_scatter: block b of rank r holds messy(r, b * count + e).
    std::vector<T> in(static_cast<size_t>(count * n));
    for (int64_t i = 0; i < count * n; ++i) in[i] = messy<T>(me, i, 1);
    std::vector<T> out(static_cast<size_t>(count));
    comm.reduce_scatter(out.data(), in.data(), count);
    for (int64_t e = 0; e < count; ++e) {
      T expected = messy<T>(0, me * count + e, 1);
      for (int r = 1; r < n; ++r) expected += messy<T>(r, me * count + e, 1);
      expect(same_bits(out[e], expected), std::string("reduce_scatter ") + name + " count " + std::to_string(count) +
                                              " element " + std::to_string(e) + " differs from the rank-order sum");
    }

    // all_reduce (count 13 does not split evenly over 2 or 4 ranks).
    std::vector<T> data(static_cast<size_t>(count));
    for (int64_t e = 0; e < count; ++e) data[e] = messy<T>(me, e, 2);
    comm.all_reduce(data.data(), count);
    for (int64_t e = 0; e < count; ++e) {
      T expected = messy<T>(0, e, 2);
      for (int r = 1; r < n; ++r) expected += messy<T>(r, e, 2);
      expect(same_bits(data[e], expected), std::string("all_reduce sum ") + name + " count " + std::to_string(count) +
                                               " element " + std::to_string(e) + " differs from the rank-order sum");
    }
    // And identical on every rank (checked by gathering everyone's bits).
    std::vector<T> everyone(static_cast<size_t>(count * n));
    comm.all_gather(everyone.data(), data.data(), count);
    for (int r = 0; r < n && count > 0; ++r) {  // (memcmp of empty vectors' null pointers is UB)
      expect(std::memcmp(everyone.data() + r * count, data.data(), sizeof(T) * count) == 0,
             std::string("all_reduce ") + name + " result differs between ranks");
    }
  }
}

template <typename T>
void check_max(Communicator& comm, const char* name) {
  const int n = comm.size();
  std::vector<T> data = {static_cast<T>(comm.rank()), static_cast<T>(-comm.rank()), static_cast<T>(7)};
  if constexpr (std::is_same_v<T, uint8_t>) data[1] = static_cast<T>(n - comm.rank());
  comm.all_reduce(data.data(), static_cast<int64_t>(data.size()), ReduceOp::kMax);
  expect(data[0] == static_cast<T>(n - 1), std::string("all_reduce max ") + name + " [0]");
  expect(data[1] == (std::is_same_v<T, uint8_t> ? static_cast<T>(n) : static_cast<T>(0)),
         std::string("all_reduce max ") + name + " [1]");
  expect(data[2] == static_cast<T>(7), std::string("all_reduce max ") + name + " [2]");
}

template <typename T>
void check_broadcast(Communicator& comm, const char* name) {
  const int root = comm.size() - 1;
  for (int64_t count : {0, 6}) {
    std::vector<T> data(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) data[i] = encode<T>(comm.rank(), static_cast<int>(i), 3);
    comm.broadcast(data.data(), count, root);
    for (int64_t i = 0; i < count; ++i) {
      expect(same_bits(data[i], encode<T>(root, static_cast<int>(i), 3)), std::string("broadcast ") + name);
    }
  }
}

template <typename T>
void check_moves(Communicator& comm, const char* name) {
  check_all_gather<T>(comm, name);
  check_all_to_all_v<T>(comm, name);
  check_broadcast<T>(comm, name);
}

// The tensor forms: dtype from the tensor, counts from the shapes, shape mismatches refused.
void check_tensor_forms(Communicator& comm) {
  const int n = comm.size();
  Tensor in({2, 3}, DType::kBF16);
  for (int i = 0; i < 6; ++i) in.view().ptr_u16()[i] = static_cast<uint16_t>(comm.rank() * 10 + i);
  Tensor out({static_cast<int64_t>(n) * 2, 3}, DType::kBF16);
  comm.all_gather(out, in);
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < 6; ++i) expect(out.view().ptr_u16()[r * 6 + i] == r * 10 + i, "tensor all_gather BF16");
  }
  Tensor grads({static_cast<int64_t>(n) * 4}, DType::kF32);
  for (int64_t i = 0; i < grads.numel(); ++i) grads.ptr<float>()[i] = static_cast<float>(i + comm.rank());
  Tensor shard({4}, DType::kF32);
  comm.reduce_scatter(shard, grads);
  for (int64_t e = 0; e < 4; ++e) {
    const float expected = static_cast<float>(n * (comm.rank() * 4 + e) + n * (n - 1) / 2);
    expect(shard.ptr<float>()[e] == expected, "tensor reduce_scatter F32");
  }
  // Rows of 3 elements: rank s sends pair_count(s, p) rows to p.
  std::vector<int64_t> send_rows, recv_rows;
  for (int p = 0; p < n; ++p) {
    send_rows.push_back(pair_count(comm.rank(), p));
    recv_rows.push_back(pair_count(p, comm.rank()));
  }
  AllToAllLayout rows = AllToAllLayout::packed(send_rows, recv_rows, 3);
  Tensor tokens({rows.send_extent() / 3, 3}, DType::kF64);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.ptr<double>()[i] = comm.rank() + 0.5;
  Tensor received({rows.recv_extent() / 3, 3}, DType::kF64);
  comm.all_to_all_v(received, tokens, rows);
  for (int p = 0; p < n; ++p) {
    for (int64_t e = 0; e < rows.recv_counts[p]; ++e) {
      expect(received.ptr<double>()[rows.recv_offsets[p] + e] == p + 0.5, "tensor all_to_all_v rows");
    }
  }
  bool refused = false;
  try {
    comm.all_gather(shard, in);  // wrong dtype and size: refused before any communication
  } catch (const Error& e) {
    refused = e.code() == ExitCode::kInternal;
  }
  expect(refused, "a mismatched tensor all_gather is refused");
}

void run_collectives(Communicator& comm) {
  check_moves<float>(comm, "F32");
  check_moves<double>(comm, "F64");
  check_moves<Bf16Bits>(comm, "BF16");
  check_moves<int32_t>(comm, "I32");
  check_moves<int64_t>(comm, "I64");
  check_moves<uint8_t>(comm, "U8");
  check_sums<float>(comm, "F32");
  check_sums<double>(comm, "F64");
  check_sums<int32_t>(comm, "I32");
  check_sums<int64_t>(comm, "I64");
  check_max<float>(comm, "F32");
  check_max<double>(comm, "F64");
  check_max<int32_t>(comm, "I32");
  check_max<int64_t>(comm, "I64");
  check_max<uint8_t>(comm, "U8");
  check_tensor_forms(comm);
  // Counts exchange as EP does it: one count per peer.
  std::vector<int64_t> counts_out, counts_in(static_cast<size_t>(comm.size()));
  for (int p = 0; p < comm.size(); ++p) counts_out.push_back(pair_count(comm.rank(), p));
  comm.all_to_all(counts_in.data(), counts_out.data(), 1);
  for (int p = 0; p < comm.size(); ++p) expect(counts_in[p] == pair_count(p, comm.rank()), "count exchange");
  comm.barrier();
}

void check_group(MPI_Comm mpi_comm, const MeshGroup& expected, const char* name) {
  MpiCommunicator comm(mpi_comm);
  expect(comm.size() == expected.size() && comm.rank() == expected.index,
         std::string(name) + ": communicator rank/size differ from the layout");
  int32_t me = Runtime::get().rank();
  std::vector<int32_t> members(static_cast<size_t>(comm.size()));
  comm.all_gather(members.data(), &me, 1);
  for (int i = 0; i < comm.size(); ++i) {
    expect(members[i] == expected.ranks[i], std::string(name) + ": member " + std::to_string(i) + " is rank " +
                                                std::to_string(members[i]) + ", layout says " +
                                                std::to_string(expected.ranks[i]));
  }
  run_collectives(comm);
}

void run_mesh(int fsdp, int ep, int64_t experts) {
  MeshShape parallel;
  parallel.fsdp = fsdp;
  parallel.ep = ep;
  MeshLayout layout(Runtime::get().world(), parallel, experts, "comm_probe");
  DeviceMesh mesh(layout);
  const MeshCoordinates& c = mesh.coordinates();
  check_group(mesh.fsdp_comm(), c.fsdp, "fsdp group");
  check_group(mesh.replicate_comm(), c.replicate, "replicate group");
  check_group(mesh.ep_comm(), c.ep, "ep group");
  check_group(mesh.expert_replica_comm(), c.expert_replica, "expert replica group");
  // Ranks of one expert-replica group hold the same experts; an EP group covers all of them.
  MpiCommunicator replicas(mesh.expert_replica_comm());
  std::vector<int64_t> firsts(static_cast<size_t>(replicas.size()));
  replicas.all_gather(firsts.data(), &c.first_expert, 1);
  for (int64_t f : firsts) expect(f == c.first_expert, "expert replicas hold different experts");
  MpiCommunicator ep_group(mesh.ep_comm());
  int64_t held = c.local_experts;
  ep_group.all_reduce(&held, 1);
  expect(held == experts, "an EP group holds " + std::to_string(held) + " experts, not " + std::to_string(experts));
}

int probe(Runtime& runtime, int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "collectives") {
    MpiCommunicator world(MPI_COMM_WORLD);
    run_collectives(world);
  } else if (mode == "mesh" && argc == 5) {
    run_mesh(std::stoi(argv[2]), std::stoi(argv[3]), std::stoll(argv[4]));
  } else {
    throw Error(ExitCode::kBadConfig, "usage: comm_probe collectives | mesh FSDP EP EXPERTS");
  }
  if (runtime.is_root()) std::printf("comm_probe %s: all checks passed on %d ranks\n", mode.c_str(), runtime.world());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_main(argc, argv, probe); }
