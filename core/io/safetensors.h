// Reading safetensors files (https://github.com/huggingface/safetensors, format below).
//
//   [8 bytes: header length N, little-endian u64][N bytes: JSON header][data section]
//   header = {"__metadata__": {str: str}?,
//             "<tensor name>": {"dtype": "BF16", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
//   offsets are relative to the start of the data section; [begin, end) holds the row-major bytes.
//
// The file is mmapped and fully validated when opened, so that every later access is in bounds:
// a corrupt or hostile file gives Error(kBadCheckpoint) naming the file, the tensor and the byte
// offset, never a crash or a read outside the mapping.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/base/tensor.h"
#include "core/io/fp8_block.h"
#include "core/io/mapped_file.h"

namespace moetrain {

struct SafetensorsTensorInfo {
  // The element storage. F8_E4M3 / F8_E5M2 tensors are U8 codes with `fp8` saying how to decode them.
  DType dtype = DType::kF32;
  Fp8Format fp8 = Fp8Format::kNone;
  Shape shape;
  uint64_t file_offset = 0;  // absolute byte offset of the tensor's first byte in the file
  uint64_t nbytes = 0;
};

class SafetensorsFile {
 public:
  // Header-bomb guard: a header longer than this is rejected before it is parsed.
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // Maps and validates the file; throws Error(kBadCheckpoint) on any problem.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  // Tensor names, sorted.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws Error(kBadCheckpoint) naming the tensor and the file when it is absent.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  // The "__metadata__" map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Byte offset of the data section (8 + header length); our writer makes it a multiple of 8.
  uint64_t data_start() const { return data_start_; }

  // Zero-copy view into the mapping, valid while this object lives. The memory is read-only
  // (writing through the view faults) and is only as aligned as the file's writer made it.
  TensorView view(const std::string& name) const;
  // Copies rows [row_begin, row_end) of dimension 0 into dst, touching only those bytes of the
  // file. A 0-d tensor has no rows. Bad bounds are an Error naming the tensor.
  void read_rows(void* dst, const std::string& name, int64_t row_begin, int64_t row_end) const;
  // The whole tensor converted to dst_dtype: floating types convert among F32/F64/BF16/F16, FP8
  // codes decode (unscaled: HfCheckpoint applies block scales) into those;
  // other dtypes only to themselves (anything else is an Error naming both dtypes).
  Tensor read_as(const std::string& name, DType dst_dtype) const;
  // Rows [row_begin, row_end) of dimension 0, converted like read_as.
  Tensor read_rows_as(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const;

 private:
  void parse_header();
  void check_row_range(const std::string& name, const Shape& shape, int64_t row_begin, int64_t row_end) const;
  void check_convertible(const std::string& name, DType dst_dtype, const SafetensorsTensorInfo& src) const;
  const uint8_t* tensor_bytes(const SafetensorsTensorInfo& info) const { return file_.data() + info.file_offset; }

  MappedFile file_;
  uint64_t data_start_ = 0;
  std::unordered_map<std::string, SafetensorsTensorInfo> tensors_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moetrain
