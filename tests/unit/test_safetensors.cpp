// safetensors reader and writer: round trips of every dtype, slices, conversions, alignment, every
// kind of bad file (each must be an Error with exit code 4 naming the file), a deterministic fuzz
// loop, and the interop fixtures shared with Python's safetensors (scripts/make_safetensors_fixture.py
// and scripts/check_safetensors_interop.py compute the same values by the same formula).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/bf16.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "scratch_dir.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

using testing::ScratchDir;

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void put_u64(std::vector<uint8_t>* bytes, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) (*bytes)[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// A hand-made file: the given header text (not validated here) and data bytes.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> bytes(8 + header.size() + data_bytes, 0x5a);
  put_u64(&bytes, 0, header.size());
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

struct OpenResult {
  bool threw = false;
  ExitCode code = ExitCode::kOk;
  std::string message;
};

OpenResult try_open(const std::string& path) {
  try {
    SafetensorsFile file(path);
    return {};
  } catch (const Error& e) {
    return {true, e.code(), e.what()};
  }
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Requires that opening `bytes` as a file fails with kBadCheckpoint and a message naming the file
// and each of `parts`.
void require_bad_file(const ScratchDir& dir, const std::vector<uint8_t>& bytes, const std::vector<std::string>& parts) {
  std::string path = dir.file("bad.safetensors");
  write_bytes(path, bytes);
  OpenResult r = try_open(path);
  INFO("message: " << r.message);
  REQUIRE(r.threw);
  CHECK(r.code == ExitCode::kBadCheckpoint);
  CHECK(contains(r.message, path));
  for (const std::string& part : parts) CHECK(contains(r.message, part));
}

// Element i of every fixture tensor, by dtype. The same formula is in
// scripts/make_safetensors_fixture.py (fixture_value); keep the two in step.
double fixture_value(DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
    case DType::kF64:
    case DType::kF16:
    case DType::kBF16: return static_cast<double>((7 * i) % 61 - 30) / 4.0;  // exact in every float type
    case DType::kI32: return static_cast<double>(100000 * i - 300000);
    case DType::kI64: return static_cast<double>(3000000000ll * i - 5);  // needs more than 32 bits
    case DType::kU8: return static_cast<double>((37 * i) % 256);
    case DType::kBool: return i % 3 == 0 ? 1.0 : 0.0;
  }
  return 0;
}

Tensor fixture_tensor(DType dtype, Shape shape) {
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double v = fixture_value(dtype, i);
    switch (dtype) {
      case DType::kF32: t.ptr<float>()[i] = static_cast<float>(v); break;
      case DType::kF64: t.ptr<double>()[i] = v; break;
      case DType::kF16: static_cast<uint16_t*>(t.data())[i] = float_to_f16(static_cast<float>(v)); break;
      case DType::kBF16: static_cast<uint16_t*>(t.data())[i] = float_to_bf16(static_cast<float>(v)); break;
      case DType::kI32: t.ptr<int32_t>()[i] = static_cast<int32_t>(v); break;
      case DType::kI64: t.ptr<int64_t>()[i] = static_cast<int64_t>(v); break;
      case DType::kU8: t.ptr<uint8_t>()[i] = static_cast<uint8_t>(v); break;
      case DType::kBool: static_cast<uint8_t*>(t.data())[i] = static_cast<uint8_t>(v); break;
    }
  }
  return t;
}

// Element i of a tensor of any dtype, as double (to compare against fixture_value).
double element(const TensorView& t, int64_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data) + static_cast<size_t>(i) * dtype_size(t.dtype);
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (t.dtype) {
    case DType::kF32: return load(float{});
    case DType::kF64: return load(double{});
    case DType::kF16: return f16_to_float(load(uint16_t{}));
    case DType::kBF16: return bf16_to_float(load(uint16_t{}));
    case DType::kI32: return load(int32_t{});
    case DType::kI64: return static_cast<double>(load(int64_t{}));
    case DType::kU8:
    case DType::kBool: return load(uint8_t{});
  }
  return 0;
}

struct FixtureEntry {
  const char* name;
  DType dtype;
  Shape shape;
};

