// HostStagedCommunicator: the collectives on device buffers, moved through host memory and
// run by MpiCommunicator. For several ranks that share one GPU, where NCCL refuses to run
// (it needs one device per rank): it lets the CUDA path with 2-4 ranks on one H200 be checked
// against one rank. Correct and slow; a real job uses NcclCommunicator. Built only with
// MOETRAIN_HAVE_CUDA; no CUDA types in this header.
//
// Every collective waits for the whole device first (so it sees the work of every stream),
// copies its inputs to the host, runs the MPI collective there and copies the results back,
// waiting until they have landed: it is complete when it returns, so synchronize(),
// wait_for() and release_to() have nothing left to order. Sums and maxima of BF16 are done in
// F32 on the host, in rank order, and rounded once to BF16 (NCCL rounds at every step of its
// ring, so the two agree to BF16 rounding, not bit for bit).
#pragma once

#include <mpi.h>

#include "parallel/comm.h"

namespace moetrain {

class HostStagedCommunicator final : public Communicator {
 public:
  // Collective over `group`, not owned: it must outlive this object.
  explicit HostStagedCommunicator(MPI_Comm group);

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  Device device() const override { return Device::kCUDA; }
  void barrier() override;
  void synchronize() override {}

 protected:
  MOETRAIN_COMMUNICATOR_TRANSPORT_OVERRIDES

 private:
  MpiCommunicator host_;
};

}  // namespace moetrain
