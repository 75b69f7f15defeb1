// NcclCommunicator (see nccl_comm.h). Compiles to nothing without the CUDA backend, so the
// parallel library's *.cpp glob can include it in every build.
#ifdef MOETRAIN_HAVE_CUDA

#include "parallel/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "core/base/error.h"
#include "parallel/checks.h"

namespace moetrain {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8:
    case DType::kBool: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

ncclComm_t as_comm(void* p) { return static_cast<ncclComm_t>(p); }
cudaStream_t as_stream(void* p) { return static_cast<cudaStream_t>(p); }
cudaEvent_t as_event(void* p) { return static_cast<cudaEvent_t>(p); }

const char* offset(const void* base, int64_t elements, DType dtype) {
  return static_cast<const char*>(base) + static_cast<size_t>(elements) * dtype_size(dtype);
}

}  // namespace

NcclCommunicator::NcclCommunicator(MPI_Comm group) : group_(group) {
  MPI_CHECK(MPI_Comm_rank(group_, &rank_));
  MPI_CHECK(MPI_Comm_size(group_, &size_));
  ncclUniqueId id;
  if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, group_));
  cudaStream_t stream = nullptr;
  CUDA_RUNTIME_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  cudaEvent_t event = nullptr;
  CUDA_RUNTIME_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  event_ = event;
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRank(&comm, size_, id, rank_));
  comm_ = comm;
}

NcclCommunicator::~NcclCommunicator() {
  // No checks: destructors must not throw, and at exit after an error the device may be gone.
  if (comm_ != nullptr) ncclCommDestroy(as_comm(comm_));
  if (event_ != nullptr) cudaEventDestroy(as_event(event_));
  if (stream_ != nullptr) cudaStreamDestroy(as_stream(stream_));
}

void NcclCommunicator::synchronize() { CUDA_RUNTIME_CHECK(cudaStreamSynchronize(as_stream(stream_))); }

void NcclCommunicator::barrier() {
  synchronize();
  MPI_CHECK(MPI_Barrier(group_));
}

void NcclCommunicator::wait_for(void* producer_stream) {
  if (producer_stream == nullptr) return;
  CUDA_RUNTIME_CHECK(cudaEventRecord(as_event(event_), as_stream(producer_stream)));
  CUDA_RUNTIME_CHECK(cudaStreamWaitEvent(as_stream(stream_), as_event(event_), 0));
}

void NcclCommunicator::release_to(void* consumer_stream) {
  if (consumer_stream == nullptr) return;
  CUDA_RUNTIME_CHECK(cudaEventRecord(as_event(event_), as_stream(stream_)));
  CUDA_RUNTIME_CHECK(cudaStreamWaitEvent(as_stream(consumer_stream), as_event(event_), 0));
}

void NcclCommunicator::all_gather_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  NCCL_CHECK(ncclAllGather(in, out, static_cast<size_t>(count_per_rank), nccl_type(dtype), as_comm(comm_),
                           as_stream(stream_)));
}

void NcclCommunicator::reduce_scatter_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) {
  NCCL_CHECK(ncclReduceScatter(in, out, static_cast<size_t>(count_per_rank), nccl_type(dtype), ncclSum,
                               as_comm(comm_), as_stream(stream_)));
}

void NcclCommunicator::all_reduce_elements(void* data, int64_t count, DType dtype, ReduceOp op) {
  NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), nccl_op(op), as_comm(comm_),
                           as_stream(stream_)));
}

void NcclCommunicator::all_to_all_v_elements(void* out, const void* in, const AllToAllLayout& layout,
                                             DType dtype) {
  // Point-to-point pairs inside one group call: NCCL schedules them together (no deadlock
  // whatever the order) and skips the peers with nothing to exchange.
  NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < size_; ++peer) {
    if (layout.send_counts[peer] > 0) {
      NCCL_CHECK(ncclSend(offset(in, layout.send_offsets[peer], dtype), static_cast<size_t>(layout.send_counts[peer]),
                          nccl_type(dtype), peer, as_comm(comm_), as_stream(stream_)));
    }
    if (layout.recv_counts[peer] > 0) {
      NCCL_CHECK(ncclRecv(const_cast<char*>(offset(out, layout.recv_offsets[peer], dtype)),
                          static_cast<size_t>(layout.recv_counts[peer]), nccl_type(dtype), peer, as_comm(comm_),
                          as_stream(stream_)));
    }
  }
  NCCL_CHECK(ncclGroupEnd());
}

void NcclCommunicator::broadcast_elements(void* data, int64_t count, DType dtype, int root) {
  MOETRAIN_ASSERT(root >= 0 && root < size_, "broadcast root " + std::to_string(root) + " outside the group");
  NCCL_CHECK(ncclBroadcast(data, data, static_cast<size_t>(count), nccl_type(dtype), root, as_comm(comm_),
                           as_stream(stream_)));
}

}  // namespace moetrain

#endif  // MOETRAIN_HAVE_CUDA