// The tensors of the interop fixtures (the Python scripts list the same ones). The bf16 tensor is
// optional in python_written.safetensors: Python writes it only when torch is installed.
const std::vector<FixtureEntry>& fixture_entries() {
  static const std::vector<FixtureEntry> entries = {
      {"f32.matrix", DType::kF32, {3, 5}},   {"f64.vector", DType::kF64, {7}},   {"f16.cube", DType::kF16, {2, 3, 4}},
      {"bf16.matrix", DType::kBF16, {4, 6}}, {"i32.vector", DType::kI32, {10}},  {"i64.vector", DType::kI64, {4}},
      {"u8.matrix", DType::kU8, {3, 3}},     {"bool.vector", DType::kBool, {5}}, {"f32.scalar", DType::kF32, {}},
      {"f32.empty", DType::kF32, {0, 3}},
  };
  return entries;
}

constexpr const char* kFormulaNote = "values: scripts/make_safetensors_fixture.py fixture_value";

void check_fixture_values(const SafetensorsFile& file, bool bf16_required) {
  for (const FixtureEntry& entry : fixture_entries()) {
    INFO("tensor " << entry.name << " in " << file.path());
    if (entry.dtype == DType::kBF16 && !bf16_required && !file.has(entry.name)) {
      WARN("fixture has no " << entry.name << " (written without torch); bf16 interop is not checked");
      continue;
    }
    REQUIRE(file.has(entry.name));
    TensorView v = file.view(entry.name);
    CHECK(v.dtype == entry.dtype);
    REQUIRE(v.shape == entry.shape);
    for (int64_t i = 0; i < v.numel(); ++i) {
      INFO("element " << i);
      CHECK(element(v, i) == fixture_value(entry.dtype, i));
    }
  }
}

// A writer holding each tensor under its name; the tensors must outlive it (add keeps views).
SafetensorsWriter writer_of(const std::vector<std::pair<std::string, TensorView>>& tensors) {
  SafetensorsWriter writer;
  for (const auto& [name, tensor] : tensors) writer.add(name, tensor);
  return writer;
}

constexpr DType kAllDtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                                DType::kI32, DType::kI64, DType::kU8,   DType::kBool};

}  // namespace

TEST_CASE("every dtype round-trips, including 0-d and empty tensors", "[safetensors]") {
  ScratchDir dir("st_roundtrip");
  std::vector<Shape> shapes = {{}, {0}, {3, 0, 2}, {5}, {2, 3, 4}};
  std::vector<std::pair<std::string, Tensor>> written;
  SafetensorsWriter writer;
  for (DType dtype : kAllDtypes) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      std::string name = std::string("layer.") + dtype_name(dtype) + ".shape" + std::to_string(s);
      written.emplace_back(name, fixture_tensor(dtype, shapes[s]));
    }
  }
  for (const auto& [name, tensor] : written) writer.add(name, tensor);
  writer.set_metadata("format", "pt");
  writer.set_metadata("note", "ünïcode and \"quotes\"");
  std::string path = dir.file("all.safetensors");
  writer.write(path);

  SafetensorsFile file(path);
  REQUIRE(file.names().size() == written.size());
  CHECK(file.metadata().at("format") == "pt");
  CHECK(file.metadata().at("note") == "ünïcode and \"quotes\"");
  for (const auto& [name, tensor] : written) {
    INFO(name);
    REQUIRE(file.has(name));
    TensorView v = file.view(name);
    CHECK(v.dtype == tensor.dtype());
    CHECK(v.shape == tensor.shape());
    CHECK(v.device == Device::kCPU);
    REQUIRE(v.nbytes() == tensor.nbytes());
    CHECK(std::memcmp(v.data, tensor.data(), v.nbytes()) == 0);
    CHECK(file.info(name).nbytes == tensor.nbytes());
  }
  CHECK_FALSE(file.has("absent"));
  CHECK_THROWS_AS(file.view("absent"), Error);
}

