// MpiCommunicator: the collectives over MPI on host buffers (the CPU backend's communicator).
//
// Sums are done here, in rank order, rather than by MPI_Reduce_scatter/MPI_Allreduce: MPI
// leaves the reduction order to the implementation (it may depend on message sizes, the
// algorithm tuning and the library version), so a float sum could differ in the last bit from
// one run or machine to the next. Instead each rank receives every rank's contribution to the
// part it owns (one all-to-all: the same bytes a reduce-scatter moves) and adds them as
// ((x_0 + x_1) + x_2) + ...; all_reduce then all-gathers the owned parts. The result equals the
// serial sum over ranks in rank order, bit for bit, on every rank and with any MPI. Max is
// order-independent and uses MPI_Allreduce.
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "parallel/checks.h"
#include "parallel/comm.h"

namespace moetrain {
namespace {

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;  // moved as bits; never summed
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8:
    case DType::kBool: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

// MPI counts and displacements are int.
int mpi_count(int64_t count, const char* what) {
  MOETRAIN_CHECK(count >= 0 && count <= INT_MAX, ExitCode::kInternal,
                 std::string(what) + ": " + std::to_string(count) +
                     " elements exceed what one MPI call can move (INT_MAX); split the buffer");
  return static_cast<int>(count);
}

template <typename T>
void sum_in_rank_order(T* out, const T* parts, int64_t count, int ranks) {
  for (int64_t e = 0; e < count; ++e) out[e] = parts[e];
  for (int r = 1; r < ranks; ++r) {
    const T* part = parts + static_cast<int64_t>(r) * count;
    for (int64_t e = 0; e < count; ++e) out[e] += part[e];
  }
}

// out [count] = sum over r of parts [r * count + e], r ascending.
void sum_parts(void* out, const void* parts, int64_t count, int ranks, DType dtype) {
  switch (dtype) {
    case DType::kF32: return sum_in_rank_order(static_cast<float*>(out), static_cast<const float*>(parts), count, ranks);
    case DType::kF64:
      return sum_in_rank_order(static_cast<double*>(out), static_cast<const double*>(parts), count, ranks);
    case DType::kI32:
      return sum_in_rank_order(static_cast<int32_t*>(out), static_cast<const int32_t*>(parts), count, ranks);
    case DType::kI64:
      return sum_in_rank_order(static_cast<int64_t*>(out), static_cast<const int64_t*>(parts), count, ranks);
    default:
      throw Error(ExitCode::kInternal, std::string("MpiCommunicator cannot sum ") + dtype_name(dtype) +
                                           " (sums: F32, F64, I32, I64; convert BF16 to F32 first)");
  }
}

// Owned slice c of `count` elements split over `ranks`: [count * c / ranks, count * (c + 1) / ranks).
int64_t slice_begin(int64_t count, int c, int ranks) { return count * c / ranks; }

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

void MpiCommunicator::barrier() { MPI_CHECK(MPI_Barrier(comm_)); }

void MpiCommunicator::all_gather_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  const int count = mpi_count(count_per_rank, "all_gather");
  mpi_count(count_per_rank * size_, "all_gather output");
  MPI_CHECK(MPI_Allgather(in, count, mpi_type(dtype), out, count, mpi_type(dtype), comm_));
}

void MpiCommunicator::reduce_scatter_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  const int count = mpi_count(count_per_rank, "reduce_scatter");
  mpi_count(count_per_rank * size_, "reduce_scatter input");
  std::vector<unsigned char> parts(static_cast<size_t>(count_per_rank * size_) * dtype_size(dtype));
  // Block r of every rank's input comes to rank r: parts[j] = rank j's contribution to my block.
  MPI_CHECK(MPI_Alltoall(in, count, mpi_type(dtype), parts.data(), count, mpi_type(dtype), comm_));
  sum_parts(out, parts.data(), count_per_rank, size_, dtype);
}

void MpiCommunicator::all_reduce_elements(void* data, int64_t count, DType dtype, ReduceOp op) {
  mpi_count(count, "all_reduce");
  if (op == ReduceOp::kMax) {
    MOETRAIN_CHECK(dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kBool, ExitCode::kInternal,
                   std::string("MpiCommunicator cannot take the max of ") + dtype_name(dtype));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), mpi_type(dtype), MPI_MAX, comm_));
    return;
  }
  // Rank c owns slice c: it receives every rank's copy of that slice, sums them in rank order,
  // and the owned sums are then gathered by everyone.
  const size_t elem = dtype_size(dtype);
  std::vector<int> send_counts(size_), send_offsets(size_), recv_counts(size_), recv_offsets(size_);
  const int64_t my_begin = slice_begin(count, rank_, size_);
  const int64_t my_count = slice_begin(count, rank_ + 1, size_) - my_begin;
  for (int c = 0; c < size_; ++c) {
    send_offsets[c] = static_cast<int>(slice_begin(count, c, size_));
    send_counts[c] = static_cast<int>(slice_begin(count, c + 1, size_)) - send_offsets[c];
    recv_counts[c] = static_cast<int>(my_count);
    recv_offsets[c] = mpi_count(my_count * c, "all_reduce");
  }
  std::vector<unsigned char> parts(static_cast<size_t>(my_count * size_) * elem);
  MPI_CHECK(MPI_Alltoallv(data, send_counts.data(), send_offsets.data(), mpi_type(dtype), parts.data(),
                          recv_counts.data(), recv_offsets.data(), mpi_type(dtype), comm_));
  sum_parts(static_cast<unsigned char*>(data) + my_begin * elem, parts.data(), my_count, size_, dtype);
  MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, mpi_type(dtype), data, send_counts.data(), send_offsets.data(),
                           mpi_type(dtype), comm_));
}

void MpiCommunicator::all_to_all_v_elements(void* out, const void* in, const AllToAllLayout& layout, DType dtype) {
  std::vector<int> send_counts(size_), send_offsets(size_), recv_counts(size_), recv_offsets(size_);
  for (int r = 0; r < size_; ++r) {
    send_counts[r] = mpi_count(layout.send_counts[r], "all_to_all_v send count");
    send_offsets[r] = mpi_count(layout.send_offsets[r], "all_to_all_v send offset");
    recv_counts[r] = mpi_count(layout.recv_counts[r], "all_to_all_v receive count");
    recv_offsets[r] = mpi_count(layout.recv_offsets[r], "all_to_all_v receive offset");
  }
  MPI_CHECK(MPI_Alltoallv(in, send_counts.data(), send_offsets.data(), mpi_type(dtype), out, recv_counts.data(),
                          recv_offsets.data(), mpi_type(dtype), comm_));
}

void MpiCommunicator::broadcast_elements(void* data, int64_t count, DType dtype, int root) {
  MOETRAIN_ASSERT(root >= 0 && root < size_, "broadcast root " + std::to_string(root) + " outside the group");
  MPI_CHECK(MPI_Bcast(data, mpi_count(count, "broadcast"), mpi_type(dtype), root, comm_));
}

}  // namespace moetrain
