#include "core/checkpoint/run_directory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_reader.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = "moetrain.lock";

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

// "20261202-063005": UTC, sortable, the same on every rank of one start.
std::string utc_stamp() {
  std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", &utc);
  return text;
}

// `path` is, or can become, a directory this process writes in: created when missing, then
// probed with a file that is removed again. `setting` names the config key for the message.
void check_writable_directory(const std::string& path, const std::string& setting) {
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec)) {
    throw Error(ExitCode::kBadConfig, fmt::format("{}: {} exists and is not a directory (a file is in the way): "
                                                  "remove it or set {} to a directory",
                                                  setting, path, setting));
  }
  fs::create_directories(path, ec);
  if (ec) {
    throw Error(ExitCode::kBadConfig, fmt::format("{}: cannot create the directory {} ({}): check the path and its "
                                                  "permissions, or set {} elsewhere",
                                                  setting, path, ec.message(), setting));
  }
  const std::string probe = (fs::path(path) / fmt::format(".moetrain-write-test.{}", ::getpid())).string();
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error_number = errno;
    throw Error(ExitCode::kBadConfig, fmt::format("{}: cannot write in {} ({}): check its permissions and free space, "
                                                  "or set {} elsewhere",
                                                  setting, path, std::strerror(error_number), setting));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// Moves `paths` (entries of the checkpoint root `root`) into <root>.old-<stamp>/, beside it.
std::string move_aside(const std::string& root, const std::vector<fs::path>& paths, const std::string& stamp) {
  fs::path root_path = fs::path(root).lexically_normal();
  if (root_path.filename().empty()) root_path = root_path.parent_path();
  fs::path aside = root_path;
  aside += ".old-" + stamp;
  std::error_code ec;
  fs::create_directories(aside, ec);
  MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                 fmt::format("checkpoint.overwrite: cannot create {} to move the old checkpoints into ({})",
                             aside.string(), ec.message()));
  for (const fs::path& p : paths) {
    fs::rename(p, aside / p.filename(), ec);
    MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                   fmt::format("checkpoint.overwrite: cannot move {} into {} ({})", p.string(), aside.string(),
                               ec.message()));
  }
  return aside.string();
}

// The step a --resume PATH starts from, as its manifest says.
int64_t resumed_step(const std::string& checkpoint_dir) { return read_manifest(checkpoint_dir).step; }

bool same_directory(const std::string& a, const std::string& b) {
  std::error_code ec;
  return fs::equivalent(a, b, ec);
}

// `inner` is `outer` or lies inside it (both existing directories).
bool is_within(const std::string& inner, const std::string& outer) {
  std::error_code ec;
  const fs::path a = fs::canonical(inner, ec), b = fs::canonical(outer, ec);
  if (ec) return false;
  auto [end_b, end_a] = std::mismatch(b.begin(), b.end(), a.begin(), a.end());
  return end_b == b.end();
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& setting)
    : path_((fs::path(dir) / kLockName).string()) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int error_number = errno;
    throw Error(ExitCode::kBadConfig, fmt::format("{}: cannot create the lock file {} ({})", setting, path_,
                                                  std::strerror(error_number)));
  }
  std::string previous;
  {
    std::ifstream in(path_);
    std::getline(in, previous);
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error_number = errno;
    if (error_number == EWOULDBLOCK) {
      ::close(fd_);
      fd_ = -1;
      throw Error(ExitCode::kBadConfig,
                  fmt::format("{}: {} is in use by another run ({}): wait for it to end, stop it, or give this run "
                              "another {}",
                              setting, dir, previous.empty() ? "its owner did not say who it is" : previous, setting));
    }
    // No locks on this file system (some NFS mounts): go on, but say that nothing guards the directory.
    log::warn(fmt::format("{}: cannot lock {} ({}): make sure no other run writes in {}", setting, path_,
                          std::strerror(error_number), dir));
  } else if (!previous.empty()) {
    log::warn(fmt::format("{}: took over the lock of a run that no longer holds it ({}; it did not end cleanly)",
                          setting, previous));
  }
  const std::string owner = fmt::format("pid {} on host {}, since {} UTC", ::getpid(), host_name(), utc_stamp());
  const std::string text = owner + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    log::warn(fmt::format("{}: could not write the owner into {}", setting, path_));
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ < 0) return;
  // Emptied, not removed: removing would let a newcomer lock a fresh file while another still
  // waits on the old one. An empty lock file means "free".
  if (::ftruncate(fd_, 0) != 0) log::warn("could not empty the lock file " + path_);
  ::close(fd_);  // releases the flock
}

