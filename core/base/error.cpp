#include "core/base/error.h"

#include <cstring>

namespace moetrain {

const char* exit_code_name(ExitCode code) {
  switch (code) {
    case ExitCode::kOk: return "ok";
    case ExitCode::kInternal: return "internal error";
    case ExitCode::kBadConfig: return "bad config";
    case ExitCode::kBadData: return "bad data";
    case ExitCode::kBadCheckpoint: return "bad checkpoint";
    case ExitCode::kDoesNotFit: return "does not fit";
    case ExitCode::kPreempted: return "preempted";
  }
  return "unknown";
}

void throw_error(ExitCode code, const std::string& message, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  throw Error(code, message + " [" + (base ? base + 1 : file) + ":" + std::to_string(line) + "]");
}

}  // namespace moetrain
