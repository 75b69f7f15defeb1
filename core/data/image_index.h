// A dataset's images (Kimi K3's vision tower, model.vision), beside its token files, written by
// scripts/prepare_data.py (its docstring has the byte layout):
//   <prefix>.images   the index: values per patch, the placeholder token, each document's images,
//                     and per image its grid (frames, rows, columns of patches), where its run of
//                     placeholders starts in the document, how many there are, its first patch
//   <prefix>.patches  float32 patches, every image's in document order
// Both are memory-mapped; every field is checked when opened (Error kBadData naming the file and
// the byte offset).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/mapped_file.h"

namespace moetrain {

class ImageIndex {
 public:
  static constexpr char kMagic[8] = {'M', 'T', 'I', 'M', 'A', 'G', 'E', 'S'};
  // Opens <prefix>.images and <prefix>.patches for a dataset of `documents` documents whose
  // lengths are `document_length`(d).
  ImageIndex(const std::string& prefix, int64_t documents, const std::vector<int64_t>& document_lengths);
  static bool present(const std::string& prefix);

  int64_t patch_values() const { return patch_values_; }
  int64_t placeholder() const { return placeholder_; }
  int64_t first_image(int64_t doc) const { return read_i64(doc_first_offset_ + 8 * static_cast<uint64_t>(doc)); }
  std::array<int32_t, 3> grid(int64_t image) const;
  int64_t token_offset(int64_t image) const { return read_i64(token_offset_offset_ + 8 * static_cast<uint64_t>(image)); }
  int64_t tokens(int64_t image) const;
  int64_t first_patch(int64_t image) const { return read_i64(first_patch_offset_ + 8 * static_cast<uint64_t>(image)); }
  // The image's patches: (first_patch(i + 1) - first_patch(i)) x patch_values() floats.
  const float* patches(int64_t image) const;

 private:
  int64_t read_i64(uint64_t offset) const;
  int32_t read_i32(uint64_t offset) const;
  std::string index_path_;
  MappedFile index_;
  MappedFile patches_;
  int64_t patch_values_ = 0;
  int64_t placeholder_ = 0;
  int64_t images_ = 0;
  uint64_t doc_first_offset_ = 0, grid_offset_ = 0, token_offset_offset_ = 0, tokens_offset_ = 0,
           first_patch_offset_ = 0;
};

}  // namespace moetrain
