// Writes a dataset in the format IndexedDataset reads (one sequence per document, as Megatron's
// preprocess_data.py does without sentence splitting): tests build their datasets with it, and
// tools that produce token streams in C++ can too. scripts/prepare_data.py is the Python writer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain {

struct IndexedDatasetContents {
  std::vector<std::vector<int64_t>> documents;  // token ids
  std::vector<std::vector<uint8_t>> loss_masks; // empty: no .mask file; else one per document
  int dtype_code = 8;                           // 1 uint8, 4 int32, 5 int64, 8 uint16
};

// Writes <prefix>.bin, <prefix>.idx and (with loss_masks) <prefix>.mask. Throws Error(kBadData)
// when a file cannot be written or a token does not fit the dtype.
void write_indexed_dataset(const std::string& prefix, const IndexedDatasetContents& contents);

}  // namespace moetrain