TEST_CASE("the writer aligns the data start and every tensor, and pads the header with spaces", "[safetensors]") {
  ScratchDir dir("st_align");
  // Odd-sized narrow tensors named before wide ones would misalign the wide ones if laid out by name.
  Tensor a = fixture_tensor(DType::kU8, {3});
  Tensor b = fixture_tensor(DType::kBF16, {5});
  Tensor c = fixture_tensor(DType::kF64, {2});
  Tensor d = fixture_tensor(DType::kI32, {3});
  SafetensorsWriter writer = writer_of({{"a", a}, {"b", b}, {"c", c}, {"d", d}});
  for (int n = 0; n < 8; ++n) {  // metadata lengths 0..7 exercise every padding amount
    writer.set_metadata("k", std::string(static_cast<size_t>(n), 'x'));
    std::string path = dir.file("aligned.safetensors");
    writer.write(path);
    std::vector<uint8_t> bytes = read_bytes(path);
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[static_cast<size_t>(i)];
    CHECK((8 + header_bytes) % 8 == 0);
    std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(header_bytes));
    size_t close = header.rfind('}');
    CHECK(header.find_first_not_of(' ', close + 1) == std::string::npos);
    CHECK(header.size() - close - 1 < 8);

    SafetensorsFile file(path);
    CHECK(file.data_start() == 8 + header_bytes);
    for (const std::string& name : file.names()) {
      const SafetensorsTensorInfo& info = file.info(name);
      INFO(name);
      CHECK(info.file_offset % dtype_size(info.dtype) == 0);
    }
    // Wider elements first: c (F64), d (I32), b (BF16), a (U8), packed without gaps.
    CHECK(file.info("c").file_offset == file.data_start());
    CHECK(file.info("d").file_offset == file.data_start() + 16);
    CHECK(file.info("b").file_offset == file.data_start() + 28);
    CHECK(file.info("a").file_offset == file.data_start() + 38);
    CHECK(bytes.size() == file.data_start() + 41);
  }
}

TEST_CASE("write_atomic replaces the file and leaves no temporary behind", "[safetensors]") {
  ScratchDir dir("st_atomic");
  std::string path = dir.file("ckpt.safetensors");
  Tensor first = fixture_tensor(DType::kF32, {4});
  Tensor second = fixture_tensor(DType::kI64, {2});
  SafetensorsWriter w1;
  w1.add("x", first);
  w1.write_atomic(path);
  SafetensorsWriter w2;
  w2.add("y", second);
  w2.write_atomic(path);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  SafetensorsFile file(path);
  CHECK(file.names() == std::vector<std::string>{"y"});
  CHECK(element(file.view("y"), 1) == fixture_value(DType::kI64, 1));
}

