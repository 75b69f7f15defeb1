// The few collective operations a checkpoint needs, behind an interface so the save/resume
// protocol is the same code at world 1 (no MPI at all: unit tests) and under mpirun/srun.
//
// Every rank calls every operation in the same order (they are collectives). Errors are agreed
// on, never left to one rank: `any(failed)` after each phase lets every rank throw together
// instead of the healthy ranks waiting forever in the next barrier.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/base/error.h"

namespace moetrain {

class CheckpointGroup {
 public:
  virtual ~CheckpointGroup() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  bool is_root() const { return rank() == 0; }

  virtual void barrier() = 0;
  // True on every rank when `flag` is true on at least one rank.
  virtual bool any(bool flag) = 0;
  // Rank 0 receives every rank's text in rank order; the other ranks receive an empty vector.
  virtual std::vector<std::string> gather_to_root(const std::string& text) = 0;
  // Every rank receives rank 0's `text` (the argument is ignored on the other ranks).
  virtual std::string broadcast_from_root(const std::string& text) = 0;
};

// Runs `decide` on rank 0 alone, then every rank learns how it went: an Error thrown there is
// thrown on every rank with the same exit code and message, so all ranks exit alike. Call it on
// every rank (it is a collective); what rank 0 decided beyond success travels separately
// (broadcast_from_root).
void decide_on_root(CheckpointGroup& group, const std::function<void()>& decide);

// Runs `phase` on every rank, then agrees: when any rank failed, every rank throws. A rank that
// failed throws its own error (an Error keeps its exit code, any other exception is kInternal);
// the others throw `elsewhere`. `progress` names the phase to the watchdog before it starts.
void run_agreed(CheckpointGroup& group, const std::string& progress, const Error& elsewhere,
                const std::function<void()>& phase);

// One process, no MPI calls: every collective is the identity.
std::unique_ptr<CheckpointGroup> make_single_process_group();
// MPI_COMM_WORLD; MPI must be initialised (Runtime::init does it).
std::unique_ptr<CheckpointGroup> make_mpi_checkpoint_group();

}  // namespace moetrain
