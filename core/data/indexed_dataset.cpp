#include "core/data/indexed_dataset.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <system_error>

#include "core/base/error.h"

namespace moetrain {
namespace {

template <class T>
T load(const uint8_t* base, uint64_t offset) {
  T value;
  std::memcpy(&value, base + offset, sizeof(T));  // the index's arrays are not aligned (header is 34 bytes)
  return value;
}

int bytes_of_dtype(int code) {
  switch (code) {
    case 1: return 1;  // uint8
    case 4: return 4;  // int32
    case 5: return 8;  // int64
    case 8: return 2;  // uint16
    default: return 0;
  }
}

[[noreturn]] void bad_data(const std::string& message) { throw Error(ExitCode::kBadData, message); }

// Maps `path` with data errors (exit 3) rather than the mapper's checkpoint errors.
MappedFile map_data_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    bad_data(fmt::format("{}: no such file ({}); data.source names a dataset by its path prefix: "
                         "`dir/name` for dir/name.bin and dir/name.idx (scripts/prepare_data.py writes them)",
                         path, what));
  }
  try {
    return MappedFile(path);
  } catch (const Error& e) {
    bad_data(e.what());
  }
}

}  // namespace

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  idx_ = map_data_file(idx_path(), "the dataset index");
  bin_ = map_data_file(bin_path(), "the dataset tokens");
  check_header();
  check_sequences();
  if (std::filesystem::exists(mask_path())) {
    mask_ = map_data_file(mask_path(), "the loss mask");
    has_mask_ = true;
    const uint64_t tokens_in_bin = bin_.size() / static_cast<uint64_t>(token_bytes_);
    if (mask_.size() != tokens_in_bin) {
      bad_data(fmt::format("{}: the loss mask has {} bytes but {} holds {} tokens (one mask byte per token): "
                           "{} at byte offset {}; rewrite both with scripts/prepare_data.py",
                           mask_path(), mask_.size(), bin_path(), tokens_in_bin,
                           mask_.size() < tokens_in_bin ? "it ends early" : "extra bytes start",
                           std::min<uint64_t>(mask_.size(), tokens_in_bin)));
    }
  }
  if (ImageIndex::present(prefix_)) images_ = std::make_unique<ImageIndex>(prefix_, num_documents(), document_lengths_);
}

void IndexedDataset::check_header() {
  const std::string& path = idx_.path();
  if (idx_.size() < kHeaderBytes) {
    bad_data(fmt::format("{}: truncated index: {} bytes, the header alone is {} (the file ends at byte offset {})",
                         path, idx_.size(), kHeaderBytes, idx_.size()));
  }
  const uint8_t* p = idx_.data();
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    bad_data(fmt::format("{}: bad magic at byte offset 0: not a Megatron indexed dataset index "
                         "(expected \"MMIDIDX\\0\\0\")", path));
  }
  const uint64_t version = load<uint64_t>(p, 9);
  if (version != kVersion) {
    bad_data(fmt::format("{}: index version {} at byte offset 9; only version {} is supported", path, version,
                         kVersion));
  }
  dtype_code_ = load<uint8_t>(p, 17);
  token_bytes_ = bytes_of_dtype(dtype_code_);
  if (token_bytes_ == 0) {
    bad_data(fmt::format("{}: token dtype code {} at byte offset 17 is not supported "
                         "(supported: 1 uint8, 4 int32, 5 int64, 8 uint16)", path, dtype_code_));
  }
  const uint64_t sequences = load<uint64_t>(p, 18);
  const uint64_t index_entries = load<uint64_t>(p, 26);
  // Bound the counts before multiplying, so a garbage count cannot overflow the size check.
  const uint64_t limit = idx_.size() / 8 + 1;
  const uint64_t expected = sequences < limit && index_entries < limit
                                ? kHeaderBytes + 12 * sequences + 8 * index_entries
                                : UINT64_MAX;
  if (idx_.size() < expected) {
    bad_data(fmt::format("{}: truncated index: {} sequences and {} document-index entries (at byte offsets 18 and "
                         "26) need {} bytes, the file ends at byte offset {}",
                         path, sequences, index_entries,
                         expected == UINT64_MAX ? std::string("more than") + " the file" : std::to_string(expected),
                         idx_.size()));
  }
  if (idx_.size() > expected) {
    bad_data(fmt::format("{}: {} unexpected bytes after the document index, from byte offset {} "
                         "(multimodal sequence modes are not supported)", path, idx_.size() - expected, expected));
  }
  num_sequences_ = static_cast<int64_t>(sequences);
  check_documents(static_cast<int64_t>(index_entries));
}

