#include "core/checkpoint/checkpoint_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/error.h"
#include "core/io/safetensors.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void corrupt(const std::string& what) {
  throw Error(ExitCode::kBadCheckpoint,
              what + " (the checkpoint is damaged: resume from an older step_<N> with --resume PATH, or start over "
                     "with --resume none)");
}

}  // namespace

Manifest read_manifest(const std::string& checkpoint_dir) {
  std::string path = (fs::path(checkpoint_dir) / kManifestName).string();
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) corrupt("cannot read " + path + " (missing: the checkpoint was never committed)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_manifest(text.str(), path);
}

CheckpointReader::CheckpointReader(const std::string& checkpoint_dir)
    : dir_(checkpoint_dir), manifest_(read_manifest(checkpoint_dir)) {
  for (size_t i = 0; i < manifest_.files.size(); ++i) {
    const ManifestFile& listed = manifest_.files[i];
    std::string path = (fs::path(dir_) / listed.path).string();
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) corrupt(fmt::format("checkpoint file {} is missing", path));
    uint64_t size = fs::file_size(path, ec);
    if (ec || size != listed.bytes) {
      corrupt(fmt::format("checkpoint file {} has {} bytes but the manifest says {} (truncated or replaced)", path,
                          size, listed.bytes));
    }
    FileDigest digest = digest_file(path);
    if (digest.bytes != listed.bytes || digest.crc32 != listed.crc32) {
      corrupt(fmt::format("checkpoint file {} has crc32 {:08x} but the manifest says {:08x} (its bytes changed "
                          "after the save)",
                          path, digest.crc32, listed.crc32));
    }
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    index_shard(i);
  }
  for (auto& [key, tensor] : tensors_) check_tiling(key, tensor);
}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::index_shard(size_t file_index) {
  const SafetensorsFile& file = *files_[file_index];
  auto found = file.metadata().find(kSlicesMetadataKey);
  if (found == file.metadata().end()) corrupt(file.path() + ": no " + kSlicesMetadataKey + " metadata");
  std::map<std::string, TensorSlice> slices = parse_slices(found->second, file.path());
  for (const std::string& key : file.names()) {
    auto slice = slices.find(key);
    if (slice == slices.end()) corrupt(fmt::format("{}: tensor \"{}\" has no slice entry", file.path(), key));
    const SafetensorsTensorInfo& info = file.info(key);
    const Shape& global = slice->second.global_shape;
    bool fits = info.shape.ndim() >= 1 && info.shape.ndim() == global.ndim() && slice->second.offset >= 0 &&
                slice->second.offset <= global[0] - info.shape[0];
    for (int d = 1; fits && d < global.ndim(); ++d) fits = info.shape[d] == global[d];
    if (!fits) {
      corrupt(fmt::format("{}: tensor \"{}\" of shape {} at row {} does not fit its global shape {}", file.path(), key,
                          info.shape.str(), slice->second.offset, global.str()));
    }
    auto [it, inserted] = tensors_.try_emplace(key);
    GlobalTensor& tensor = it->second;
    if (inserted) {
      tensor.shape = global;
      tensor.dtype = info.dtype;
    } else if (tensor.shape != global || tensor.dtype != info.dtype) {
      corrupt(fmt::format("{}: tensor \"{}\" is {} {} here but {} {} in another shard", file.path(), key,
                          dtype_name(info.dtype), global.str(), dtype_name(tensor.dtype), tensor.shape.str()));
    }
    tensor.pieces.push_back(Piece{file_index, slice->second.offset, info.shape[0]});
  }
}

void CheckpointReader::check_tiling(const std::string& key, GlobalTensor& tensor) const {
  std::sort(tensor.pieces.begin(), tensor.pieces.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  int64_t next = 0;
  for (const Piece& piece : tensor.pieces) {
    if (piece.offset != next) {
      corrupt(fmt::format("{}: tensor \"{}\": rows [{}, {}) are {} (shard {})", dir_, key, std::min(next, piece.offset),
                          std::max(next, piece.offset), piece.offset > next ? "in no shard" : "in two shards",
                          files_[piece.file]->path()));
    }
    next = piece.offset + piece.rows;
  }
  if (next != tensor.shape[0]) {
    corrupt(fmt::format("{}: tensor \"{}\": rows [{}, {}) are in no shard", dir_, key, next, tensor.shape[0]));
  }
}

std::vector<std::string> CheckpointReader::keys() const {
  std::vector<std::string> keys;
  for (const auto& entry : tensors_) keys.push_back(entry.first);
  return keys;
}

const Shape& CheckpointReader::global_shape(const std::string& key) const {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) corrupt(fmt::format("{}: no tensor \"{}\"", dir_, key));
  return it->second.shape;
}

DType CheckpointReader::dtype(const std::string& key) const {
  global_shape(key);
  return tensors_.at(key).dtype;
}

Tensor CheckpointReader::read_rows(const std::string& key, int64_t row_begin, int64_t row_end, DType dtype) const {
  const Shape& shape = global_shape(key);
  const GlobalTensor& tensor = tensors_.at(key);
  MOETRAIN_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= shape[0], ExitCode::kBadCheckpoint,
                 fmt::format("{}: rows [{}, {}) of tensor \"{}\" requested, but it has {} rows", dir_, row_begin,
                             row_end, key, shape[0]));
  Shape out_shape = shape;
  out_shape[0] = row_end - row_begin;
  Tensor out(out_shape, dtype);
  const size_t row_bytes = out_shape[0] > 0 ? out.nbytes() / static_cast<size_t>(out_shape[0]) : 0;
  for (const Piece& piece : tensor.pieces) {
    int64_t begin = std::max(row_begin, piece.offset);
    int64_t end = std::min(row_end, piece.offset + piece.rows);
    if (begin >= end) continue;
    Tensor part = files_[piece.file]->read_rows_as(key, begin - piece.offset, end - piece.offset, dtype);
    std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(begin - row_begin) * row_bytes, part.data(),
                part.nbytes());
  }
  return out;
}

Tensor CheckpointReader::read(const std::string& key, DType dtype) const {
  return read_rows(key, 0, global_shape(key)[0], dtype);
}

}  // namespace moetrain
