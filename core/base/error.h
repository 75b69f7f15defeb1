// Errors and exit codes. Every error a user can cause is an `Error` carrying the exit code the
// process must end with (docs/ARCHITECTURE.md §7); apps/ catch it at the top and end every rank with it.
#pragma once

#include <stdexcept>
#include <string>

namespace moetrain {

enum class ExitCode : int {
  kOk = 0,
  kInternal = 1,       // a bug in moetrain or a failing library call (CUDA, NCCL, MPI)
  kBadConfig = 2,      // bad config file, --set override or command line; an output path that cannot be
                       // written (permissions, a full disk: the path and the system's reason in the message)
  kBadData = 3,        // bad training data: truncated file, token id >= vocab, ...
  kBadCheckpoint = 4,  // bad or corrupt checkpoint or model file
  kDoesNotFit = 5,     // `moetrain plan` only: the plan is printed, and its verdict is "does not fit"
  kPreempted = 75,     // stopped by SIGTERM/SIGUSR1 after saving a checkpoint: requeue me
};

const char* exit_code_name(ExitCode code);

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

// Formats "message (file:line)" and throws. Kept out of line so the macros stay small.
[[noreturn]] void throw_error(ExitCode code, const std::string& message, const char* file, int line);

}  // namespace moetrain

// Checks that never compile away (unlike assert under NDEBUG). `message` is any expression
// convertible to std::string; it is only evaluated when the check fails.
#define MOETRAIN_CHECK(cond, code, message)                                          \
  do {                                                                               \
    if (!(cond)) ::moetrain::throw_error((code), (message), __FILE__, __LINE__);     \
  } while (0)

// An internal invariant: failure means a bug in moetrain, exit code 1.
#define MOETRAIN_ASSERT(cond, message)                                                       \
  MOETRAIN_CHECK(cond, ::moetrain::ExitCode::kInternal,                                      \
                 std::string("internal error: ") + #cond + " failed: " + std::string(message))
