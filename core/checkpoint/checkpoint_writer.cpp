#include "core/checkpoint/checkpoint_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/fault_injection.h"
#include "core/io/output_file.h"
#include "core/io/safetensors_writer.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

using Json = nlohmann::json;

// Runs `phase` on this rank, then agrees with the others: every rank throws when any failed.
void agree(CheckpointGroup& group, const std::string& what, const std::function<void()>& phase) {
  run_agreed(group, "checkpoint save: " + what,
             Error(ExitCode::kBadCheckpoint,
                   fmt::format("checkpoint save failed on another rank while {} (see that rank's message)", what)),
             phase);
}

// The manifest's own directory entry must be durable before the rename publishes the directory.
void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOETRAIN_CHECK(fd >= 0, ExitCode::kBadCheckpoint, "cannot open directory " + dir + " to fsync it");
  int rc = ::fsync(fd);
  int error_number = errno;
  ::close(fd);
  // Some file systems refuse fsync on directories (EINVAL); the files themselves are synced.
  MOETRAIN_CHECK(rc == 0 || error_number == EINVAL || error_number == EROFS, ExitCode::kBadCheckpoint,
                 "cannot fsync directory " + dir + ": " + std::strerror(error_number));
}

void write_shard(const std::string& path, const RankShard& shard, int rank, int world) {
  SafetensorsWriter writer;
  std::map<std::string, TensorSlice> slices;
  for (const ShardTensor& t : shard.tensors) {
    MOETRAIN_ASSERT(t.host.device == Device::kCPU, "checkpoint tensor " + t.key + " is not on the host");
    MOETRAIN_ASSERT(t.host.ndim() >= 1 && t.slice.global_shape.ndim() == t.host.ndim() &&
                        t.slice.offset >= 0 && t.slice.offset + t.host.size(0) <= t.slice.global_shape[0],
                    "checkpoint tensor " + t.key + ": slice does not fit its global shape");
    writer.add(t.key, t.host);
    slices.emplace(t.key, t.slice);
  }
  writer.set_metadata(kSlicesMetadataKey, slices_to_json(slices));
  writer.set_metadata("moetrain.rank", std::to_string(rank));
  writer.set_metadata("moetrain.world", std::to_string(world));
  writer.write_atomic(path);  // fsyncs the file and the directory entry
}

}  // namespace

std::string save_checkpoint(CheckpointGroup& group, const SaveRequest& request, const RankShard& shard) {
  const int rank = group.rank();
  const std::string final_dir = (fs::path(request.root) / checkpoint_dir_name(request.step)).string();
  const std::string tmp_dir = final_dir + ".tmp";

  agree(group, "preparing " + tmp_dir, [&] {
    if (!group.is_root()) return;
    std::error_code ec;
    fs::create_directories(request.root, ec);
    MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint,
                   fmt::format("cannot create checkpoint.dir {}: {} (check the path and permissions)", request.root,
                               ec.message()));
    MOETRAIN_CHECK(!fs::exists(final_dir, ec), ExitCode::kBadCheckpoint,
                   fmt::format("checkpoint {} already exists and is never overwritten: move it away, or resume "
                               "from it (--resume auto) instead of re-running its steps",
                               final_dir));
    fs::remove_all(tmp_dir, ec);
    fs::create_directory(tmp_dir, ec);
    MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint, fmt::format("cannot create {}: {}", tmp_dir, ec.message()));
  });

  ManifestFile file;
  agree(group, "writing the shards", [&] {
    file.path = shard_file_name(rank);
    file.rank = rank;
    std::string path = (fs::path(tmp_dir) / file.path).string();
    write_shard(path, shard, rank, group.world());
    FileDigest digest = digest_file(path);
    file.bytes = digest.bytes;
    file.crc32 = digest.crc32;
    fault_point("after_shard_write", rank);
  });

  Json entry = {{"bytes", file.bytes},
                {"crc32", file.crc32},
                {"data_cursor", shard.data_cursor},
                {"rng_state", shard.rng_state}};
  std::vector<std::string> entries = group.gather_to_root(entry.dump());

  agree(group, "committing " + final_dir, [&] {
    if (!group.is_root()) return;
    fault_point("before_manifest", rank);
    Manifest manifest;
    manifest.step = request.step;
    manifest.tokens = request.tokens;
    manifest.optimizer_steps = request.optimizer_steps;
    manifest.world = group.world();
    manifest.fsdp = request.fsdp;
    manifest.ep = request.ep;
    manifest.config_yaml = request.config_yaml;
    for (int r = 0; r < group.world(); ++r) {
      Json e = Json::parse(entries[static_cast<size_t>(r)]);
      manifest.ranks.push_back(RankProgress{r, e.at("data_cursor").get<uint64_t>(), e.at("rng_state").get<uint64_t>()});
      manifest.files.push_back(
          ManifestFile{shard_file_name(r), r, e.at("bytes").get<uint64_t>(), e.at("crc32").get<uint32_t>()});
    }
    {
      std::string text = manifest_to_json(manifest);
      OutputFile out((fs::path(tmp_dir) / kManifestName).string());
      out.write(text.data(), text.size());
      out.sync();
      out.close();
    }
    fsync_directory(tmp_dir);
    fault_point("before_rename", rank);
    rename_durably(tmp_dir, final_dir);  // the commit
    fault_point("before_latest", rank);
    write_text_durably((fs::path(request.root) / kLatestName).string(), checkpoint_dir_name(request.step) + "\n");
    prune_checkpoints(request.root, request.keep_last, rank);
  });
  if (group.is_root()) log::info(fmt::format("checkpoint saved: {} (step {}, {} rank shard(s))", final_dir, request.step, group.world()));
  return final_dir;
}

}  // namespace moetrain
