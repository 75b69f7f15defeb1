#include "core/checkpoint/checkpoint_directory.h"

#include <algorithm>
#include <filesystem>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/fault_injection.h"
#include "core/io/output_file.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<CheckpointRef> list_committed_checkpoints(const std::string& root) {
  std::vector<CheckpointRef> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return found;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    int64_t step = parse_checkpoint_dir_name(entry.path().filename().string());
    if (step < 0 || !entry.is_directory(ec)) continue;
    if (!fs::exists(entry.path() / kManifestName, ec)) continue;
    found.push_back(CheckpointRef{step, entry.path().string()});
  }
  MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint, "cannot list checkpoint directory " + root + ": " + ec.message());
  std::sort(found.begin(), found.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return found;
}

std::optional<CheckpointRef> newest_committed_checkpoint(const std::string& root) {
  std::vector<CheckpointRef> all = list_committed_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

int remove_incomplete_checkpoints(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return 0;
  std::vector<fs::path> leftovers;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) == 0 && (ends_with(name, ".tmp") || ends_with(name, ".deleting"))) {
      leftovers.push_back(entry.path());
    }
  }
  for (const fs::path& path : leftovers) {
    fs::remove_all(path, ec);
    MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint,
                   "cannot remove the incomplete checkpoint " + path.string() + ": " + ec.message());
    log::info("removed the incomplete checkpoint " + path.string() + " (left by an interrupted save)");
  }
  return static_cast<int>(leftovers.size());
}

void prune_checkpoints(const std::string& root, int64_t keep_last, int rank) {
  MOETRAIN_ASSERT(keep_last >= 1, "keep_last < 1");
  std::vector<CheckpointRef> all = list_committed_checkpoints(root);
  if (static_cast<int64_t>(all.size()) <= keep_last) return;
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) {
    std::string doomed = all[i].path + ".deleting";
    rename_durably(all[i].path, doomed);
    std::error_code ec;
    // Half-delete first for the fault test: the shards go, the directory stays.
    for (const fs::directory_entry& entry : fs::directory_iterator(doomed, ec)) {
      if (entry.path().filename() != kManifestName) {
        fs::remove(entry.path(), ec);
        break;
      }
    }
    fault_point("during_cleanup", rank);
    fs::remove_all(doomed, ec);
    if (ec) log::warn("could not delete the old checkpoint " + doomed + ": " + ec.message() + " (delete it by hand)");
  }
}

std::string resolve_checkpoint_path(const std::string& path) {
  std::error_code ec;
  MOETRAIN_CHECK(fs::is_directory(path, ec), ExitCode::kBadCheckpoint,
                 "checkpoint " + path + " does not exist or is not a directory");
  if (fs::exists(fs::path(path) / kManifestName, ec)) return path;
  std::optional<CheckpointRef> newest = newest_committed_checkpoint(path);
  MOETRAIN_CHECK(newest.has_value(), ExitCode::kBadCheckpoint,
                 "checkpoint " + path + " has no manifest.json and no committed step_<N>/ inside (an incomplete "
                 "save leaves only step_<N>.tmp, which is never resumed from)");
  return newest->path;
}

}  // namespace moetrain
