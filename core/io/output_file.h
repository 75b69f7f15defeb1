// Writing files with POSIX calls so that they can be fsynced, and with errors (disk full,
// permission denied) that name the path. Used by the safetensors writer and checkpoints.
#pragma once

#include <cstddef>
#include <string>

namespace moetrain {

// A file opened for writing (created or truncated). Every failure throws Error(kBadConfig):
// an output path that cannot be written (permissions, a full disk), naming the path and the
// system's reason.
class OutputFile {
 public:
  explicit OutputFile(const std::string& path);
  ~OutputFile();  // closes without checking: call close() to see errors
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t bytes);
  void sync();   // fsync: the bytes are on disk when it returns
  void close();  // reports errors that only show at close (e.g. NFS quota)
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// rename(from, to), then fsync of the directory of `to` so that the rename itself survives a crash.
void rename_durably(const std::string& from, const std::string& to);

}  // namespace moetrain