RunPaths run_paths(const Config& config) {
  RunPaths paths;
  paths.run_dir = config.logging.run_dir;
  paths.checkpoint_root = config.checkpoint.dir ? *config.checkpoint.dir
                                                : (fs::path(config.logging.run_dir) / "checkpoints").string();
  // true, false or a directory: the config reader has already refused the ambiguous words and
  // spelled the booleans true and false.
  const std::string& setting = config.checkpoint.export_adapter;
  if (setting == "true") {
    paths.export_dir = (fs::path(config.logging.run_dir) / "adapter").string();
  } else if (setting != "false") {
    paths.export_dir = setting;
  }
  return paths;
}

RunDirectory::RunDirectory(const Config& config) {
  const RunPaths paths = run_paths(config);
  check_writable_directory(paths.run_dir, "logging.run_dir");
  check_writable_directory(paths.checkpoint_root, config.checkpoint.dir ? "checkpoint.dir" : "logging.run_dir");
  if (!paths.export_dir.empty()) check_writable_directory(paths.export_dir, "checkpoint.export_adapter");

  locks_.push_back(std::make_unique<DirectoryLock>(paths.run_dir, "logging.run_dir"));
  if (!is_within(paths.checkpoint_root, paths.run_dir)) {
    locks_.push_back(std::make_unique<DirectoryLock>(paths.checkpoint_root, "checkpoint.dir"));
  }

  // Which committed checkpoints would the run mix with?
  const std::string& mode = config.checkpoint.resume;
  const std::vector<CheckpointRef> committed = list_committed_checkpoints(paths.checkpoint_root);
  std::vector<CheckpointRef> in_the_way;
  std::string start;  // for the message
  if (mode == "none") {
    in_the_way = committed;
    start = "a fresh run (--resume none)";
  } else if (mode == "auto") {
    fresh_start_ = committed.empty();
  } else {
    const std::string chosen = resolve_checkpoint_path(mode);
    const int64_t step = resumed_step(chosen);
    fresh_start_ = false;
    for (const CheckpointRef& c : committed) {
      if (c.step > step && !same_directory(c.path, chosen)) in_the_way.push_back(c);
    }
    start = fmt::format("resuming from {} (step {})", chosen, step);
  }
  const std::string stamp = utc_stamp();
  if (!in_the_way.empty()) {
    std::string steps;
    for (const CheckpointRef& c : in_the_way) steps += (steps.empty() ? "" : ", ") + std::to_string(c.step);
    if (!config.checkpoint.overwrite) {
      throw Error(ExitCode::kBadConfig,
                  fmt::format("{} holds checkpoints of another run (steps {}); {} there would mix with them, and "
                              "checkpoint.keep_last would delete the new saves as the older ones. Use another "
                              "logging.run_dir (or checkpoint.dir), continue that run (--resume auto), or set "
                              "checkpoint.overwrite=true to move them aside (they are renamed, never deleted)",
                              paths.checkpoint_root, steps, start));
    }
    std::vector<fs::path> moved;
    for (const CheckpointRef& c : in_the_way) moved.emplace_back(c.path);
    const fs::path latest = fs::path(paths.checkpoint_root) / kLatestName;
    std::error_code ec;
    if (mode == "none" && fs::exists(latest, ec)) moved.push_back(latest);
    const std::string aside = move_aside(paths.checkpoint_root, moved, stamp);
    log::warn(fmt::format("checkpoint.overwrite: moved the checkpoints of steps {} from {} to {}", steps,
                          paths.checkpoint_root, aside));
  }
  if (fresh_start_) {
    const fs::path metrics = fs::path(paths.run_dir) / "metrics.jsonl";
    std::error_code ec;
    if (fs::exists(metrics, ec) && fs::file_size(metrics, ec) > 0) {
      const fs::path aside = fs::path(paths.run_dir) / ("metrics.old-" + stamp + ".jsonl");
      fs::rename(metrics, aside, ec);
      MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                     fmt::format("logging.run_dir: cannot move the earlier run's {} aside ({})", metrics.string(),
                                 ec.message()));
      log::info(fmt::format("a fresh start: the earlier run's metrics.jsonl is now {}", aside.string()));
    }
  }
}

}  // namespace moetrain