int64_t IndexedDataset::sequence_size(int64_t sequence) const {
  return load<int32_t>(idx_.data(), sizes_offset() + 4 * static_cast<uint64_t>(sequence));
}

int64_t IndexedDataset::sequence_pointer(int64_t sequence) const {
  return load<int64_t>(idx_.data(), pointers_offset() + 8 * static_cast<uint64_t>(sequence));
}

int64_t IndexedDataset::document_index(int64_t entry) const {
  return load<int64_t>(idx_.data(), documents_offset() + 8 * static_cast<uint64_t>(entry));
}

void IndexedDataset::check_sequences() {
  const std::string& path = idx_.path();
  if (bin_.size() % static_cast<uint64_t>(token_bytes_) != 0) {
    bad_data(fmt::format("{}: truncated tokens: {} bytes is not a whole number of {}-byte tokens "
                         "(the last token, at byte offset {}, is cut)",
                         bin_path(), bin_.size(), token_bytes_, bin_.size() - bin_.size() % token_bytes_));
  }
  const int64_t bin_size = static_cast<int64_t>(bin_.size());
  for (int64_t s = 0; s < num_sequences_; ++s) {
    const int64_t size = sequence_size(s);
    const int64_t pointer = sequence_pointer(s);
    if (size < 0) {
      bad_data(fmt::format("{}: sequence {} has negative size {} (byte offset {})", path, s, size,
                           sizes_offset() + 4 * s));
    }
    const uint64_t pointer_at = pointers_offset() + 8 * static_cast<uint64_t>(s);
    if (pointer < 0 || pointer % token_bytes_ != 0) {
      bad_data(fmt::format("{}: sequence {} starts at {}, not a token boundary of {} (byte offset {})", path, s,
                           pointer, bin_path(), pointer_at));
    }
    if (pointer > bin_size || size > (bin_size - pointer) / token_bytes_) {
      bad_data(fmt::format("{}: sequence {} ({} tokens from byte {}) points past the end of {} ({} bytes): the index "
                           "entry at byte offset {} is wrong or {} is truncated",
                           path, s, size, pointer, bin_path(), bin_size, pointer_at, bin_path()));
    }
  }
}

void IndexedDataset::check_documents(int64_t index_entries) {
  const std::string& path = idx_.path();
  if (index_entries < 1 || document_index(0) != 0) {
    bad_data(fmt::format("{}: the document index must start with 0 (byte offset {})", path, documents_offset()));
  }
  const int64_t documents = index_entries - 1;
  document_first_sequence_.resize(static_cast<size_t>(index_entries));
  document_lengths_.assign(static_cast<size_t>(documents), 0);
  for (int64_t d = 0; d < index_entries; ++d) {
    const int64_t first = document_index(d);
    const int64_t previous = d == 0 ? 0 : document_first_sequence_[static_cast<size_t>(d - 1)];
    if (first < previous || first > num_sequences_) {
      bad_data(fmt::format("{}: document index entry {} = {} at byte offset {} must be in [{}, {}] "
                           "(non-decreasing sequence numbers)", path, d, first, documents_offset() + 8 * d, previous,
                           num_sequences_));
    }
    document_first_sequence_[static_cast<size_t>(d)] = first;
  }
  if (document_first_sequence_.back() != num_sequences_) {
    bad_data(fmt::format("{}: the document index ends at sequence {} (byte offset {}), not at the sequence count {}",
                         path, document_first_sequence_.back(), documents_offset() + 8 * (index_entries - 1),
                         num_sequences_));
  }
  // Sizes are checked against .bin later; summing int32 sizes into int64 cannot overflow here.
  for (int64_t d = 0; d < documents; ++d) {
    int64_t length = 0;
    for (int64_t s = document_first_sequence_[d]; s < document_first_sequence_[d + 1]; ++s) {
      length += sequence_size(s);
    }
    document_lengths_[static_cast<size_t>(d)] = length;
    num_tokens_ += length;
  }
}

