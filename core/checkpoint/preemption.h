// Preemption by the scheduler: slurm sends SIGTERM (at preemption or time limit) or the signal
// a batch script asks for (`#SBATCH --signal=USR1@120`). The handler only sets a flag; the
// training loop looks at it once per step, the ranks agree (any rank signalled -> all stop),
// save a checkpoint and exit with code 75 so the batch script requeues the job.
//
// Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop a run the same way, so that an interactive
// run's work is saved too. A second SIGINT while the first is pending ends the process at once
// (the default action): a save is atomic, so even that loses no committed checkpoint.
#pragma once

namespace moetrain {

// Installs handlers for SIGTERM, SIGUSR1, SIGINT and SIGHUP that set the flag (idempotent).
void install_preemption_handlers();
// True once a handled signal arrived; preemption_signal() names it (0 when none).
bool preemption_requested();
int preemption_signal();
const char* preemption_signal_name();
// Clears the flag (tests).
void clear_preemption_request();

}  // namespace moetrain
