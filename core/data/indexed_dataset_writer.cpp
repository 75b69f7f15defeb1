#include "core/data/indexed_dataset_writer.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/base/error.h"
#include "core/data/indexed_dataset.h"

namespace moetrain {
namespace {

template <class T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only, as everything we run on
  out.append(bytes, sizeof(T));
}

void put_token(std::string& out, int64_t id, int dtype_code) {
  const bool fits = dtype_code == 1 ? id >= 0 && id <= 0xff
                  : dtype_code == 8 ? id >= 0 && id <= 0xffff
                  : dtype_code == 4 ? id >= INT32_MIN && id <= INT32_MAX
                                    : true;
  MOETRAIN_CHECK(fits, ExitCode::kBadData, fmt::format("token id {} does not fit dtype code {}", id, dtype_code));
  switch (dtype_code) {
    case 1: put<uint8_t>(out, static_cast<uint8_t>(id)); break;
    case 4: put<int32_t>(out, static_cast<int32_t>(id)); break;
    case 5: put<int64_t>(out, id); break;
    case 8: put<uint16_t>(out, static_cast<uint16_t>(id)); break;
    default: MOETRAIN_CHECK(false, ExitCode::kBadData, fmt::format("dtype code {} is not supported", dtype_code));
  }
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  MOETRAIN_CHECK(out.good(), ExitCode::kBadData, fmt::format("cannot write {}", path));
}

}  // namespace

void write_indexed_dataset(const std::string& prefix, const IndexedDatasetContents& contents) {
  const auto& docs = contents.documents;
  MOETRAIN_CHECK(contents.loss_masks.empty() || contents.loss_masks.size() == docs.size(), ExitCode::kBadData,
                 "write_indexed_dataset: one loss mask per document");
  std::string bin, idx, mask;
  std::vector<int64_t> pointers;
  int64_t offset = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    pointers.push_back(offset);
    for (int64_t id : docs[d]) put_token(bin, id, contents.dtype_code);
    offset = static_cast<int64_t>(bin.size());
    if (!contents.loss_masks.empty()) {
      MOETRAIN_CHECK(contents.loss_masks[d].size() == docs[d].size(), ExitCode::kBadData,
                     "write_indexed_dataset: a loss mask's length differs from its document's");
      mask.append(contents.loss_masks[d].begin(), contents.loss_masks[d].end());
    }
  }
  idx.append(IndexedDataset::kMagic, sizeof(IndexedDataset::kMagic));
  put<uint64_t>(idx, IndexedDataset::kVersion);
  put<uint8_t>(idx, static_cast<uint8_t>(contents.dtype_code));
  put<uint64_t>(idx, docs.size());
  put<uint64_t>(idx, docs.size() + 1);
  for (const auto& doc : docs) put<int32_t>(idx, static_cast<int32_t>(doc.size()));
  for (int64_t p : pointers) put<int64_t>(idx, p);
  for (size_t d = 0; d <= docs.size(); ++d) put<int64_t>(idx, static_cast<int64_t>(d));
  write_file(prefix + ".bin", bin);
  write_file(prefix + ".idx", idx);
  std::error_code ignored;
  if (contents.loss_masks.empty()) std::filesystem::remove(prefix + ".mask", ignored);  // no stale mask
  else write_file(prefix + ".mask", mask);
}

}  // namespace moetrain
