// The on-disk layout of a checkpoint (docs/CHECKPOINTS.md has the full description):
//
//   <dir>/step_<N>/manifest.json          written last, by rank 0
//   <dir>/step_<N>/rank_<R>.safetensors   one per rank R of the world that saved it
//   <dir>/latest                          "step_<N>\n", replaced by temp + rename
//
// A shard holds tensors under keys "<kind>/<global name>" (kinds below). Its __metadata__
// entry "moetrain.slices" is a JSON object {key: {"global_shape": [...], "offset": o}}: the
// shard's tensor is rows [o, o + rows) of dimension 0 of the global tensor. So a tensor split
// over any number of ranks (FSDP shards, expert-parallel expert ranges) is put back together,
// or cut differently, by its global name alone, whatever world size saved it.
//
// manifest.json:
//   {"format": "moetrain-checkpoint", "version": 1, "step": N, "tokens": T, "optimizer_steps": S,
//    "world": {"size": W, "fsdp": F, "ep": E}, "config": "<resolved YAML>",
//    "ranks": [{"rank": r, "data_cursor": c, "rng_state": s}, ...],
//    "files": [{"path": "rank_00000.safetensors", "rank": 0, "bytes": B, "crc32": "1a2b3c4d"}, ...]}
// "path" is a bare file name inside the checkpoint directory: anything else (a '/', "..") is
// rejected, so a hostile manifest cannot make the reader open files elsewhere.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/base/tensor.h"

namespace moetrain {

// Key prefixes of the tensors in a shard.
inline constexpr const char* kParamKind = "param/";            // trainable values (LoRA factors, ...)
inline constexpr const char* kExpAvgKind = "exp_avg/";         // AdamW first moment
inline constexpr const char* kExpAvgSqKind = "exp_avg_sq/";    // AdamW second moment
inline constexpr const char* kBufferKind = "buffer/";          // trainable buffers (router bias, ...)
inline constexpr const char* kSlicesMetadataKey = "moetrain.slices";

inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kLatestName = "latest";

// Rows [offset, offset + rows) of dimension 0 of a global tensor.
struct TensorSlice {
  Shape global_shape;
  int64_t offset = 0;
};

struct ManifestFile {
  std::string path;  // a bare file name in the checkpoint directory
  int rank = 0;
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct RankProgress {
  int rank = 0;
  uint64_t data_cursor = 0;  // the data source's cursor() on that rank
  uint64_t rng_state = 0;    // the rank's random stream position (router noise), 0 when unused
};

struct Manifest {
  int64_t step = 0;             // optimizer steps completed: resume runs step `step` next (0-based)
  int64_t tokens = 0;           // tokens trained on so far, all ranks
  int64_t optimizer_steps = 0;  // AdamW updates applied (skipped steps excluded): bias correction
  int world = 1;
  int64_t fsdp = 1;
  int64_t ep = 1;
  std::string config_yaml;      // the resolved config of the run that saved it
  std::vector<RankProgress> ranks;
  std::vector<ManifestFile> files;
};

std::string checkpoint_dir_name(int64_t step);  // "step_<N>"
std::string shard_file_name(int rank);          // "rank_<R, 5 digits>.safetensors"
// "step_<N>" -> N; -1 for any other name (including "step_<N>.tmp").
int64_t parse_checkpoint_dir_name(const std::string& name);

std::string manifest_to_json(const Manifest& manifest);
// Parses and validates (types, ranges, confined paths, one file per rank 0..world-1).
// Error(kBadCheckpoint) naming `source` and the field.
Manifest parse_manifest(const std::string& text, const std::string& source);

// The slice table stored in a shard's metadata.
std::string slices_to_json(const std::map<std::string, TensorSlice>& slices);
std::map<std::string, TensorSlice> parse_slices(const std::string& text, const std::string& source);

// zlib crc32 and size of a whole file; Error(kBadCheckpoint) when it cannot be read.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
FileDigest digest_file(const std::string& path);

// Writes `text` to `path` durably: path.tmp, fsync, rename, fsync of the directory.
void write_text_durably(const std::string& path, const std::string& text);

}  // namespace moetrain