void IndexedDataset::read(int32_t* tokens, uint8_t* mask, int64_t doc, int64_t start, int64_t count,
                          int64_t vocab_size) const {
  MOETRAIN_ASSERT(doc >= 0 && doc < num_documents() && start >= 0 && count >= 0 &&
                      start + count <= document_length(doc),
                  fmt::format("read of tokens [{}, {}) of document {}", start, start + count, doc));
  int64_t skip = start;
  for (int64_t s = document_first_sequence_[doc]; count > 0; ++s) {
    const int64_t size = sequence_size(s);
    if (skip >= size) {
      skip -= size;
      continue;
    }
    const int64_t n = std::min(size - skip, count);
    const uint64_t first_byte = static_cast<uint64_t>(sequence_pointer(s) + skip * token_bytes_);
    const uint8_t* src = bin_.data() + first_byte;
    for (int64_t i = 0; i < n; ++i) {
      int64_t id;
      switch (dtype_code_) {
        case 1: id = src[i]; break;
        case 4: id = load<int32_t>(src, 4 * i); break;
        case 5: id = load<int64_t>(src, 8 * i); break;
        default: id = load<uint16_t>(src, 2 * i); break;
      }
      if (vocab_size > 0 && (id < 0 || id >= vocab_size)) {
        bad_data(fmt::format("{}: token id {} at byte offset {} (document {}) is outside the model's vocabulary "
                             "[0, {}): the data was tokenized with another tokenizer than the model's",
                             bin_path(), id, first_byte + i * token_bytes_, doc, vocab_size));
      }
      tokens[i] = static_cast<int32_t>(id);
    }
    if (mask != nullptr) {
      if (!has_mask_) {
        std::memset(mask, 1, static_cast<size_t>(n));
      } else {
        const uint64_t first_mask = first_byte / static_cast<uint64_t>(token_bytes_);
        for (int64_t i = 0; i < n; ++i) {
          const uint8_t value = mask_.data()[first_mask + i];
          if (value > 1) {
            bad_data(fmt::format("{}: loss-mask byte {} at byte offset {} must be 0 or 1", mask_path(), value,
                                 first_mask + i));
          }
          mask[i] = value;
        }
      }
    }
    tokens += n;
    if (mask != nullptr) mask += n;
    count -= n;
    skip = 0;
  }
}

int64_t IndexedDataset::check_contents(const std::vector<int64_t>& documents, int64_t vocab_size) const {
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<int32_t> tokens(static_cast<size_t>(kChunk));
  std::vector<uint8_t> mask(static_cast<size_t>(kChunk));
  int64_t targets = 0;
  auto check_document = [&](int64_t doc) {
    const int64_t length = document_length(doc);
    for (int64_t start = 0; start < length; start += kChunk) {
      const int64_t count = std::min(kChunk, length - start);
      read(tokens.data(), mask.data(), doc, start, count, vocab_size);
      for (int64_t i = 0; i < count; ++i) targets += mask[static_cast<size_t>(i)];
    }
  };
  if (documents.empty()) {
    for (int64_t doc = 0; doc < num_documents(); ++doc) check_document(doc);
  } else {
    for (int64_t doc : documents) check_document(doc);
  }
  return targets;
}

}  // namespace moetrain
