// MPI_CHECK, NCCL_CHECK and CUDA_RUNTIME_CHECK: checks on library calls that never compile away
// (unlike assert under NDEBUG). A failing call throws moetrain::Error(kInternal) whose message names the
// expression, the file and line, the rank and the library's own error string; run_main logs it
// and aborts every rank.
//
// MPI calls return their status only because Runtime::init sets MPI_ERRORS_RETURN on
// MPI_COMM_WORLD (communicators split from it inherit that); with MPI's default handler
// (MPI_ERRORS_ARE_FATAL) the library would kill the job before MPI_CHECK saw the status.
//
// NCCL_CHECK names ncclResult_t and ncclGetErrorString: include <nccl.h> before using it;
// CUDA_RUNTIME_CHECK names cudaError_t and cudaGetErrorString: include <cuda_runtime.h>.
#pragma once

#include <mpi.h>

#include "core/base/error.h"

namespace moetrain::detail {

// Out of line (parallel/runtime.cpp) so the macros stay small and the rank is known there.
[[noreturn]] void throw_mpi_failure(int status, const char* expression, const char* file, int line);
[[noreturn]] void throw_library_failure(const char* library, const char* error_string,
                                        const char* expression, const char* file, int line);

}  // namespace moetrain::detail

#define MPI_CHECK(call)                                                                        \
  do {                                                                                         \
    const int moetrain_mpi_status_ = (call);                                                   \
    if (moetrain_mpi_status_ != MPI_SUCCESS)                                                   \
      ::moetrain::detail::throw_mpi_failure(moetrain_mpi_status_, #call, __FILE__, __LINE__);  \
  } while (0)

#define NCCL_CHECK(call)                                                                       \
  do {                                                                                         \
    const ncclResult_t moetrain_nccl_status_ = (call);                                         \
    if (moetrain_nccl_status_ != ncclSuccess)                                                  \
      ::moetrain::detail::throw_library_failure(                                               \
          "NCCL", ncclGetErrorString(moetrain_nccl_status_), #call, __FILE__, __LINE__);       \
  } while (0)

#define CUDA_RUNTIME_CHECK(call)                                                               \
  do {                                                                                         \
    const cudaError_t moetrain_cuda_status_ = (call);                                          \
    if (moetrain_cuda_status_ != cudaSuccess)                                                  \
      ::moetrain::detail::throw_library_failure(                                               \
          "CUDA", cudaGetErrorString(moetrain_cuda_status_), #call, __FILE__, __LINE__);       \
  } while (0)
