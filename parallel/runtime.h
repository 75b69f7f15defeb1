// The process runtime: MPI initialisation (under mpirun, under srun, or as a plain single
// process), this process's place in the job, GPU binding, and the one fatal-error path.
//
// Every binary's main is `return moetrain::run_main(argc, argv, body);`: run_main initialises
// the runtime, runs the body, and turns any exception into a logged message (with the rank) and
// the exit code of docs/ARCHITECTURE.md §7 on every rank: a moetrain::Error ends the job with its code, any
// other exception with code 1. When one rank fails alone the others are brought down with it
// (MPI_Abort) within seconds instead of hanging in their next collective.
#pragma once

#include <functional>

#include "core/base/error.h"

namespace moetrain {

struct RuntimeInfo {
  int rank = 0;
  int world = 1;
  int local_rank = 0;   // rank among the processes of this node (Open MPI or Slurm variables)
  int local_world = 1;
  int device = -1;      // the CUDA device bound to this process, -1 without CUDA or without GPUs
  bool under_launcher = false;  // started by mpirun or srun (false: a plain process, world 1)
};

class Runtime {
 public:
  // Initialises MPI (thread level FUNNELED), reads rank/world/local rank, sets the log prefix,
  // and binds GPU local_rank % device_count when the CUDA backend is built and a GPU exists.
  static Runtime& init(int* argc, char*** argv);
  // The runtime, once init has run (throws an internal Error otherwise).
  static Runtime& get();

  const RuntimeInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int world() const { return info_.world; }
  bool is_root() const { return info_.rank == 0; }

  // Finalizes MPI; called by run_main after the body returns normally.
  void finalize();

 private:
  Runtime() = default;
  RuntimeInfo info_;
  bool owns_mpi_ = false;  // false when MPI was initialised before us: then we do not finalize it
  bool finalized_ = false;
};

// Ends the whole job with `code`: MPI_Abort when more than one rank runs (the launcher brings
// down the others), a plain exit otherwise. Flushes logs first.
[[noreturn]] void abort_job(ExitCode code);

// See the top of this file. `body` returns the process exit code on success.
int run_main(int argc, char** argv, const std::function<int(Runtime&, int argc, char** argv)>& body);

}  // namespace moetrain
