// Shared by the fuzz harnesses (tests/fuzz/fuzz_*.cpp; docs/RELIABILITY.md says how to run them).
//
// A reader of untrusted bytes may refuse its input only with moetrain::Error carrying the exit
// code its header documents. Anything else is a bug, and is turned into an abort here so that
// libFuzzer (and the replay main, through its exit status) reports it with the input: another
// exception type, an Error with an undocumented code, as well as the sanitizers' own reports.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <string>

#include "core/base/error.h"
#include "core/base/log.h"

namespace moetrain::fuzz {

// Runs `read`; returns normally when it succeeds or throws Error with one of `allowed`.
template <typename Read>
void expect_only(std::initializer_list<ExitCode> allowed, Read&& read) {
  try {
    read();
  } catch (const Error& e) {
    for (ExitCode code : allowed) {
      if (e.code() != code) continue;
      // To see why seeds are refused (a seed that is refused early covers little).
      if (std::getenv("MOETRAIN_FUZZ_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
      return;
    }
    std::fprintf(stderr, "fuzz: Error with undocumented exit code %d (%s): %s\n", static_cast<int>(e.code()),
                 exit_code_name(e.code()), e.what());
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: exception other than moetrain::Error: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz: non-std exception\n");
    std::abort();
  }
}

// A directory of this process's own (readers that take a path read files written into it),
// removed at exit. Created on first use; keeps the per-input cost at a write or two.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path base = std::filesystem::temp_directory_path() /
                                 ("moetrain-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(base);
    log::set_level(log::Level::kError);  // readers' warnings would drown libFuzzer's output
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                      ("moetrain-fuzz-" + std::to_string(::getpid())),
                                  ec);
    });
    return base;
  }();
  return dir;
}

// Writes bytes to `path` (truncating); a failure here is the harness's, not the reader's.
inline void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

}  // namespace moetrain::fuzz
