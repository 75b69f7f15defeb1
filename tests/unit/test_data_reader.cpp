// The indexed-dataset reader: the fixture written by scripts/prepare_data.py read back against
// an independent decoding of its JSONL input, the C++ writer round trip, and every kind of bad
// file caught at open (or at read, for token ids and mask bytes) with exit code 3, the file and
// the byte offset.
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>

#include "catch.h"
#include "core/base/error.h"
#include "core/data/indexed_dataset.h"
#include "test_data_support.h"

namespace moetrain {
namespace {

using testing::DataScratchDir;
using testing::read_bytes;
using testing::write_bytes;

// The `bytes` tokenizer and the simple chat template as docs/DATA.md and prepare_data.py's help
// define them, written again here from the definition.
struct ExpectedDocument {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

void append_text(ExpectedDocument& doc, const std::string& text, uint8_t mask) {
  for (unsigned char byte : text) {
    doc.tokens.push_back(static_cast<int32_t>(byte) + 2);
    doc.mask.push_back(mask);
  }
}

std::vector<ExpectedDocument> expected_fixture_documents() {
  std::ifstream in(std::string(MOETRAIN_FIXTURE_DIR) + "/data/input.jsonl");
  std::vector<ExpectedDocument> docs;
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json record = nlohmann::json::parse(line);
    ExpectedDocument doc;
    bool last_is_target = true;
    if (record.contains("text")) {
      append_text(doc, record["text"].get<std::string>(), 1);
    } else {
      for (const auto& message : record["messages"]) {
        const std::string role = message["role"].get<std::string>();
        append_text(doc, "<|" + role + "|>\n", 0);
        append_text(doc, message["content"].get<std::string>() + "\n", role == "assistant" ? 1 : 0);
        last_is_target = role == "assistant";
      }
    }
    doc.tokens.push_back(1);  // end of document
    doc.mask.push_back(last_is_target ? 1 : 0);
    docs.push_back(doc);
  }
  return docs;
}

TEST_CASE("the prepare_data.py fixture reads back as its JSONL input says") {
  IndexedDataset dataset(std::string(MOETRAIN_FIXTURE_DIR) + "/data/tiny");
  std::vector<ExpectedDocument> expected = expected_fixture_documents();
  REQUIRE(expected.size() == 10);
  REQUIRE(dataset.num_documents() == 10);
  REQUIRE(dataset.num_sequences() == 10);
  REQUIRE(dataset.dtype_code() == 8);
  REQUIRE(dataset.has_loss_mask());
  int64_t total = 0;
  for (size_t d = 0; d < expected.size(); ++d) {
    const int64_t n = static_cast<int64_t>(expected[d].tokens.size());
    REQUIRE(dataset.document_length(static_cast<int64_t>(d)) == n);
    std::vector<int32_t> tokens(n);
    std::vector<uint8_t> mask(n);
    dataset.read(tokens.data(), mask.data(), static_cast<int64_t>(d), 0, n, 258);
    CHECK(tokens == expected[d].tokens);
    CHECK(mask == expected[d].mask);
    total += n;
  }
  CHECK(dataset.num_tokens() == total);
  // A read from the middle of a document.
  std::vector<int32_t> middle(5);
  dataset.read(middle.data(), nullptr, 1, 3, 5, 258);
  CHECK(middle == std::vector<int32_t>(expected[1].tokens.begin() + 3, expected[1].tokens.begin() + 8));
  // The chat's user turn is context, the assistant's answer a target.
  CHECK(expected[2].mask.front() == 0);
  CHECK(expected[2].mask.back() == 1);
}

TEST_CASE("the C++ writer round-trips every token dtype, with and without a mask") {
  DataScratchDir dir("writer");
  for (int code : {1, 4, 5, 8}) {
    IndexedDatasetContents contents;
    contents.dtype_code = code;
    contents.documents = {{3, 1, 4, 1, 5}, {}, {9, 2, 6}, {200}};
    const bool with_mask = code != 4;
    if (with_mask) contents.loss_masks = {{0, 1, 1, 0, 1}, {}, {1, 1, 1}, {0}};
    const std::string prefix = dir.file("d" + std::to_string(code));
    write_indexed_dataset(prefix, contents);
    IndexedDataset dataset(prefix);
    REQUIRE(dataset.num_documents() == 4);
    CHECK(dataset.num_tokens() == 9);
    CHECK(dataset.has_loss_mask() == with_mask);
    CHECK(dataset.document_length(1) == 0);
    for (int64_t d = 0; d < 4; ++d) {
      const size_t n = contents.documents[d].size();
      std::vector<int32_t> tokens(n);
      std::vector<uint8_t> mask(n);
      dataset.read(tokens.data(), mask.data(), d, 0, static_cast<int64_t>(n), 256);
      for (size_t i = 0; i < n; ++i) {
        CHECK(tokens[i] == contents.documents[d][i]);
        CHECK(mask[i] == (with_mask ? contents.loss_masks[d][i] : 1));
      }
    }
  }
}

// A document made of several sequences (Megatron's sentence-split layout), written by hand.
TEST_CASE("a document of several sequences reads as their concatenation") {
  DataScratchDir dir("multiseq");
  const std::string prefix = dir.file("m");
  std::string bin;
  const uint16_t tokens[] = {10, 11, 12, 20, 21, 30};
  bin.append(reinterpret_cast<const char*>(tokens), sizeof(tokens));
  std::string idx(IndexedDataset::kMagic, 9);
  auto put64 = [&idx](uint64_t v) { idx.append(reinterpret_cast<const char*>(&v), 8); };
  auto put32 = [&idx](int32_t v) { idx.append(reinterpret_cast<const char*>(&v), 4); };
  put64(1);
  idx.push_back(8);
  put64(3);  // sequences: [10 11 12] [20 21] [30]
  put64(3);  // documents: {seq 0, seq 1}, {seq 2}
  put32(3), put32(2), put32(1);
  put64(0), put64(6), put64(10);
  put64(0), put64(2), put64(3);
  write_bytes(prefix + ".bin", bin);
  write_bytes(prefix + ".idx", idx);
  IndexedDataset dataset(prefix);
  REQUIRE(dataset.num_documents() == 2);
  CHECK(dataset.document_length(0) == 5);
  CHECK(dataset.document_length(1) == 1);
  std::vector<int32_t> out(3);
  dataset.read(out.data(), nullptr, 0, 2, 3, 100);
  CHECK(out == std::vector<int32_t>{12, 20, 21});
}

// Runs `action` and checks it throws Error(kBadData) whose message holds every one of `parts`.
template <class F>
void check_bad_data(F action, const std::vector<std::string>& parts) {
  try {
    action();
    FAIL("no error was raised");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadData);
    const std::string message = e.what();
    for (const std::string& part : parts) {
      INFO(message);
      CHECK(message.find(part) != std::string::npos);
    }
  }
}

TEST_CASE("bad datasets are exit code 3 naming the file and the byte offset") {
  DataScratchDir dir("bad");
  IndexedDatasetContents contents;
  contents.dtype_code = 8;
  contents.documents = {{5, 6, 7}, {8, 9}};
  contents.loss_masks = {{1, 1, 0}, {1, 1}};
  const std::string prefix = dir.file("good");
  write_indexed_dataset(prefix, contents);
  const std::string idx = read_bytes(prefix + ".idx");
  const std::string bin = read_bytes(prefix + ".bin");
  const std::string mask = read_bytes(prefix + ".mask");
  REQUIRE(idx.size() == IndexedDataset::kHeaderBytes + 2 * 12 + 3 * 8);
  // Each case: a fresh copy with one file damaged.
  int case_number = 0;
  auto damaged = [&](const std::string& which, const std::string& bytes) {
    const std::string p = dir.file("case" + std::to_string(case_number++));
    write_bytes(p + ".idx", idx);
    write_bytes(p + ".bin", bin);
    write_bytes(p + ".mask", mask);
    write_bytes(p + which, bytes);
    return p;
  };

  SECTION("bad magic") {
    std::string bytes = idx;
    bytes[0] = 'X';
    const std::string p = damaged(".idx", bytes);
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "bad magic", "byte offset 0"});
  }
  SECTION("unsupported version and dtype") {
    std::string bytes = idx;
    bytes[9] = 2;
    std::string p = damaged(".idx", bytes);
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "version 2", "byte offset 9"});
    bytes = idx;
    bytes[17] = 7;  // float32 tokens
    p = damaged(".idx", bytes);
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "dtype code 7", "byte offset 17"});
  }
  SECTION("truncated .idx: inside the header and inside the arrays") {
    std::string p = damaged(".idx", idx.substr(0, 20));
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "truncated", "byte offset 20"});
    p = damaged(".idx", idx.substr(0, idx.size() - 3));
    check_bad_data([&] { IndexedDataset d(p); },
                   {p + ".idx", "truncated", "byte offset " + std::to_string(idx.size() - 3)});
  }
  SECTION("truncated .bin: a cut token, and a whole token missing") {
    std::string p = damaged(".bin", bin.substr(0, bin.size() - 1));
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".bin", "truncated", "byte offset 8"});
    p = damaged(".bin", bin.substr(0, bin.size() - 2));
    // Sequence 1 (2 tokens from byte 6) now ends past the 8-byte file; its pointer entry is at
    // 34 + 4 * 2 + 8 * 1 = 50.
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "points past the end", "byte offset 50"});
  }
  SECTION("an index pointing past the file") {
    std::string bytes = idx;
    const int64_t far = 1000;
    std::memcpy(&bytes[IndexedDataset::kHeaderBytes + 2 * 4], &far, 8);  // sequence 0's pointer
    const std::string p = damaged(".idx", bytes);
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "points past the end", "byte offset 42"});
  }
  SECTION("a document index out of order") {
    std::string bytes = idx;
    const int64_t bad = 5;
    std::memcpy(&bytes[IndexedDataset::kHeaderBytes + 2 * 12 + 8], &bad, 8);
    const std::string p = damaged(".idx", bytes);
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".idx", "document index entry 1", "byte offset 66"});
  }
  SECTION("a mask file of the wrong length") {
    std::string p = damaged(".mask", mask.substr(0, 4));
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".mask", "4 bytes", "5 tokens", "byte offset 4"});
    p = damaged(".mask", mask + "\x01");
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".mask", "6 bytes", "byte offset 5"});
  }
  SECTION("a mask byte that is not 0 or 1, found when read") {
    std::string bytes = mask;
    bytes[3] = 7;
    const std::string p = damaged(".mask", bytes);
    IndexedDataset d(p);
    std::vector<int32_t> tokens(2);
    std::vector<uint8_t> m(2);
    check_bad_data([&] { d.read(tokens.data(), m.data(), 1, 0, 2, 100); }, {p + ".mask", "byte offset 3"});
  }
  SECTION("a token id >= vocab, found when read") {
    const std::string p = damaged(".idx", idx);
    IndexedDataset d(p);
    std::vector<int32_t> tokens(3);
    // Token 9 is document 1's second token: byte 8 of .bin.
    check_bad_data([&] { d.read(tokens.data(), nullptr, 1, 0, 2, 9); }, {p + ".bin", "token id 9", "byte offset 8"});
    d.read(tokens.data(), nullptr, 1, 0, 2, 10);  // within a vocabulary of 10 it is fine
    CHECK(tokens[1] == 9);
  }
  SECTION("missing files") {
    check_bad_data([&] { IndexedDataset d(dir.file("absent")); }, {dir.file("absent") + ".idx", "no such file"});
    const std::string p = damaged(".idx", idx);
    std::filesystem::remove(p + ".bin");
    check_bad_data([&] { IndexedDataset d(p); }, {p + ".bin", "no such file"});
  }
}

}  // namespace
}  // namespace moetrain
