#include "core/io/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/base/host_convert.h"

namespace moetrain {

namespace {

using Json = nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";
// Nesting deeper than the format's own (object -> entry -> array) means garbage; stop early.
constexpr int kMaxJsonDepth = 8;

// dtypes that safetensors defines but moetrain does not read: a clearer message than "unknown".
constexpr const char* kUnsupportedDtypes[] = {"F8_E8M0", "F6_E2M3", "F6_E3M2", "F4",
                                              "I8", "I16", "U16", "U32", "U64", "C64"};

struct JsonTooDeep {};

constexpr const char* kCorruptHint = "the file is corrupt, truncated or not safetensors; re-download or re-export it";

[[noreturn]] void fail(const std::string& path, const std::string& what, const char* hint = kCorruptHint) {
  throw Error(ExitCode::kBadCheckpoint, "bad safetensors file '" + path + "': " + what + " (" + hint + ")");
}

uint64_t read_le_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// read_as converts among floating types only; integer tensors are read as they are stored.
bool can_convert(DType dst_dtype, DType src_dtype) {
  return dst_dtype == src_dtype || (is_floating(dst_dtype) && is_floating(src_dtype));
}

// FP8 codes (U8 storage) decoded into a new tensor of a floating dst_dtype; exact in F32 and F64.
Tensor decode_fp8(const TensorView& codes, Fp8Format format, DType dst_dtype) {
  Tensor values(codes.shape, DType::kF64);
  const auto* code = static_cast<const uint8_t*>(codes.data);
  double* v = values.ptr<double>();
  for (int64_t i = 0, n = codes.numel(); i < n; ++i) v[i] = fp8_to_float(format, code[i]);
  if (dst_dtype == DType::kF64) return values;
  Tensor out(codes.shape, dst_dtype);
  convert_host(out.view(), values.view());
  return out;
}

// Converts src (which may point anywhere in the mapping) into a new tensor of dst_dtype.
Tensor convert_copy(const TensorView& src, Fp8Format fp8, DType dst_dtype) {
  if (fp8 != Fp8Format::kNone) return decode_fp8(src, fp8, dst_dtype);
  Tensor out(src.shape, dst_dtype);
  if (reinterpret_cast<uintptr_t>(src.data) % dtype_size(src.dtype) == 0) {
    convert_host(out.view(), src);
    return out;
  }
  // A writer that did not align its tensors: stage the bytes so typed loads stay aligned.
  Tensor staged(src.shape, src.dtype);
  std::memcpy(staged.data(), src.data, src.nbytes());
  convert_host(out.view(), staged.view());
  return out;
}

bool is_unsigned_integer(const Json& j) { return j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0); }

// a * b, or false when it does not fit in uint64_t.
bool checked_multiply(uint64_t a, uint64_t b, uint64_t* product) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  *product = a * b;
  return true;
}

