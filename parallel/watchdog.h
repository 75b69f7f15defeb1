// The hang detector (docs/ARCHITECTURE.md §5, "Failure"). A rank that makes no
// progress for `timeout_s` seconds -- waiting in a collective for a rank that stopped without
// exiting, a lost node, a wedged GPU -- logs what it was last doing and aborts the whole job
// (exit code 1, MPI_Abort) instead of waiting out the scheduler's time limit.
//
// Progress is a call to watchdog_progress(phase) from the main thread at every step of work that
// can take long (each micro-batch, the gradient reduction, the optimizer, every checkpoint phase,
// every layer of a weight load): the timeout bounds the longest of these, not a whole step. The
// check runs on a background thread; it only reads the time and the phase and, on a timeout,
// calls MPI_Abort from that thread (outside MPI_THREAD_FUNNELED's rules, as every watchdog that
// must interrupt a blocked collective does; Open MPI and Slurm's PMI honour it).
#pragma once

#include <string>

namespace moetrain {

// Starts the background check (0 or less: none). Once per process; stop_watchdog() ends it.
void start_watchdog(double timeout_s);
void stop_watchdog();

// Records that this rank is alive and now doing `phase` (e.g. "step 12: forward/backward of
// micro-batch 2"). Cheap; a no-op when the watchdog is not running.
void watchdog_progress(const std::string& phase);

// Stops and restarts the watchdog around a scope (RAII), so a test or tool can call it safely.
class ScopedWatchdog {
 public:
  explicit ScopedWatchdog(double timeout_s) { start_watchdog(timeout_s); }
  ~ScopedWatchdog() { stop_watchdog(); }
  ScopedWatchdog(const ScopedWatchdog&) = delete;
  ScopedWatchdog& operator=(const ScopedWatchdog&) = delete;
};

}  // namespace moetrain
