// Whether every rank of a distributed CUDA test sees a GPU. The ranks agree (one all-reduce) so
// that all of them skip together, printing the skip once, instead of some waiting forever in a
// collective the others never join.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

namespace moetrain::testing {

inline bool every_rank_sees_a_gpu() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  int usable = gpus >= 1 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &usable, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return usable != 0;
}

}  // namespace moetrain::testing
