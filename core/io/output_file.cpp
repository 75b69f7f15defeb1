#include "core/io/output_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "core/base/error.h"

namespace moetrain {

namespace {

// Exit code 2: the output location (a checkpoint directory, an export's --out) is the user's
// choice, and a path that cannot be written, or a full disk, is not a bad checkpoint (4).
[[noreturn]] void fail(const std::string& what, const std::string& path, int error_number) {
  throw Error(ExitCode::kBadConfig, "cannot " + what + " '" + path + "': " + std::strerror(error_number) +
                                            " (check free disk space and permissions)");
}

std::string parent_directory(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

OutputFile::OutputFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("create", path, errno);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, size_t bytes) {
  MOETRAIN_ASSERT(fd_ >= 0, "write to closed file " + path_);
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; loop over partial writes and interruptions.
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", path_, errno);
    }
    if (n == 0) fail("write", path_, ENOSPC);
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void OutputFile::sync() {
  MOETRAIN_ASSERT(fd_ >= 0, "sync of closed file " + path_);
  if (::fsync(fd_) != 0) fail("fsync", path_, errno);
}

void OutputFile::close() {
  if (fd_ < 0) return;
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail("close", path_, errno);
}

void rename_durably(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) fail("rename '" + from + "' to", to, errno);
  std::string dir = parent_directory(to);
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", dir, errno);
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  // Some file systems (e.g. certain FUSE mounts) refuse fsync on directories; the data is safe.
  if (rc != 0 && e != EINVAL && e != EROFS) fail("fsync directory", dir, e);
}

}  // namespace moetrain
