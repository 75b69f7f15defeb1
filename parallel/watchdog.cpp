#include "parallel/watchdog.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "core/base/error.h"
#include "core/base/log.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;

struct WatchdogState {
  std::mutex mutex;
  std::condition_variable wake;
  std::thread thread;
  bool running = false;
  double timeout_s = 0.0;
  Clock::time_point last_progress;
  std::string phase = "starting";
};

WatchdogState& state() {
  static WatchdogState s;
  return s;
}

void watch() {
  WatchdogState& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  // Check a few times per timeout, and at least every second, so an abort comes promptly.
  const auto interval = std::chrono::duration<double>(std::clamp(s.timeout_s / 4.0, 0.05, 1.0));
  while (s.running) {
    s.wake.wait_for(lock, interval);
    if (!s.running) break;
    const double idle = std::chrono::duration<double>(Clock::now() - s.last_progress).count();
    if (idle < s.timeout_s) continue;
    const std::string message = fmt::format(
        "no progress for {:.0f} s (parallel.timeout_s = {:g}) since this rank began: {}. This rank or another "
        "has died or hung (see every rank's messages; a collective waits for all of them); aborting the job. "
        "Raise parallel.timeout_s if this phase is legitimately that slow",
        idle, s.timeout_s, s.phase);
    lock.unlock();
    const ExitCode code = ExitCode::kInternal;
    log::error(message + " (exit code " + std::to_string(static_cast<int>(code)) + ": " + exit_code_name(code) + ")");
    std::fflush(stderr);
    // Not abort_job: the main thread is still inside the hung call, so nothing may finalize MPI
    // or run static destructors under it. MPI_Abort ends every rank; alone, just exit.
    int mpi_up = 0, world = 1;
    MPI_Initialized(&mpi_up);
    if (mpi_up) MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world > 1) MPI_Abort(MPI_COMM_WORLD, static_cast<int>(code));
    std::_Exit(static_cast<int>(code));
  }
}

}  // namespace

void start_watchdog(double timeout_s) {
  if (timeout_s <= 0.0) return;
  WatchdogState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  MOETRAIN_ASSERT(!s.running, "the watchdog is already running");
  s.running = true;
  s.timeout_s = timeout_s;
  s.last_progress = Clock::now();
  s.phase = "starting";
  s.thread = std::thread(watch);
}

void stop_watchdog() {
  WatchdogState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.running) return;
    s.running = false;
  }
  s.wake.notify_all();
  s.thread.join();
}

void watchdog_progress(const std::string& phase) {
  WatchdogState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.running) return;
  s.last_progress = Clock::now();
  s.phase = phase;
}

}  // namespace moetrain
