#include "core/data/image_index.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "core/base/error.h"

namespace moetrain {
namespace {

[[noreturn]] void bad_images(const std::string& message) { throw Error(ExitCode::kBadData, message); }

MappedFile map_or_fail(const std::string& path) {
  try {
    return MappedFile(path);
  } catch (const Error& e) {
    bad_images(e.what());
  }
}

}  // namespace

bool ImageIndex::present(const std::string& prefix) { return std::filesystem::exists(prefix + ".images"); }

int64_t ImageIndex::read_i64(uint64_t offset) const {
  int64_t v = 0;
  std::memcpy(&v, index_.data() + offset, sizeof v);  // little-endian hosts only, as the token files
  return v;
}

int32_t ImageIndex::read_i32(uint64_t offset) const {
  int32_t v = 0;
  std::memcpy(&v, index_.data() + offset, sizeof v);
  return v;
}

ImageIndex::ImageIndex(const std::string& prefix, int64_t documents, const std::vector<int64_t>& document_lengths)
    : index_path_(prefix + ".images") {
  index_ = map_or_fail(index_path_);
  const std::string fix = "; rewrite it with scripts/prepare_data.py";
  const uint64_t header = 8 + 5 * 8;
  if (index_.size() < header || std::memcmp(index_.data(), kMagic, 8) != 0) {
    bad_images(fmt::format("{}: not a moetrain image index (magic MTIMAGES and a 48-byte header){}", index_path_, fix));
  }
  const int64_t version = read_i64(8);
  patch_values_ = read_i64(16);
  placeholder_ = read_i64(24);
  const int64_t docs = read_i64(32);
  images_ = read_i64(40);
  if (version != 1 || patch_values_ <= 0 || docs != documents || images_ < 0 || images_ > (int64_t{1} << 40)) {
    bad_images(fmt::format("{}: version {}, {} values per patch, {} documents, {} images: expected version 1 and "
                           "the {} documents of the token files{}",
                           index_path_, version, patch_values_, docs, images_, documents, fix));
  }
  const uint64_t n = static_cast<uint64_t>(images_);
  doc_first_offset_ = header;
  grid_offset_ = doc_first_offset_ + 8 * static_cast<uint64_t>(docs + 1);
  token_offset_offset_ = grid_offset_ + 12 * n;
  tokens_offset_ = token_offset_offset_ + 8 * n;
  first_patch_offset_ = tokens_offset_ + 4 * n;
  const uint64_t size = first_patch_offset_ + 8 * (n + 1);
  if (index_.size() != size) {
    bad_images(fmt::format("{}: {} bytes, expected {} for {} documents and {} images{}", index_path_, index_.size(),
                           size, docs, images_, fix));
  }
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t first = first_image(d), last = first_image(d + 1);
    if (first < 0 || last < first || last > images_ || (d == 0 && first != 0) || (d + 1 == docs && last != images_)) {
      bad_images(fmt::format("{}: document {}'s images [{}, {}) at byte offset {} do not run in order over the {} "
                             "images{}",
                             index_path_, d, first, last, doc_first_offset_ + 8 * d, images_, fix));
    }
    for (int64_t i = first; i < last; ++i) {
      const std::array<int32_t, 3> g = grid(i);
      const int64_t begin = token_offset(i), end = begin + tokens(i);
      const bool ordered = i == first || begin >= token_offset(i - 1) + tokens(i - 1);
      if (g[0] < 1 || g[1] < 1 || g[2] < 1 || tokens(i) < 1 || begin < 0 ||
          end > document_lengths[static_cast<size_t>(d)] || !ordered ||
          first_patch(i + 1) - first_patch(i) != int64_t{g[0]} * g[1] * g[2]) {
        bad_images(fmt::format("{}: image {} (document {}, grid {} x {} x {}, placeholders [{}, {}), patches [{}, {})) "
                               "does not fit its document of {} tokens or its grid{}",
                               index_path_, i, d, g[0], g[1], g[2], begin, end, first_patch(i), first_patch(i + 1),
                               document_lengths[static_cast<size_t>(d)], fix));
      }
    }
  }
  patches_ = map_or_fail(prefix + ".patches");
  const uint64_t want = static_cast<uint64_t>(first_patch(images_)) * static_cast<uint64_t>(patch_values_) * 4;
  if (first_patch(0) != 0 || patches_.size() != want) {
    bad_images(fmt::format("{}.patches: {} bytes, but {} lists {} patches of {} float32 values ({} bytes){}", prefix,
                           patches_.size(), index_path_, first_patch(images_), patch_values_, want, fix));
  }
}

std::array<int32_t, 3> ImageIndex::grid(int64_t image) const {
  const uint64_t at = grid_offset_ + 12 * static_cast<uint64_t>(image);
  return {read_i32(at), read_i32(at + 4), read_i32(at + 8)};
}

int64_t ImageIndex::tokens(int64_t image) const { return read_i32(tokens_offset_ + 4 * static_cast<uint64_t>(image)); }

const float* ImageIndex::patches(int64_t image) const {
  return reinterpret_cast<const float*>(patches_.data()) + first_patch(image) * patch_values_;
}

}  // namespace moetrain
