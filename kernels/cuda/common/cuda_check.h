// CUDA_CHECK and CUBLAS_CHECK: checks on CUDA runtime and cuBLAS(Lt) calls that never compile
// away (unlike assert under NDEBUG). A failing call throws moetrain::Error(kInternal) naming the
// expression, file and line, the library's error name and string, the device and the rank;
// run_main logs it and aborts every rank.
//
// Compiles under nvcc: only CUDA headers and core/base/error.h, no spdlog/fmt. The rank comes
// from the launcher's environment because kernels/ must not depend on parallel/ (the log line
// that run_main writes carries the runtime's rank prefix as well).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/base/error.h"

namespace moetrain::cuda_detail {

// "rank R" from the variables mpirun/srun/Hydra set, or "" for a plain process.
inline std::string launcher_rank_label() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return std::string(" on rank ") + value;
  }
  return "";
}

[[noreturn]] inline void throw_cuda_failure(const char* library, const char* error_name,
                                            const char* error_string, const char* expression,
                                            const char* file, int line) {
  int device = -1;
  // Asking for the device after a sticky error can fail too; then it is reported as -1.
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  const char* base = std::strrchr(file, '/');
  throw ::moetrain::Error(::moetrain::ExitCode::kInternal,
                          std::string(library) + " call failed" + launcher_rank_label() + " (device " +
                              std::to_string(device) + "): " + expression + " -> " + error_name + ": " +
                              error_string + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

}  // namespace moetrain::cuda_detail

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    const cudaError_t moetrain_cuda_status_ = (call);                                          \
    if (moetrain_cuda_status_ != cudaSuccess)                                                  \
      ::moetrain::cuda_detail::throw_cuda_failure(                                             \
          "CUDA", cudaGetErrorName(moetrain_cuda_status_),                                     \
          cudaGetErrorString(moetrain_cuda_status_), #call, __FILE__, __LINE__);               \
  } while (0)

// After a kernel launch: catches bad launch configurations (the launch itself returns nothing).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                                     \
  do {                                                                                         \
    const cublasStatus_t moetrain_cublas_status_ = (call);                                     \
    if (moetrain_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                      \
      ::moetrain::cuda_detail::throw_cuda_failure(                                             \
          "cuBLAS", cublasGetStatusName(moetrain_cublas_status_),                              \
          cublasGetStatusString(moetrain_cublas_status_), #call, __FILE__, __LINE__);          \
  } while (0)
