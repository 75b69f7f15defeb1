// The main of a fuzz harness in the ordinary build (MOETRAIN_FUZZ off, any compiler): runs every
// file of the directories (or files) named on the command line through LLVMFuzzerTestOneInput
// once, so that CTest replays the seed corpus and the regression inputs in seconds. A reader bug
// on one of them aborts the process (tests/fuzz/fuzz_support.h), which fails the test. The first
// argument, the corpus, must hold at least one file; later ones may be missing (no regressions).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR [MORE_DIRS_OR_FILES...]\n", argv[0]);
    return 2;
  }
  size_t replayed = 0;
  for (int a = 1; a < argc; ++a) {
    std::vector<fs::path> files;
    std::error_code ec;
    if (fs::is_directory(argv[a], ec)) {
      for (const auto& entry : fs::directory_iterator(argv[a])) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
      std::sort(files.begin(), files.end());
    } else if (fs::is_regular_file(argv[a], ec)) {
      files.push_back(argv[a]);
    }
    if (a == 1 && files.empty()) {
      std::fprintf(stderr, "%s: the corpus '%s' has no files\n", argv[0], argv[a]);
      return 1;
    }
    for (const fs::path& file : files) {
      std::ifstream in(file, std::ios::binary);
      std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::printf("replay %s (%zu bytes)\n", file.c_str(), bytes.size());
      std::fflush(stdout);  // so that a crash's output names the input
      LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
      ++replayed;
    }
  }
  std::printf("%zu inputs replayed, no reader bug\n", replayed);
  return 0;
}
