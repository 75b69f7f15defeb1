// A Hugging Face model directory's weights: either one `model.safetensors`, or shards listed by
// `model.safetensors.index.json`:
//   {"metadata": {"total_size": 123, ...}, "weight_map": {"<tensor name>": "model-00001-of-00002.safetensors", ...}}
// Shards are opened (mmapped and validated) lazily, each at most once, so a rank that needs a
// few tensors opens only the shards holding them; a lone model.safetensors is opened at once.
//
// FP8 block-scaled weights (core/io/fp8_block.h) read as their dequantized values: read_as and
// read_rows_as of an F8_E4M3 / F8_E5M2 `X.weight` multiply its codes by `X.weight_scale_inv`,
// and a slice reads only its rows' codes and the scale rows of the blocks they fall in.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/io/safetensors.h"

namespace moetrain {

class HfCheckpoint {
 public:
  static constexpr const char* kIndexFileName = "model.safetensors.index.json";
  static constexpr const char* kSingleFileName = "model.safetensors";

  // Reads the index (or finds the single file) and checks that every shard it names exists, and
  // config.json's FP8 quantization_config when there is one (fp8_block.h says what is accepted).
  // Throws Error(kBadCheckpoint) naming the directory, the index, the shard or the tensor.
  explicit HfCheckpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  // Every tensor name, sorted (from the index, or from the single file).
  const std::vector<std::string>& names() const { return names_; }
  // A multimodal checkpoint (Kimi K3) keeps its text model under `language_model.`: those tensors
  // also answer to their names without the prefix, here and in every accessor below.
  bool has(const std::string& name) const { return shard_of_.count(stored(name)) != 0; }
  // The index's "metadata", each value as JSON text ("123" for a number, "\"x\"" for a string).
  const std::map<std::string, std::string>& index_metadata() const { return index_metadata_; }
  // Path of the file that holds `name`.
  std::string file_of(const std::string& name) const;

  // config.json's FP8 quantization (declared() false without one).
  const Fp8BlockQuantization& fp8_quantization() const { return fp8_; }

  // These open the tensor's shard on first use. An absent tensor, or a shard that lacks a tensor
  // the index promised, is an Error naming the tensor and the file. An FP8 tensor is read
  // dequantized (read_rows copies its codes as they are); one that config.json does not declare,
  // that modules_to_not_convert excludes, that lacks its block scales or whose scales have
  // another shape than [ceil(rows / 128), ceil(cols / 128)] is an Error naming it, as is a
  // non-FP8 weight with a weight_scale_inv beside it.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  Tensor read_as(const std::string& name, DType dst_dtype) const;
  // An FP8 weight as stored, for model.weight_format: fp8: its codes [rows, cols] U8 and block
  // scales [ceil(rows / 128), ceil(cols / 128)] F32, checked as read_as checks them.
  struct Fp8Weight {
    Fp8Format format = Fp8Format::kNone;
    Tensor codes;
    Tensor scales;
  };
  Fp8Weight read_fp8(const std::string& name) const;
  Tensor read_rows_as(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const;
  void read_rows(void* dst, const std::string& name, int64_t row_begin, int64_t row_end) const;
  // The open shard holding `name` (for zero-copy views); valid as long as this object.
  const SafetensorsFile& file_for(const std::string& name) const;
  // Bytes of tensor data the read calls above have copied out of the files so far (a rank's
  // share of a sharded load; zero-copy views through file_for() are not counted).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  void read_index(const std::string& index_path);
  void read_fp8_quantization();
  // Rows [row_begin, row_end) of an FP8 weight, dequantized, as dst_dtype.
  Tensor read_fp8_rows(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const;
  // Rows [row_begin, row_end) of an FP8 weight's codes and the scale rows of the blocks they fall
  // in, after checking the weight against config.json and its scales' shape.
  Fp8Weight read_fp8_blocks(const std::string& name, int64_t row_begin, int64_t row_end) const;
  // Refuses a non-FP8 weight that has block scales beside it.
  void check_unscaled(const std::string& name) const;
  const std::string& stored(const std::string& name) const {
    auto it = unprefixed_.find(name);
    return it == unprefixed_.end() ? name : it->second;
  }

  std::string dir_;
  bool sharded_ = false;
  std::map<std::string, std::string> shard_of_;  // tensor name -> file name inside dir_
  std::vector<std::string> names_;
  std::map<std::string, std::string> unprefixed_;  // text tensor name without language_model. -> stored name
  std::map<std::string, std::string> index_metadata_;
  Fp8BlockQuantization fp8_;
  mutable std::mutex open_mutex_;  // loaders may read tensors from several threads
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open_files_;
  mutable std::atomic<uint64_t> bytes_read_{0};
};

struct NamedTensor {
  std::string name;
  TensorView tensor;
};

struct HfShardedWriteParams {
  int num_shards = 1;                            // 1: a single model.safetensors and no index
  std::map<std::string, std::string> metadata;   // each shard's "__metadata__" (e.g. {"format": "pt"})
};

// Writes `dir` (created if missing) as a Hugging Face weights directory: tensors sorted by name
// and split into num_shards contiguous groups `model-0000K-of-0000N.safetensors` plus the index
// (with metadata.total_size). Every file is written atomically. Used by tests and fixtures.
void write_hf_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                         const HfShardedWriteParams& params);

}  // namespace moetrain
