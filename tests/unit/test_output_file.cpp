// OutputFile: an output that cannot be written (a full disk, a path under a regular file) is
// exit code 2, an output path the user gave, never "bad checkpoint" (4); the message names the
// path and the system's reason (issue 28, item 11).
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/io/output_file.h"

using namespace moetrain;

namespace {

Error error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e;
  }
  FAIL("expected moetrain::Error, nothing was thrown");
  return Error(ExitCode::kOk, "");
}

}  // namespace

TEST_CASE("output file: a full disk is exit 2 naming the path and ENOSPC", "[io]") {
  if (!std::filesystem::exists("/dev/full")) return;  // Linux's always-full device
  const Error e = error_of([] {
    OutputFile out("/dev/full");
    const std::string bytes(4096, 'x');
    out.write(bytes.data(), bytes.size());
    out.sync();
    out.close();
  });
  INFO(e.what());
  CHECK(e.code() == ExitCode::kBadConfig);
  CHECK(std::string(e.what()).find("'/dev/full': No space left on device") != std::string::npos);
}

TEST_CASE("output file: a path that cannot be created is exit 2 naming it", "[io]") {
  namespace fs = std::filesystem;
  const fs::path file = fs::temp_directory_path() / "moetrain_test_output_file_regular";
  std::ofstream(file.string()) << "a regular file";
  const std::string under = (file / "out.safetensors").string();  // a directory path through a file
  const Error e = error_of([&] { OutputFile out(under); });
  INFO(e.what());
  CHECK(e.code() == ExitCode::kBadConfig);
  CHECK(std::string(e.what()).find("cannot create '" + under + "': Not a directory") != std::string::npos);
  fs::remove(file);
}
