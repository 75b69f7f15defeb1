// NcclCommunicator: the collectives over NCCL on device buffers (the CUDA backend's
// communicator). Built only with MOETRAIN_HAVE_CUDA; no CUDA or NCCL types in this header, so
// host code can hold one.
//
// Streams: every collective is queued on the communicator's own CUDA stream and returns at
// once. Order it against the compute stream explicitly:
//   comm.wait_for(compute_stream);   // collectives queued after this see the compute so far
//   comm.all_gather(...);            // e.g. the next layer's weights, while compute runs on
//   comm.release_to(compute_stream); // compute queued after this sees the gathered weights
// or call synchronize() to wait on the host. A null stream means CUDA's legacy default stream.
#pragma once

#include <mpi.h>

#include "parallel/comm.h"

namespace moetrain {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `group` (e.g. DeviceMesh::ep_comm()): its rank 0 makes the ncclUniqueId,
  // MPI_Bcast hands it to the others, and every rank joins on the current CUDA device (the one
  // Runtime bound). `group` is not owned and must outlive this object (barrier uses it).
  explicit NcclCommunicator(MPI_Comm group);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::kCUDA; }
  // Waits for the stream, then meets the other ranks (MPI_Barrier over the group).
  void barrier() override;
  void synchronize() override;

  void* stream() const { return stream_; }  // the cudaStream_t the collectives run on
  void wait_for(void* producer_stream) override;    // later collectives start after its queued work
  void release_to(void* consumer_stream) override;  // its later work starts after the collectives so far

 protected:
  MOETRAIN_COMMUNICATOR_TRANSPORT_OVERRIDES

 private:
  MPI_Comm group_;
  int rank_ = 0;
  int size_ = 1;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t
  void* event_ = nullptr;   // cudaEvent_t, reused for stream ordering
};

}  // namespace moetrain
