// Shared helpers of the test_data_* tests: scratch directories and small datasets on disk.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/data/indexed_dataset_writer.h"
#include "scratch_dir.h"

namespace moetrain::testing {

// <tmp>/moetrain_data_<tag>_<pid>, removed at the end of the test case.
struct DataScratchDir : ScratchDir {
  explicit DataScratchDir(const std::string& tag) : ScratchDir("data_" + tag) {}
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Documents whose tokens are all distinct: token k of the whole dataset (in file order) is
// first_id + k, so any token seen in a batch says exactly where it came from.
inline IndexedDatasetContents numbered_documents(const std::vector<int64_t>& lengths, int64_t first_id = 1) {
  IndexedDatasetContents contents;
  contents.dtype_code = 4;
  int64_t next = first_id;
  for (int64_t length : lengths) {
    std::vector<int64_t> doc;
    for (int64_t i = 0; i < length; ++i) doc.push_back(next++);
    contents.documents.push_back(doc);
  }
  return contents;
}

}  // namespace moetrain::testing
