// A fresh directory under $TMPDIR for the files of one test case, removed when it goes out of
// scope: <tmp>/moetrain_<tag>_<pid>, so that tests running at once never share one.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace moetrain::testing {

struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("moetrain_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

}  // namespace moetrain::testing
