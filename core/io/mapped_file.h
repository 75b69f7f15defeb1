// A read-only memory mapping of a whole file (POSIX mmap), closed and unmapped by its destructor.
// Model files are mapped rather than read so that a rank touches only the pages of the slices it
// owns: a 5.6 TB model never passes through one host's memory.
//
// Caveat of every mmap reader: if another process truncates the file while it is mapped, reading
// the vanished pages raises SIGBUS. Checkpoints are written to a temporary name and renamed, so
// our own writers never do this to a reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moetrain {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws Error(kBadCheckpoint) naming the path when the file cannot be opened or mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void unmap();

  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace moetrain
