// Reading a committed checkpoint: the manifest, every shard verified against the manifest's
// size and crc32 before it is used, and tensors re-assembled by global name.
//
// Resharding: each shard says which rows of which global tensor it holds. read_rows() serves
// any row range from whichever shards overlap it, so a checkpoint saved by 4 ranks can be read
// by 2 (each asking for its half) or by 1 (asking for everything), and a tensor's slices must
// tile its global rows exactly: a gap, an overlap, or a shape that disagrees between shards is
// Error(kBadCheckpoint) naming the tensor and the file.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/base/tensor.h"
#include "core/checkpoint/checkpoint_format.h"

namespace moetrain {

class SafetensorsFile;

// Reads and validates <checkpoint_dir>/manifest.json (Error(kBadCheckpoint) naming it).
Manifest read_manifest(const std::string& checkpoint_dir);

class CheckpointReader {
 public:
  // Opens a committed checkpoint directory: checks every listed file's size and crc32, then
  // parses the shards' headers and slice tables.
  explicit CheckpointReader(const std::string& checkpoint_dir);
  ~CheckpointReader();

  const std::string& path() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }

  // Keys ("<kind>/<global name>"), sorted.
  std::vector<std::string> keys() const;
  bool has(const std::string& key) const { return tensors_.count(key) != 0; }
  // Error(kBadCheckpoint) naming the key when it is absent.
  const Shape& global_shape(const std::string& key) const;
  DType dtype(const std::string& key) const;

  // Rows [row_begin, row_end) of dimension 0 of the global tensor, converted to `dtype`.
  Tensor read_rows(const std::string& key, int64_t row_begin, int64_t row_end, DType dtype) const;
  Tensor read(const std::string& key, DType dtype) const;

 private:
  struct Piece {
    size_t file = 0;       // index into files_
    int64_t offset = 0;    // first global row it holds
    int64_t rows = 0;
  };
  struct GlobalTensor {
    Shape shape;
    DType dtype = DType::kF32;
    std::vector<Piece> pieces;  // sorted by offset, tiling [0, shape[0])
  };
  void index_shard(size_t file_index);
  void check_tiling(const std::string& key, GlobalTensor& tensor) const;

  std::string dir_;
  Manifest manifest_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, GlobalTensor> tensors_;
};

}  // namespace moetrain
