// A tokenized dataset in the Megatron indexed format, memory-mapped (nothing is loaded whole).
//
//   <prefix>.idx   the index, little-endian:
//                    9 bytes  magic "MMIDIDX\0\0"
//                    uint64   version (1)
//                    uint8    token dtype code: 1 uint8, 4 int32, 5 int64, 8 uint16
//                    uint64   S, the number of sequences
//                    uint64   D, the length of the document index (documents + 1)
//                    int32[S] sequence sizes in tokens
//                    int64[S] sequence byte offsets into <prefix>.bin
//                    int64[D] document index: document d is sequences [doc[d], doc[d+1]),
//                             doc[0] = 0, non-decreasing, doc[D-1] = S
//   <prefix>.bin   the tokens, in that dtype
//   <prefix>.mask  optional (ours, not Megatron's): one byte per token of <prefix>.bin, aligned
//                  with it (token at .bin byte offset p has its mask at p / token_bytes), 1 = the
//                  token is a training target, 0 = it is context only (a prompt, a user turn).
//                  Without the file every token is a target.
//   <prefix>.images, <prefix>.patches  optional (ours): the documents' images (image_index.h).
//
// Every header field, size and offset is checked when the dataset is opened (a truncated file,
// a sequence pointing past the end of .bin, a mask of the wrong length): each problem is
// Error(kBadData) naming the file and the byte offset. Token ids and mask values are checked as
// they are read (read() is what builds every batch), so a bad token never reaches a kernel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/data/image_index.h"
#include "core/io/mapped_file.h"

namespace moetrain {

class IndexedDataset {
 public:
  static constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
  static constexpr uint64_t kVersion = 1;
  static constexpr uint64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

  // Opens <prefix>.idx, <prefix>.bin and, when it exists, <prefix>.mask. Throws Error(kBadData).
  explicit IndexedDataset(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string mask_path() const { return prefix_ + ".mask"; }

  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return static_cast<int64_t>(document_lengths_.size()); }
  // Tokens of document `doc` (the sum of its sequences' sizes).
  int64_t document_length(int64_t doc) const { return document_lengths_[static_cast<size_t>(doc)]; }
  const std::vector<int64_t>& document_lengths() const { return document_lengths_; }
  int64_t num_tokens() const { return num_tokens_; }  // over all documents
  int token_bytes() const { return token_bytes_; }
  int dtype_code() const { return dtype_code_; }
  bool has_loss_mask() const { return has_mask_; }
  // The images beside the tokens (<prefix>.images and .patches, image_index.h), or null.
  const ImageIndex* images() const { return images_.get(); }

  // Tokens [start, start + count) of document `doc` (its sequences concatenated) into `tokens`
  // and, when `mask` is not null, their loss-mask bytes (all 1 without a mask file).
  // A token outside [0, vocab_size) or a mask byte other than 0/1 is Error(kBadData) naming the
  // file and byte offset. vocab_size <= 0 skips the token check (data-stats).
  void read(int32_t* tokens, uint8_t* mask, int64_t doc, int64_t start, int64_t count, int64_t vocab_size) const;

  // Reads `documents` (every document when empty) once, checking every token id against
  // vocab_size and every mask byte as read() does (the same errors), and returns how many of
  // their tokens are training targets. A run checks its data this way at start, when it is
  // small enough (kContentCheckBytes), rather than hours in, when the bad window is drawn.
  int64_t check_contents(const std::vector<int64_t>& documents, int64_t vocab_size) const;
  // Datasets up to this many bytes of tokens are checked whole at start.
  static constexpr uint64_t kContentCheckBytes = uint64_t{4} << 30;
  uint64_t token_file_bytes() const { return static_cast<uint64_t>(num_tokens_) * static_cast<uint64_t>(token_bytes_); }

 private:
  int64_t sequence_size(int64_t sequence) const;
  int64_t sequence_pointer(int64_t sequence) const;
  int64_t document_index(int64_t entry) const;
  uint64_t sizes_offset() const { return kHeaderBytes; }
  uint64_t pointers_offset() const { return kHeaderBytes + 4 * static_cast<uint64_t>(num_sequences_); }
  uint64_t documents_offset() const { return kHeaderBytes + 12 * static_cast<uint64_t>(num_sequences_); }
  void check_header();
  void check_sequences();
  void check_documents(int64_t index_entries);

  std::string prefix_;
  MappedFile idx_;
  MappedFile bin_;
  MappedFile mask_;
  bool has_mask_ = false;
  int dtype_code_ = 0;
  int token_bytes_ = 0;
  int64_t num_sequences_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> document_lengths_;
  std::vector<int64_t> document_first_sequence_;  // [documents + 1]
  std::unique_ptr<ImageIndex> images_;
};

}  // namespace moetrain
