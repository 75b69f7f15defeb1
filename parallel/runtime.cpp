#include "parallel/runtime.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "core/base/log.h"
#include "parallel/checks.h"

#ifdef MOETRAIN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moetrain {
namespace {

// Set once init knows the rank, so error messages can name it.
Runtime* g_runtime = nullptr;

// A non-negative integer environment variable, or -1 when it is unset or not such a number.
int env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0) return -1;
  return static_cast<int>(value);
}

// The first of `names` that env_int reads as a number, naming it in *source; -1 when none does.
int first_env_int(std::initializer_list<const char*> names, const char** source) {
  for (const char* name : names) {
    const int value = env_int(name);
    if (value >= 0) {
      *source = name;
      return value;
    }
  }
  return -1;
}

// Variables that mpirun (Open MPI), Hydra/PMI and srun set in every process they start.
bool started_by_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

// The node-local rank a launcher announced (Open MPI, Slurm, Hydra), or -1.
int launcher_local_rank(const char** source) {
  return first_env_int({"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}, source);
}

// The job size a launcher announced for this step, or -1. SLURM_NTASKS is left out on purpose:
// a batch script sees it too, where a plain process with world 1 is right.
int launcher_world_size(const char** source) {
  return first_env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}, source);
}

bool mpi_active() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int mpi_world_size() {
  int world = 1;
  if (mpi_active()) MPI_Comm_size(MPI_COMM_WORLD, &world);
  return world;
}

std::string rank_label() {
  if (g_runtime != nullptr) {
    return "rank " + std::to_string(g_runtime->rank()) + "/" + std::to_string(g_runtime->world());
  }
  if (mpi_active()) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return "rank " + std::to_string(rank) + "/" + std::to_string(mpi_world_size());
  }
  return "rank ?";
}

// Rank among the processes that share this node's memory. MPI's own view is used because it
// is right under any launcher; the launcher's variable is only a cross-check, or the fallback
// when the split fails.
void find_local_rank(RuntimeInfo* info) {
  const char* env_source = nullptr;
  const int env_local_rank = launcher_local_rank(&env_source);
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info->rank, MPI_INFO_NULL, &node) ==
      MPI_SUCCESS) {
    MPI_CHECK(MPI_Comm_rank(node, &info->local_rank));
    MPI_CHECK(MPI_Comm_size(node, &info->local_world));
    MPI_CHECK(MPI_Comm_free(&node));
    if (env_local_rank >= 0 && env_local_rank != info->local_rank) {
      log::warn("node-local rank from MPI is " + std::to_string(info->local_rank) + " but " +
                env_source + "=" + std::to_string(env_local_rank) + "; using MPI's");
    }
    return;
  }
  info->local_rank = env_local_rank >= 0 ? env_local_rank : 0;
  const int env_local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE");
  info->local_world = env_local_world > 0 ? env_local_world : info->local_rank + 1;
  log::warn(std::string("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed; node-local rank ") +
            std::to_string(info->local_rank) + " taken from " + (env_source ? env_source : "default 0"));
}

void warn_if_launch_looks_broken(const RuntimeInfo& info) {
  const char* source = nullptr;
  const int announced = launcher_world_size(&source);
  if (announced > 1 && info.world != announced) {
    // The classic broken launch: every process believes it is rank 0 of 1 and they all write
    // the same run directory.
    log::warn(std::string("the launcher started ") + std::to_string(announced) + " processes (" +
              source + ") but MPI sees a world of " + std::to_string(info.world) +
              ": this binary's MPI did not connect to the launcher. Use mpirun from the Open MPI "
              "moetrain was built with, or srun --mpi=pmix.");
  }
}

void bind_device(RuntimeInfo* info) {
#ifdef MOETRAIN_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver or no GPU: a CPU-only run, not an error.
    (void)cudaGetLastError();
    count = 0;
  }
  if (count == 0) {
    info->device = -1;
    return;
  }
  info->device = info->local_rank % count;
  const cudaError_t status = cudaSetDevice(info->device);
  if (status != cudaSuccess) {
    detail::throw_library_failure("CUDA", cudaGetErrorString(status), "cudaSetDevice(local_rank % count)",
                                  __FILE__, __LINE__);
  }
  if (info->local_world > count && info->local_rank == 0) {
    log::warn(std::to_string(info->local_world) + " ranks on this node share " + std::to_string(count) +
              " GPU(s); start one rank per GPU for real runs");
  }