TEST_CASE("writing into a missing directory is an Error naming the path (exit 2: an output the user chose)", "[safetensors]") {
  ScratchDir dir("st_write_error");
  Tensor t = fixture_tensor(DType::kF32, {2});
  SafetensorsWriter writer;
  writer.add("t", t);
  std::string path = dir.file("no/such/dir/out.safetensors");
  try {
    writer.write(path);
    FAIL("write into a missing directory succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    CHECK(contains(e.what(), path));
  }
  CHECK_THROWS_AS(writer.write_atomic(path), Error);
}

TEST_CASE("read_rows copies a slice along the first dimension", "[safetensors]") {
  ScratchDir dir("st_rows");
  Tensor m = fixture_tensor(DType::kF32, {6, 4});
  Tensor s = fixture_tensor(DType::kF32, {});
  SafetensorsWriter writer = writer_of({{"m", m}, {"s", s}});
  std::string path = dir.file("rows.safetensors");
  writer.write(path);
  SafetensorsFile file(path);

  std::vector<float> rows(3 * 4, -1.0f);
  file.read_rows(rows.data(), "m", 2, 5);
  for (int i = 0; i < 12; ++i) CHECK(rows[static_cast<size_t>(i)] == static_cast<float>(fixture_value(DType::kF32, 8 + i)));

  std::vector<float> untouched(4, -1.0f);
  file.read_rows(untouched.data(), "m", 3, 3);  // empty range: nothing written
  CHECK(untouched[0] == -1.0f);

  Tensor tail = file.read_rows_as("m", 5, 6, DType::kF64);
  CHECK(tail.shape() == Shape({1, 4}));
  CHECK(tail.ptr<double>()[3] == fixture_value(DType::kF32, 23));

  for (auto [begin, end] : {std::pair<int64_t, int64_t>{-1, 2}, {4, 3}, {0, 7}}) {
    try {
      file.read_rows(rows.data(), "m", begin, end);
      FAIL("bad row range accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ExitCode::kBadCheckpoint);
      CHECK(contains(e.what(), "'m'"));
    }
  }
  CHECK_THROWS_AS(file.read_rows(rows.data(), "s", 0, 1), Error);  // a 0-d tensor has no rows
}

TEST_CASE("read_as converts floating tensors and refuses integer conversions", "[safetensors]") {
  ScratchDir dir("st_read_as");
  Tensor bf = fixture_tensor(DType::kBF16, {9});
  Tensor half = fixture_tensor(DType::kF16, {9});
  Tensor f64 = fixture_tensor(DType::kF64, {3});
  f64.ptr<double>()[0] = 1.0 + std::ldexp(1.0, -40);  // not representable in f32
  Tensor f32 = Tensor::zeros({2}, DType::kF32);
  f32.ptr<float>()[0] = 1.0f + 3 * std::ldexp(1.0f, -8);  // a bf16 tie: rounds up to even (1 + 2^-6)
  f32.ptr<float>()[1] = -1.0f - std::ldexp(1.0f, -8);      // a bf16 tie: rounds down to even (-1)
  Tensor ints = fixture_tensor(DType::kI32, {4});
  SafetensorsWriter writer = writer_of({{"bf", bf}, {"half", half}, {"f64", f64}, {"f32", f32}, {"ints", ints}});
  std::string path = dir.file("convert.safetensors");
  writer.write(path);
  SafetensorsFile file(path);

  for (const char* name : {"bf", "half"}) {
    for (DType dst : {DType::kF32, DType::kF64}) {
      Tensor t = file.read_as(name, dst);
      CHECK(t.dtype() == dst);
      for (int64_t i = 0; i < 9; ++i) CHECK(element(t, i) == fixture_value(DType::kF32, i));
    }
  }
  Tensor narrowed = file.read_as("f64", DType::kF32);
  CHECK(narrowed.ptr<float>()[0] == 1.0f);
  CHECK(narrowed.ptr<float>()[1] == static_cast<float>(fixture_value(DType::kF64, 1)));
  Tensor widened = file.read_as("f32", DType::kF64);
  CHECK(widened.ptr<double>()[0] == 1.0 + 3 * std::ldexp(1.0, -8));
  Tensor to_bf16 = file.read_as("f32", DType::kBF16);
  CHECK(static_cast<uint16_t*>(to_bf16.data())[0] == 0x3f82);
  CHECK(static_cast<uint16_t*>(to_bf16.data())[1] == 0xbf80);

  Tensor same = file.read_as("ints", DType::kI32);
  CHECK(same.ptr<int32_t>()[3] == static_cast<int32_t>(fixture_value(DType::kI32, 3)));
  try {
    file.read_as("ints", DType::kF32);
    FAIL("I32 -> F32 accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadCheckpoint);
    CHECK(contains(e.what(), "'ints'"));
    CHECK(contains(e.what(), path));
  }
}

TEST_CASE("read_as handles tensors that another writer left unaligned", "[safetensors]") {
  ScratchDir dir("st_unaligned");
  // Header of 13 bytes: the data starts at byte 21, and the f32 tensor at 22 (no alignment at all).
  std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]},"p":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  std::vector<uint8_t> bytes = raw_file(header, 9);
  float values[2] = {1.5f, -2.25f};
  std::memcpy(bytes.data() + 8 + header.size() + 1, values, sizeof values);
  std::string path = dir.file("unaligned.safetensors");
  write_bytes(path, bytes);
  SafetensorsFile file(path);
  Tensor w = file.read_as("w", DType::kF64);
  CHECK(w.ptr<double>()[0] == 1.5);
  CHECK(w.ptr<double>()[1] == -2.25);
  Tensor same = file.read_as("w", DType::kF32);
  CHECK(same.ptr<float>()[1] == -2.25f);
}

TEST_CASE("bad files are Errors naming the file, the tensor and the offset", "[safetensors]") {
  ScratchDir dir("st_bad");
  auto good = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
  };

  SECTION("truncated at several cut points") {
    Tensor t = fixture_tensor(DType::kF32, {4, 4});
    SafetensorsWriter writer;
    writer.add("t", t);
    std::string path = dir.file("whole.safetensors");
    writer.write(path);
    std::vector<uint8_t> whole = read_bytes(path);
    size_t data_start = whole.size() - 64;
    for (size_t cut : {size_t{0}, size_t{3}, size_t{7}, size_t{8}, size_t{12}, data_start - 1, data_start,
                       data_start + 1, whole.size() - 1}) {
      INFO("cut at " << cut);
      require_bad_file(dir, std::vector<uint8_t>(whole.begin(), whole.begin() + static_cast<long>(cut)), {});
    }
  }
  SECTION("header length past the end of the file") {
    std::vector<uint8_t> bytes = raw_file(good("F32", "[1]", "[0,4]"), 4);
    put_u64(&bytes, 0, bytes.size());
    require_bad_file(dir, bytes, {"header length", "past the end"});
  }
  SECTION("header length huge") {
    std::vector<uint8_t> bytes = raw_file(good("F32", "[1]", "[0,4]"), 4);
    put_u64(&bytes, 0, ~uint64_t{0});
    require_bad_file(dir, bytes, {"header length", "limit"});
    put_u64(&bytes, 0, SafetensorsFile::kMaxHeaderBytes + 1);
    require_bad_file(dir, bytes, {"limit"});
  }
  SECTION("bad JSON") {
    require_bad_file(dir, raw_file(R"({"t": {"dtype": "F32", )", 0), {"not valid JSON", "byte offset"});
    require_bad_file(dir, raw_file("", 0), {"not valid JSON"});
    require_bad_file(dir, raw_file(std::string(1000, '['), 0), {"nested deeper"});
    std::string bad_utf8 = good("F32", "[1]", "[0,4]");
    bad_utf8[2] = static_cast<char>(0xff);
    require_bad_file(dir, raw_file(bad_utf8, 4), {"not valid JSON"});
  }
  SECTION("JSON that is not an object") {
    require_bad_file(dir, raw_file("[1, 2, 3]", 0), {"array", "expected an object"});
    require_bad_file(dir, raw_file(R"("text")", 0), {"string"});
    require_bad_file(dir, raw_file(R"({"t": 5})", 0), {"tensor 't'", "expected an object"});
  }
  SECTION("unknown and unsupported dtypes") {
    require_bad_file(dir, raw_file(good("F7", "[1]", "[0,4]"), 4), {"tensor 't'", "unknown dtype \"F7\""});
    require_bad_file(dir, raw_file(good("F8_E8M0", "[4]", "[0,4]"), 4), {"tensor 't'", "unsupported dtype \"F8_E8M0\""});
    require_bad_file(dir, raw_file(R"({"t":{"dtype":3,"shape":[1],"data_offsets":[0,4]}})", 4), {"tensor 't'", "dtype"});
  }
  SECTION("shape that does not match the byte count") {
    require_bad_file(dir, raw_file(good("F32", "[2,3]", "[0,20]"), 20), {"tensor 't'", "[2, 3]", "needs 24 bytes"});
    require_bad_file(dir, raw_file(good("BF16", "[]", "[0,4]"), 4), {"tensor 't'", "needs 2 bytes"});
  }
  SECTION("bad shape entries") {
    require_bad_file(dir, raw_file(good("F32", "[-1]", "[0,4]"), 4), {"tensor 't'", "non-negative"});
    require_bad_file(dir, raw_file(good("F32", "[1.5]", "[0,4]"), 4), {"tensor 't'", "non-negative"});
    require_bad_file(dir, raw_file(good("F32", "\"4\"", "[0,4]"), 4), {"tensor 't'", "shape"});
    require_bad_file(dir, raw_file(good("F32", "[1,1,1,1,1,1,1]", "[0,4]"), 4), {"tensor 't'", "7 dimensions"});
    require_bad_file(dir, raw_file(R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", 4), {"tensor 't'", "missing \"shape\""});
  }
  SECTION("overlapping offsets") {
    std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
    std::vector<uint8_t> bytes = raw_file(header, 12);
    require_bad_file(dir, bytes, {"'a'", "'b'", "overlap", "byte offset " + std::to_string(8 + header.size() + 4)});
    // An empty tensor inside another one's bytes counts too (Python's safetensors rejects it).
    std::string inside = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                         R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
    require_bad_file(dir, raw_file(inside, 12), {"'a'", "'e'", "overlap"});
  }
  SECTION("offsets outside the file, reversed or malformed") {
    require_bad_file(dir, raw_file(good("F32", "[2]", "[0,8]"), 4), {"tensor 't'", "past the end of the file"});
    require_bad_file(dir, raw_file(good("F32", "[1]", "[8,4]"), 8), {"tensor 't'", "end before they begin"});
    require_bad_file(dir, raw_file(good("F32", "[1]", "[0]"), 4), {"tensor 't'", "data_offsets"});
    require_bad_file(dir, raw_file(good("F32", "[1]", "[0,-4]"), 4), {"tensor 't'", "data_offsets"});
  }
  SECTION("offsets and shapes that overflow 64 bits") {
    require_bad_file(dir, raw_file(good("F32", "[1]", "[18446744073709551612,18446744073709551615]"), 4),
                     {"tensor 't'", "past"});
    require_bad_file(dir, raw_file(good("F32", "[1]", "[0,18446744073709551616]"), 4), {"tensor 't'", "data_offsets"});
    // 2^62 elements of 4 bytes: the byte count overflows though the element count does not.
    require_bad_file(dir, raw_file(good("F32", "[4611686018427387904]", "[0,0]"), 0), {"tensor 't'", "more than 2^64"});
    require_bad_file(dir, raw_file(good("F32", "[4294967296,4294967296,16]", "[0,0]"), 0), {"tensor 't'", "2^63"});
  }
  SECTION("metadata that is not a string map") {
    require_bad_file(dir, raw_file(R"({"__metadata__":{"step":3}})", 0), {"__metadata__", "step"});
    require_bad_file(dir, raw_file(R"({"__metadata__":[1]})", 0), {"__metadata__"});
  }
  SECTION("not a file") {
    OpenResult missing = try_open(dir.file("absent.safetensors"));
    CHECK(missing.threw);
    CHECK(missing.code == ExitCode::kBadCheckpoint);
    CHECK(contains(missing.message, "absent.safetensors"));
    OpenResult directory = try_open(dir.path.string());
    CHECK(directory.threw);
    CHECK(directory.code == ExitCode::kBadCheckpoint);
  }
}