struct ParsedEntry {
  std::string name;
  SafetensorsTensorInfo info;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& path, uint64_t data_start, uint64_t data_size)
      : path_(path), data_start_(data_start), data_size_(data_size) {}

  ParsedEntry parse_entry(const std::string& name, const Json& entry) const {
    std::string where = "tensor '" + name + "': ";
    if (!entry.is_object()) fail(path_, where + "header entry is " + std::string(entry.type_name()) + ", expected an object");
    ParsedEntry parsed;
    parsed.name = name;
    parsed.info.dtype = parse_entry_dtype(where, entry, &parsed.info.fp8);
    uint64_t numel = parse_shape(where, entry, &parsed.info.shape);
    parse_offsets(where, entry, &parsed.begin, &parsed.end);
    uint64_t expected_bytes = 0;
    bool fits = checked_multiply(numel, dtype_size(parsed.info.dtype), &expected_bytes);
    if (!fits || expected_bytes != parsed.end - parsed.begin) {
      fail(path_, where + "shape " + parsed.info.shape.str() + " of " + dtype_name(parsed.info.dtype) + " needs " +
                      (fits ? std::to_string(expected_bytes) : std::string("more than 2^64")) + " bytes but data_offsets [" +
                      std::to_string(parsed.begin) + ", " + std::to_string(parsed.end) + "] hold " +
                      std::to_string(parsed.end - parsed.begin));
    }
    parsed.info.file_offset = data_start_ + parsed.begin;
    parsed.info.nbytes = parsed.end - parsed.begin;
    return parsed;
  }

 private:
  const Json& field(const std::string& where, const Json& entry, const char* key) const {
    auto it = entry.find(key);
    if (it == entry.end()) fail(path_, where + "missing \"" + key + "\"");
    return *it;
  }

  DType parse_entry_dtype(const std::string& where, const Json& entry, Fp8Format* fp8) const {
    const Json& j = field(where, entry, "dtype");
    if (!j.is_string()) fail(path_, where + "\"dtype\" is " + std::string(j.type_name()) + ", expected a string");
    const std::string& name = j.get_ref<const std::string&>();
    DType dtype;
    if (parse_dtype(name, &dtype)) return dtype;
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      if (name == fp8_dtype_name(format)) {
        *fp8 = format;
        return DType::kU8;
      }
    }
    for (const char* unsupported : kUnsupportedDtypes) {
      if (name == unsupported) {
        fail(path_, where + "unsupported dtype \"" + name + "\"",
             "moetrain reads F32 F64 BF16 F16 F8_E4M3 F8_E5M2 I32 I64 U8 BOOL; convert the model to BF16 first");
      }
    }
    fail(path_, where + "unknown dtype \"" + name + "\"");
  }

  // Fills shape and returns the element count; overflow is an error.
  uint64_t parse_shape(const std::string& where, const Json& entry, Shape* shape) const {
    const Json& j = field(where, entry, "shape");
    if (!j.is_array()) fail(path_, where + "\"shape\" is " + std::string(j.type_name()) + ", expected an array");
    if (j.size() > static_cast<size_t>(Shape::kMaxDims)) {
      fail(path_, where + "shape has " + std::to_string(j.size()) + " dimensions; moetrain supports at most " +
                      std::to_string(Shape::kMaxDims));
    }
    uint64_t numel = 1;
    for (const Json& dim : j) {
      if (!is_unsigned_integer(dim)) fail(path_, where + "shape entry " + dim.dump() + " is not a non-negative integer");
      uint64_t d = dim.get<uint64_t>();
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || !checked_multiply(numel, d, &numel)) {
        fail(path_, where + "shape " + j.dump() + " has more than 2^63 elements");
      }
    }
    if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(path_, where + "shape " + j.dump() + " has more than 2^63 elements");
    }
    for (const Json& dim : j) shape->push_back(static_cast<int64_t>(dim.get<uint64_t>()));
    return numel;
  }

  void parse_offsets(const std::string& where, const Json& entry, uint64_t* begin, uint64_t* end) const {
    const Json& j = field(where, entry, "data_offsets");
    if (!j.is_array() || j.size() != 2 || !is_unsigned_integer(j[0]) || !is_unsigned_integer(j[1])) {
      fail(path_, where + "\"data_offsets\" is " + j.dump() + ", expected [begin, end] of non-negative integers");
    }
    *begin = j[0].get<uint64_t>();
    *end = j[1].get<uint64_t>();
    if (*begin > *end) fail(path_, where + "data_offsets " + j.dump() + " end before they begin");
    if (*end > data_size_) {
      fail(path_, where + "data_offsets " + j.dump() + " end at file byte offset " +
                      (*end > std::numeric_limits<uint64_t>::max() - data_start_ ? std::string("past 2^64")
                                                                                  : std::to_string(data_start_ + *end)) +
                      ", past the end of the file (" + std::to_string(data_start_ + data_size_) + " bytes)");
    }
  }

  const std::string& path_;
  uint64_t data_start_;
  uint64_t data_size_;
};

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) { parse_header(); }

