// Fuzzes IndexedDataset (core/data/indexed_dataset.h): the input holds a Megatron dataset's three
// files, [u16 LE: .idx length][u16 LE: .bin length][.idx][.bin][.mask: the rest, if any; no .mask
// file when nothing is left]. Lengths past the end are cut to what is there. Every document an
// accepted dataset has is then read (tokens and mask), as the sampler would.
#include "core/data/indexed_dataset.h"

#include <algorithm>
#include <vector>

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  size_t idx_len = std::min<size_t>(data[0] | (data[1] << 8), size - 4);
  size_t bin_len = std::min<size_t>(data[2] | (data[3] << 8), size - 4 - idx_len);
  const uint8_t* idx = data + 4;
  const uint8_t* bin = idx + idx_len;
  const uint8_t* mask = bin + bin_len;
  size_t mask_len = size - 4 - idx_len - bin_len;

  const std::filesystem::path prefix = fuzz::scratch_dir() / "data";
  fuzz::write_file(prefix.string() + ".idx", idx, idx_len);
  fuzz::write_file(prefix.string() + ".bin", bin, bin_len);
  std::error_code ec;
  if (mask_len) {
    fuzz::write_file(prefix.string() + ".mask", mask, mask_len);
  } else {
    std::filesystem::remove(prefix.string() + ".mask", ec);
  }
  fuzz::expect_only({ExitCode::kBadData}, [&] {
    IndexedDataset dataset(prefix.string());
    int64_t total = 0;
    for (int64_t doc = 0; doc < dataset.num_documents(); ++doc) total += dataset.document_length(doc);
    if (total != dataset.num_tokens()) std::abort();
    // Sequences may share .bin bytes, so the tokens are not bounded by the input size: read at
    // most a budget of them per input (a hang here would be the harness's, not the reader's).
    std::vector<int32_t> tokens;
    std::vector<uint8_t> loss_mask;
    int64_t budget = 1 << 16;
    for (int64_t doc = 0; doc < dataset.num_documents() && budget > 0; ++doc) {
      int64_t length = std::min(dataset.document_length(doc), budget);
      budget -= std::max<int64_t>(length, 1);
      tokens.resize(static_cast<size_t>(length));
      loss_mask.resize(static_cast<size_t>(length));
      fuzz::expect_only({ExitCode::kBadData}, [&] {
        dataset.read(tokens.data(), loss_mask.data(), doc, 0, length, 1000);
      });
      fuzz::expect_only({ExitCode::kBadData}, [&] {
        if (length > 1) dataset.read(tokens.data(), nullptr, doc, 1, length - 1, 0);
      });
    }
  });
  return 0;
}