TEST_CASE("fuzz: corrupted files load cleanly or throw Error, never crash", "[safetensors][fuzz]") {
  ScratchDir dir("st_fuzz");
  Tensor a = fixture_tensor(DType::kF32, {3, 4});
  Tensor b = fixture_tensor(DType::kBF16, {5});
  Tensor c = fixture_tensor(DType::kI64, {2});
  Tensor d = fixture_tensor(DType::kF16, {});
  SafetensorsWriter writer =
      writer_of({{"model.layers.0.weight", a}, {"model.layers.0.bias", b}, {"counts", c}, {"scale", d}});
  writer.set_metadata("format", "pt");
  std::string base_path = dir.file("base.safetensors");
  writer.write(base_path);
  const std::vector<uint8_t> base = read_bytes(base_path);
  const size_t header_end = base.size() - a.nbytes() - b.nbytes() - c.nbytes() - d.nbytes();
  const char kJsonBytes[] = "{}[]\",:0123456789-+.eE \\nulltrue\xff\x80";

  std::mt19937_64 rng(20240601);  // the engine's stream is fixed by the standard; distributions are not used
  auto below = [&rng](size_t n) { return static_cast<size_t>(rng() % n); };
  std::string path = dir.file("fuzz.safetensors");
  int loaded = 0;
  int rejected = 0;
  for (int round = 0; round < 3000; ++round) {
    std::vector<uint8_t> bytes = base;
    switch (round % 5) {
      case 0:  // flip bits, mostly in the header
        for (size_t k = 1 + below(3); k > 0; --k) bytes[below(header_end + 8)] ^= static_cast<uint8_t>(1u << below(8));
        break;
      case 1:  // a JSON-significant byte somewhere in the header
        bytes[8 + below(header_end - 8)] = static_cast<uint8_t>(kJsonBytes[below(sizeof kJsonBytes - 1)]);
        break;
      case 2:  // truncate
        bytes.resize(below(bytes.size()));
        break;
      case 3:  // a header length near the real one, or anything at all
        put_u64(&bytes, 0, below(2) ? header_end - 8 + below(33) - 16 : rng());
        break;
      case 4: {  // insert or delete a header byte (the length prefix stays)
        size_t at = 8 + below(header_end - 8);
        if (below(2)) {
          bytes.insert(bytes.begin() + static_cast<long>(at), static_cast<uint8_t>(kJsonBytes[below(sizeof kJsonBytes - 1)]));
        } else {
          bytes.erase(bytes.begin() + static_cast<long>(at));
        }
        break;
      }
    }
    write_bytes(path, bytes);
    try {
      SafetensorsFile file(path);
      for (const std::string& name : file.names()) {
        const SafetensorsTensorInfo& info = file.info(name);
        Tensor copy = file.read_as(name, is_floating(info.dtype) ? DType::kF64 : info.dtype);
        if (info.shape.ndim() > 0) {
          std::vector<uint8_t> rows(info.nbytes);
          file.read_rows(rows.data(), name, 0, info.shape[0]);
        }
      }
      ++loaded;
    } catch (const Error& e) {
      if (e.code() != ExitCode::kBadCheckpoint || !contains(e.what(), path)) {
        FAIL("round " << round << ": unexpected error: " << e.what());
      }
      ++rejected;
    }
  }
  INFO("loaded " << loaded << ", rejected " << rejected);
  // Both outcomes must occur, or the mutations are not testing anything.
  CHECK(loaded > 100);
  CHECK(rejected > 1000);
}