void SafetensorsFile::parse_header() {
  const std::string& file_path = path();
  uint64_t size = file_.size();
  if (size < 8) fail(file_path, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  uint64_t header_bytes = read_le_u64(file_.data());
  if (header_bytes > kMaxHeaderBytes) {
    fail(file_path, "header length " + std::to_string(header_bytes) + " (bytes 0-7) exceeds the " +
                        std::to_string(kMaxHeaderBytes >> 20) + " MiB limit");
  }
  if (header_bytes > size - 8) {
    fail(file_path, "header length " + std::to_string(header_bytes) + " (bytes 0-7) runs past the end of the file (" +
                        std::to_string(size) + " bytes): truncated?");
  }
  data_start_ = 8 + header_bytes;

  const char* text = reinterpret_cast<const char*>(file_.data() + 8);
  Json header;
  try {
    auto limit_depth = [](int depth, Json::parse_event_t, Json&) {
      if (depth > kMaxJsonDepth) throw JsonTooDeep{};
      return true;
    };
    header = Json::parse(text, text + header_bytes, limit_depth);
  } catch (const Json::parse_error& e) {
    fail(file_path, "header is not valid JSON at file byte offset " + std::to_string(8 + (e.byte > 0 ? e.byte - 1 : 0)) +
                        ": " + e.what());
  } catch (const JsonTooDeep&) {
    fail(file_path, "header JSON is nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  } catch (const Json::exception& e) {  // out_of_range: a number past 1.8e308 (no byte offset given)
    fail(file_path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(file_path, "header is a JSON " + std::string(header.type_name()) + ", expected an object");

  HeaderParser parser(file_path, data_start_, size - data_start_);
  std::vector<ParsedEntry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) fail(file_path, "\"__metadata__\" is " + std::string(value.type_name()) + ", expected an object");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          fail(file_path, "\"__metadata__\" value of \"" + meta_key + "\" is " + meta_value.dump() + ", expected a string");
        }
        metadata_[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parser.parse_entry(key, value));
  }

  // No two tensors may share bytes: sort by start, then each must begin at or after the furthest end so far.
  std::sort(entries.begin(), entries.end(), [](const ParsedEntry& a, const ParsedEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const ParsedEntry* furthest = nullptr;
  for (const ParsedEntry& entry : entries) {
    if (furthest && entry.begin < furthest->end) {
      fail(file_path, "tensors '" + furthest->name + "' and '" + entry.name + "' overlap at file byte offset " +
                          std::to_string(data_start_ + entry.begin));
    }
    if (!furthest || entry.end > furthest->end) furthest = &entry;
  }

  for (ParsedEntry& entry : entries) {
    names_.push_back(entry.name);
    tensors_.emplace(entry.name, entry.info);
  }
  std::sort(names_.begin(), names_.end());
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    throw Error(ExitCode::kBadCheckpoint, "tensor '" + name + "' not found in safetensors file '" + path() +
                                              "' (it holds " + std::to_string(names_.size()) + " tensors)");
  }
  return it->second;
}

TensorView SafetensorsFile::view(const std::string& name) const {
  const SafetensorsTensorInfo& tensor = info(name);
  TensorView v;
  v.data = const_cast<uint8_t*>(tensor_bytes(tensor));  // read-only mapping; see the header comment
  v.dtype = tensor.dtype;
  v.device = Device::kCPU;
  v.shape = tensor.shape;
  return v;
}

void SafetensorsFile::check_row_range(const std::string& name, const Shape& shape, int64_t row_begin,
                                      int64_t row_end) const {
  if (shape.ndim() == 0 || row_begin < 0 || row_begin > row_end || row_end > shape[0]) {
    throw Error(ExitCode::kBadCheckpoint, "cannot read rows [" + std::to_string(row_begin) + ", " +
                                              std::to_string(row_end) + ") of tensor '" + name + "' with shape " +
                                              shape.str() + " in '" + path() + "'");
  }
}

void SafetensorsFile::check_convertible(const std::string& name, DType dst_dtype, const SafetensorsTensorInfo& src) const {
  const bool fp8 = src.fp8 != Fp8Format::kNone;
  if (fp8 ? !is_floating(dst_dtype) : !can_convert(dst_dtype, src.dtype)) {
    throw Error(ExitCode::kBadCheckpoint, "tensor '" + name + "' in '" + path() + "' is " +
                                              (fp8 ? fp8_dtype_name(src.fp8) : dtype_name(src.dtype)) +
                                              "; it cannot be read as " + dtype_name(dst_dtype) +
                                              " (only floating types convert)");
  }
}

void SafetensorsFile::read_rows(void* dst, const std::string& name, int64_t row_begin, int64_t row_end) const {
  const SafetensorsTensorInfo& tensor = info(name);
  check_row_range(name, tensor.shape, row_begin, row_end);
  if (row_begin == row_end) return;
  uint64_t row_bytes = tensor.nbytes / static_cast<uint64_t>(tensor.shape[0]);
  std::memcpy(dst, tensor_bytes(tensor) + static_cast<uint64_t>(row_begin) * row_bytes,
              static_cast<uint64_t>(row_end - row_begin) * row_bytes);
}

Tensor SafetensorsFile::read_rows_as(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const {
  TensorView whole = view(name);
  const SafetensorsTensorInfo& tensor = info(name);
  check_convertible(name, dst_dtype, tensor);
  check_row_range(name, whole.shape, row_begin, row_end);
  return convert_copy(whole.slice_rows(row_begin, row_end), tensor.fp8, dst_dtype);
}

Tensor SafetensorsFile::read_as(const std::string& name, DType dst_dtype) const {
  TensorView whole = view(name);
  const SafetensorsTensorInfo& tensor = info(name);
  check_convertible(name, dst_dtype, tensor);
  return convert_copy(whole, tensor.fp8, dst_dtype);
}

}  // namespace moetrain