#else
  info->device = -1;
#endif
}

}  // namespace

namespace detail {

void throw_library_failure(const char* library, const char* error_string, const char* expression,
                           const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  throw Error(ExitCode::kInternal, std::string(library) + " call failed on " + rank_label() + ": " +
                                       expression + " -> " + error_string + " [" +
                                       (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

void throw_mpi_failure(int status, const char* expression, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "MPI error code %d", status);
  }
  throw_library_failure("MPI", text, expression, file, line);
}

}  // namespace detail

Runtime& Runtime::init(int* argc, char*** argv) {
  static Runtime runtime;
  if (g_runtime != nullptr) return *g_runtime;

  // Read before MPI_Init: an Open MPI singleton sets PMIX_RANK in its own environment.
  runtime.info_.under_launcher = started_by_launcher();

  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_FUNNELED;
  if (!initialized) {
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      throw Error(ExitCode::kInternal, "MPI_Init_thread failed: is the MPI installation complete?");
    }
    runtime.owns_mpi_ = true;
  }
  // Failed MPI calls return their status to MPI_CHECK instead of killing the job silently.
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));

  RuntimeInfo& info = runtime.info_;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &info.rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &info.world));
  g_runtime = &runtime;
  log::set_rank(info.rank, info.world);
  if (provided < MPI_THREAD_FUNNELED) {
    log::warn("MPI provides thread level " + std::to_string(provided) + ", below MPI_THREAD_FUNNELED");
  }
  warn_if_launch_looks_broken(info);
  find_local_rank(&info);
  bind_device(&info);
  log::debug("runtime: rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) +
             ", local rank " + std::to_string(info.local_rank) + " of " + std::to_string(info.local_world) +
             ", device " + std::to_string(info.device) + (info.under_launcher ? ", under a launcher" : ""));
  return runtime;
}

Runtime& Runtime::get() {
  MOETRAIN_ASSERT(g_runtime != nullptr, "Runtime::get() called before Runtime::init()");
  return *g_runtime;
}

void Runtime::finalize() {
  if (finalized_) return;
  finalized_ = true;
  if (owns_mpi_ && mpi_active()) MPI_Finalize();
}

void abort_job(ExitCode code) {
  // Error lines are flushed by the logger as they are written; this catches plain prints.
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_world_size() > 1) {
    // Open MPI's mpirun then kills every rank and exits with this code (see tests/mpi).
    MPI_Abort(MPI_COMM_WORLD, static_cast<int>(code));
  }
  if (g_runtime != nullptr) g_runtime->finalize();
  std::exit(static_cast<int>(code));
}

int run_main(int argc, char** argv, const std::function<int(Runtime&, int argc, char** argv)>& body) {
  ExitCode code = ExitCode::kInternal;
  std::string message;
  try {
    Runtime& runtime = Runtime::init(&argc, &argv);
    const int result = body(runtime, argc, argv);
    runtime.finalize();
    return result;
  } catch (const Error& error) {
    code = error.code();
    message = error.what();
  } catch (const std::exception& error) {
    message = std::string("unexpected exception: ") + error.what();
  } catch (...) {
    message = "unexpected exception of unknown type";
  }
  log::error(message + " (exit code " + std::to_string(static_cast<int>(code)) + ": " +
             exit_code_name(code) + ")");
  // With other ranks running, only an abort is sure not to leave them waiting in a collective.
  if (mpi_world_size() > 1) abort_job(code);
  if (g_runtime != nullptr) {
    g_runtime->finalize();
  } else if (mpi_active()) {
    MPI_Finalize();  // init failed after MPI came up
  }
  return static_cast<int>(code);
}

}  // namespace moetrain