TEST_CASE("interop: a file for Python's safetensors to check", "[safetensors][interop]") {
  // scripts/check_safetensors_interop.py reads this file with Python's safetensors.
  const char* env = std::getenv("MOETRAIN_INTEROP_OUT");
  std::string path = env && *env ? env : (fs::temp_directory_path() / "moetrain_written.safetensors").string();
  std::vector<Tensor> tensors;
  SafetensorsWriter writer;
  for (const FixtureEntry& entry : fixture_entries()) tensors.push_back(fixture_tensor(entry.dtype, entry.shape));
  for (size_t i = 0; i < tensors.size(); ++i) writer.add(fixture_entries()[i].name, tensors[i]);
  writer.set_metadata("producer", "moetrain");
  writer.set_metadata("formula", kFormulaNote);
  writer.write(path);
  std::cerr << "interop: wrote " << path << " (check it with scripts/check_safetensors_interop.py " << path << ")\n";
  SafetensorsFile file(path);
  check_fixture_values(file, /*bf16_required=*/true);
}

TEST_CASE("interop: a file written by Python's safetensors loads with the right values", "[safetensors][interop]") {
  std::string path = std::string(MOETRAIN_FIXTURE_DIR) + "/safetensors/python_written.safetensors";
  if (!fs::exists(path)) {
    WARN("fixture missing: run scripts/make_safetensors_fixture.py on a machine with safetensors (" << path << ")");
    std::cerr << "SKIPPED: fixture missing: run scripts/make_safetensors_fixture.py on a machine with safetensors\n";
    return;
  }
  SafetensorsFile file(path);
  CHECK(file.metadata().count("producer") == 1);
  CHECK(file.metadata().at("formula") == kFormulaNote);
  check_fixture_values(file, /*bf16_required=*/false);
}
