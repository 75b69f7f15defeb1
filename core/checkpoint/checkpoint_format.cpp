#include "core/checkpoint/checkpoint_format.h"

#include <fmt/format.h>
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "core/base/error.h"
#include "core/io/json_integer.h"
#include "core/io/output_file.h"

namespace moetrain {
namespace {

using Json = nlohmann::json;

constexpr const char* kFormatName = "moetrain-checkpoint";
constexpr int kFormatVersion = 1;

[[noreturn]] void bad(const std::string& source, const std::string& what) {
  throw Error(ExitCode::kBadCheckpoint,
              fmt::format("{}: {} (the checkpoint is damaged or was not written by moetrain; resume from an "
                          "older step_<N> or start without --resume)",
                          source, what));
}

// A file name that stays inside the checkpoint directory.
bool is_confined_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

// object[key] as an Int: a JSON integer (or integral float) that Int holds, never a cast of
// whatever number is there (1e300 as an int is undefined behaviour; -1 as uint64 wraps).
template <typename Int>
Int integer_field(const Json& object, const char* key, const std::string& source, const std::string& where = "") {
  const Json& value = object.at(key);
  Int result = 0;
  if (!json_integer(value, &result)) {
    bad(source, fmt::format("{}\"{}\" is {}, expected an integer in [{}, {}]", where, key, value.dump(),
                            std::numeric_limits<Int>::min(), std::numeric_limits<Int>::max()));
  }
  return result;
}

Json shape_to_json(const Shape& shape) {
  Json dims = Json::array();
  for (int64_t d : shape) dims.push_back(d);
  return dims;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return "step_" + std::to_string(step); }

std::string shard_file_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

int64_t parse_checkpoint_dir_name(const std::string& name) {
  const std::string prefix = "step_";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) return -1;
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string manifest_to_json(const Manifest& m) {
  Json json;
  json["format"] = kFormatName;
  json["version"] = kFormatVersion;
  json["step"] = m.step;
  json["tokens"] = m.tokens;
  json["optimizer_steps"] = m.optimizer_steps;
  json["world"] = {{"size", m.world}, {"fsdp", m.fsdp}, {"ep", m.ep}};
  json["config"] = m.config_yaml;
  json["ranks"] = Json::array();
  for (const RankProgress& r : m.ranks) {
    json["ranks"].push_back({{"rank", r.rank}, {"data_cursor", r.data_cursor}, {"rng_state", r.rng_state}});
  }
  json["files"] = Json::array();
  for (const ManifestFile& f : m.files) {
    json["files"].push_back(
        {{"path", f.path}, {"rank", f.rank}, {"bytes", f.bytes}, {"crc32", fmt::format("{:08x}", f.crc32)}});
  }
  return json.dump(2) + "\n";
}

Manifest parse_manifest(const std::string& text, const std::string& source) {
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::exception& e) {
    bad(source, std::string("not valid JSON (") + e.what() + ")");
  }
  Manifest m;
  try {
    if (!json.is_object() || json.value("format", "") != kFormatName) bad(source, "\"format\" is not moetrain-checkpoint");
    if (integer_field<int>(json, "version", source) != kFormatVersion) {
      bad(source, fmt::format("version {} is not {}, the one this build reads", json.at("version").dump(),
                              kFormatVersion));
    }
    m.step = integer_field<int64_t>(json, "step", source);
    m.tokens = integer_field<int64_t>(json, "tokens", source);
    m.optimizer_steps = integer_field<int64_t>(json, "optimizer_steps", source);
    const Json& world = json.at("world");
    m.world = integer_field<int>(world, "size", source, "world: ");
    m.fsdp = integer_field<int64_t>(world, "fsdp", source, "world: ");
    m.ep = integer_field<int64_t>(world, "ep", source, "world: ");
    m.config_yaml = json.at("config").get<std::string>();
    if (m.step < 0 || m.tokens < 0 || m.optimizer_steps < 0 || m.optimizer_steps > m.step) {
      bad(source, "step, tokens or optimizer_steps out of range");
    }
    if (m.world < 1 || m.world > (1 << 24) || m.fsdp < 1 || m.ep < 1) bad(source, "\"world\" out of range");
    for (const Json& r : json.at("ranks")) {
      m.ranks.push_back(RankProgress{integer_field<int>(r, "rank", source, "ranks: "),
                                     integer_field<uint64_t>(r, "data_cursor", source, "ranks: "),
                                     integer_field<uint64_t>(r, "rng_state", source, "ranks: ")});
    }
    for (const Json& f : json.at("files")) {
      ManifestFile file;
      file.path = f.at("path").get<std::string>();
      file.rank = integer_field<int>(f, "rank", source, "files: ");
      file.bytes = integer_field<uint64_t>(f, "bytes", source, "files: ");
      std::string crc = f.at("crc32").get<std::string>();
      char* end = nullptr;
      unsigned long value = std::strtoul(crc.c_str(), &end, 16);
      if (crc.size() != 8 || *end != '\0') bad(source, "file \"" + file.path + "\": crc32 \"" + crc + "\" is not 8 hex digits");
      file.crc32 = static_cast<uint32_t>(value);
      if (!is_confined_file_name(file.path)) {
        bad(source, "file path \"" + file.path + "\" leaves the checkpoint directory (only bare file names are allowed)");
      }
      m.files.push_back(file);
    }
  } catch (const Json::exception& e) {
    bad(source, std::string("missing or mistyped field (") + e.what() + ")");
  }
  // One progress record and one shard per rank of the saving world, in rank order.
  if (m.ranks.size() != static_cast<size_t>(m.world) || m.files.size() != static_cast<size_t>(m.world)) {
    bad(source, fmt::format("lists {} ranks and {} files for a world of {}", m.ranks.size(), m.files.size(), m.world));
  }
  std::set<std::string> paths;
  for (int r = 0; r < m.world; ++r) {
    if (m.ranks[r].rank != r || m.files[r].rank != r) bad(source, fmt::format("entry {} is not for rank {}", r, r));
    if (!paths.insert(m.files[r].path).second) bad(source, "file \"" + m.files[r].path + "\" listed twice");
  }
  return m;
}

std::string slices_to_json(const std::map<std::string, TensorSlice>& slices) {
  Json json = Json::object();
  for (const auto& [key, slice] : slices) {
    json[key] = {{"global_shape", shape_to_json(slice.global_shape)}, {"offset", slice.offset}};
  }
  return json.dump();
}

std::map<std::string, TensorSlice> parse_slices(const std::string& text, const std::string& source) {
  std::map<std::string, TensorSlice> slices;
  try {
    Json json = Json::parse(text);
    if (!json.is_object()) bad(source, std::string(kSlicesMetadataKey) + " is not a JSON object");
    for (const auto& [key, value] : json.items()) {
      TensorSlice slice;
      const Json& dims = value.at("global_shape");
      if (!dims.is_array() || dims.size() > static_cast<size_t>(Shape::kMaxDims)) {
        bad(source, "tensor \"" + key + "\": bad global_shape");
      }
      for (const Json& d : dims) {
        int64_t dim = -1;
        if (!json_integer(d, &dim)) bad(source, "tensor \"" + key + "\": global_shape entry " + d.dump() + " is not an integer");
        if (dim < 0 || dim > (int64_t{1} << 40)) bad(source, "tensor \"" + key + "\": dimension out of range");
        slice.global_shape.push_back(dim);
      }
      slice.offset = integer_field<int64_t>(value, "offset", source, "tensor \"" + key + "\": ");
      slices.emplace(key, slice);
    }
  } catch (const Json::exception& e) {
    bad(source, std::string(kSlicesMetadataKey) + " is malformed (" + e.what() + ")");
  }
  return slices;
}

FileDigest digest_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw Error(ExitCode::kBadCheckpoint, "cannot read checkpoint file " + path + " (missing or unreadable)");
  }
  FileDigest digest;
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<unsigned char> buffer(1 << 20);
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), file)) > 0) {
    crc = crc32(crc, buffer.data(), static_cast<uInt>(n));
    digest.bytes += n;
  }
  bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) throw Error(ExitCode::kBadCheckpoint, "cannot read checkpoint file " + path + " (I/O error)");
  digest.crc32 = static_cast<uint32_t>(crc);
  return digest;
}

void write_text_durably(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    OutputFile out(tmp);
    out.write(text.data(), text.size());
    out.sync();
    out.close();
  }
  rename_durably(tmp, path);
}

}  // namespace moetrain
