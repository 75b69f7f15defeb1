#include "core/checkpoint/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <set>
#include <sstream>
#include <vector>
#include <string>

#include "core/base/error.h"

namespace moetrain {
namespace {

const std::set<std::string>& known_phases() {
  static const std::set<std::string> phases = {"after_shard_write", "before_manifest", "before_rename",
                                               "before_latest", "during_cleanup"};
  return phases;
}

struct FaultSpec {
  bool active = false;
  bool hang = false;  // else kill
  bool all_ranks = false;
  int rank = -1;
  std::string phase;
  int hit = 1;  // fire the hit-th time the phase is reached (a later save than the first)
};

[[noreturn]] void bad_spec(const std::string& text, const std::string& why) {
  throw Error(ExitCode::kBadConfig, "MOETRAIN_FAULT=\"" + text + "\": " + why +
                                        " (expected kill|hang:rank=R:phase=P[:hit=N] with R a rank or `all` and P one of "
                                        "after_shard_write, before_manifest, before_rename, before_latest, "
                                        "during_cleanup; unset it for normal runs)");
}

FaultSpec parse_fault_spec(const std::string& text) {
  FaultSpec spec;
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ':');) parts.push_back(part);
  if ((parts.size() != 3 && parts.size() != 4) || (parts[0] != "kill" && parts[0] != "hang")) {
    bad_spec(text, "not three or four ':'-separated fields starting with kill or hang");
  }
  spec.hang = parts[0] == "hang";
  const std::string rank_prefix = "rank=", phase_prefix = "phase=";
  if (parts[1].rfind(rank_prefix, 0) != 0) bad_spec(text, "second field is not rank=R");
  if (parts[2].rfind(phase_prefix, 0) != 0) bad_spec(text, "third field is not phase=P");
  std::string rank = parts[1].substr(rank_prefix.size());
  if (rank == "all") {
    spec.all_ranks = true;
  } else {
    char* end = nullptr;
    long value = std::strtol(rank.c_str(), &end, 10);
    if (rank.empty() || *end != '\0' || value < 0) bad_spec(text, "rank `" + rank + "` is not a rank number");
    spec.rank = static_cast<int>(value);
  }
  spec.phase = parts[2].substr(phase_prefix.size());
  if (!known_phases().count(spec.phase)) bad_spec(text, "unknown phase `" + spec.phase + "`");
  if (parts.size() == 4) {
    const std::string hit_prefix = "hit=";
    char* end = nullptr;
    long hit = parts[3].rfind(hit_prefix, 0) == 0 ? std::strtol(parts[3].c_str() + hit_prefix.size(), &end, 10) : 0;
    if (hit < 1 || *end != '\0') bad_spec(text, "fourth field is not hit=N with N >= 1");
    spec.hit = static_cast<int>(hit);
  }
  spec.active = true;
  return spec;
}

const FaultSpec& fault_spec() {
  static const FaultSpec spec = [] {
    const char* text = std::getenv("MOETRAIN_FAULT");
    return text == nullptr || *text == '\0' ? FaultSpec{} : parse_fault_spec(text);
  }();
  return spec;
}

}  // namespace

void fault_point(const char* phase, int rank) {
  MOETRAIN_ASSERT(known_phases().count(phase), std::string("unknown fault phase ") + phase);
  const FaultSpec& spec = fault_spec();
  if (!spec.active || spec.phase != phase || (!spec.all_ranks && spec.rank != rank)) return;
  static int hits = 0;
  if (++hits < spec.hit) return;
  if (spec.hang) {
    std::string note = "[moetrain] MOETRAIN_FAULT: rank " + std::to_string(rank) + " hangs at " + phase + "\n";
    ssize_t ignored = ::write(2, note.data(), note.size());
    (void)ignored;
    for (;;) ::pause();
  }
  // Say what happened on stderr with async-signal-free calls only, then die without cleanup.
  std::string note = "[moetrain] MOETRAIN_FAULT: killing rank " + std::to_string(rank) + " at " + phase + "\n";
  ssize_t ignored = ::write(2, note.data(), note.size());
  (void)ignored;
  ::kill(::getpid(), SIGKILL);
  ::_exit(137);  // not reached
}

}  // namespace moetrain
