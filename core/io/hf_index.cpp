#include "core/io/hf_index.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/base/host_convert.h"
#include "core/io/output_file.h"
#include "core/io/safetensors_writer.h"

namespace moetrain {

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what) { throw Error(ExitCode::kBadCheckpoint, what); }

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// Shard names come from a downloaded file: keep them inside the directory.
bool is_plain_relative_path(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  for (const auto& part : fs::path(name)) {
    if (part == "..") return false;
  }
  return true;
}

std::string shard_file_name(int index, int count) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "model-%05d-of-%05d.safetensors", index + 1, count);
  return buffer;
}

}  // namespace

HfCheckpoint::HfCheckpoint(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    fail("model directory '" + dir + "' does not exist or is not a directory (set model.hf_dir to a Hugging Face model directory)");
  }
  std::string index_path = join(dir, kIndexFileName);
  std::string single_path = join(dir, kSingleFileName);
  if (fs::exists(index_path, ec)) {
    sharded_ = true;
    read_index(index_path);
  } else if (is_regular_file(single_path)) {
    auto file = std::make_unique<SafetensorsFile>(single_path);
    for (const std::string& name : file->names()) shard_of_[name] = kSingleFileName;
    open_files_[kSingleFileName] = std::move(file);
  } else {
    fail("model directory '" + dir + "' has neither " + kIndexFileName + " nor " + kSingleFileName +
         " (expected Hugging Face safetensors weights there)");
  }
  read_fp8_quantization();
  for (const auto& entry : shard_of_) names_.push_back(entry.first);
  const std::string text_prefix = "language_model.";
  for (const std::string& name : names_) {
    if (name.compare(0, text_prefix.size(), text_prefix) == 0 && !shard_of_.count(name.substr(text_prefix.size()))) {
      unprefixed_.emplace(name.substr(text_prefix.size()), name);
    }
  }
}

// config.json beside the weights; one that cannot be read or parsed is left to the config
// reader (core/model/hf_config.cpp), which names the problem.
void HfCheckpoint::read_fp8_quantization() {
  const std::string path = join(dir_, "config.json");
  if (!is_regular_file(path)) return;
  std::ifstream in(path, std::ios::binary);
  const Json config = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) return;
  auto quantization = config.find("quantization_config");
  if (quantization != config.end()) fp8_ = fp8_quantization_from_json(*quantization, path);
}

void HfCheckpoint::read_index(const std::string& index_path) {
  std::ifstream in(index_path, std::ios::binary);
  if (!in) fail("cannot read '" + index_path + "'");
  std::stringstream text;
  text << in.rdbuf();
  Json index;
  try {
    index = Json::parse(text.str());
  } catch (const Json::exception& e) {  // parse_error, and out_of_range for a number past 1.8e308
    fail("'" + index_path + "' is not valid JSON: " + e.what());
  }
  if (!index.is_object()) fail("'" + index_path + "' is a JSON " + std::string(index.type_name()) + ", expected an object");
  auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    fail("'" + index_path + "' has no \"weight_map\" object (tensor name -> shard file)");
  }
  for (const auto& [name, file] : weight_map->items()) {
    if (!file.is_string() || !is_plain_relative_path(file.get<std::string>())) {
      fail("'" + index_path + "': weight_map[\"" + name + "\"] is " + file.dump() +
           ", expected the name of a file inside '" + dir_ + "'");
    }
    shard_of_[name] = file.get<std::string>();
  }
  auto metadata = index.find("metadata");
  if (metadata != index.end() && metadata->is_object()) {
    for (const auto& [key, value] : metadata->items()) index_metadata_[key] = value.dump();
  }
  // A missing shard is found now, not an hour into loading.
  std::map<std::string, std::string> first_tensor_of_file;
  for (const auto& [name, file] : shard_of_) first_tensor_of_file.emplace(file, name);
  for (const auto& [file, name] : first_tensor_of_file) {
    if (!is_regular_file(join(dir_, file))) {
      fail("'" + index_path + "' maps tensor '" + name + "' to '" + file + "', but '" + join(dir_, file) +
           "' does not exist (incomplete download?)");
    }
  }
}

std::string HfCheckpoint::file_of(const std::string& name) const {
  auto it = shard_of_.find(stored(name));
  if (it == shard_of_.end()) {
    fail("tensor '" + name + "' is not in model directory '" + dir_ + "' (" +
         (sharded_ ? std::string(kIndexFileName) + " does not list it" : std::string(kSingleFileName) + " lacks it") + ")");
  }
  return join(dir_, it->second);
}

const SafetensorsFile& HfCheckpoint::file_for(const std::string& name) const {
  std::string path = file_of(name);
  const std::string& file_name = shard_of_.at(stored(name));
  std::lock_guard<std::mutex> lock(open_mutex_);
  auto it = open_files_.find(file_name);
  if (it == open_files_.end()) {
    auto file = std::make_unique<SafetensorsFile>(path);
    // Check every promise the index makes about this shard at once.
    for (const auto& [tensor, shard] : shard_of_) {
      if (shard == file_name && !file->has(tensor)) {
        fail(std::string(kIndexFileName) + " in '" + dir_ + "' maps tensor '" + tensor + "' to '" + path +
             "', but that file does not contain it (index and shards are from different versions?)");
      }
    }
    it = open_files_.emplace(file_name, std::move(file)).first;
  }
  return *it->second;
}

const SafetensorsTensorInfo& HfCheckpoint::info(const std::string& name) const {
  return file_for(name).info(stored(name));
}

namespace {

// Bytes of rows [row_begin, row_end) of a stored tensor.
uint64_t row_bytes(const SafetensorsTensorInfo& info, int64_t row_begin, int64_t row_end) {
  const int64_t rows = info.shape.ndim() == 0 ? 1 : info.shape[0];
  return rows == 0 ? 0 : info.nbytes / static_cast<uint64_t>(rows) * static_cast<uint64_t>(row_end - row_begin);
}

}  // namespace

void HfCheckpoint::check_unscaled(const std::string& name) const {
  const std::string scale = fp8_scale_name(name);
  if (!has(scale)) return;
  fail("tensor '" + name + "' in '" + file_of(name) + "' is " + dtype_name(info(name).dtype) + " but has FP8 block "
       "scales '" + scale + "' beside it: an FP8 weight is stored F8_E4M3 or F8_E5M2 (the checkpoint is damaged or "
       "half converted; download or convert it again)");
}

HfCheckpoint::Fp8Weight HfCheckpoint::read_fp8_blocks(const std::string& name, int64_t row_begin,
                                                      int64_t row_end) const {
  constexpr int64_t kBlock = Fp8BlockQuantization::kBlock;
  const SafetensorsTensorInfo& codes = info(name);
  const std::string where = "tensor '" + name + "' in '" + file_of(name) + "' (" + fp8_dtype_name(codes.fp8) + ")";
  const std::string config = "'" + join(dir_, "config.json") + "'";
  if (!fp8_.declared()) {
    fail(where + ": " + config + " has no quantization_config with quant_method \"fp8\", so FP8 weights are not "
         "expected (add the checkpoint's own config.json)");
  }
  if (codes.fp8 != fp8_.format) {
    fail(where + ": " + config + " quantization_config.fmt is \"" + fp8_fmt_name(fp8_.format) + "\", which stores " +
         fp8_dtype_name(fp8_.format));
  }
  const std::string module = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0
                                 ? name.substr(0, name.size() - 7) : name;
  if (!fp8_.converts(module)) {
    fail(where + ": " + config + " quantization_config.modules_to_not_convert lists module '" + module +
         "', so it must not be FP8");
  }
  if (codes.shape.ndim() != 2) fail(where + " has shape " + codes.shape.str() + "; FP8 weights are 2-D [out, in]");
  const std::string scale = fp8_scale_name(name);
  if (!has(scale)) fail(where + " has no block scales '" + scale + "' (F32, one per 128 x 128 block) beside it");
  const SafetensorsTensorInfo& scales = info(scale);
  const int64_t rows = codes.shape[0], cols = codes.shape[1];
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    fail("cannot read rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) + ") of " + where +
         " with shape " + codes.shape.str());
  }
  const Shape expected{(rows + kBlock - 1) / kBlock, (cols + kBlock - 1) / kBlock};
  if (scales.dtype != DType::kF32 || scales.fp8 != Fp8Format::kNone || scales.shape != expected) {
    fail("block scales '" + scale + "' of " + where + " are " +
         (scales.fp8 != Fp8Format::kNone ? fp8_dtype_name(scales.fp8) : dtype_name(scales.dtype)) + " " +
         scales.shape.str() + "; a " + codes.shape.str() + " weight in 128 x 128 blocks needs F32 " + expected.str());
  }
  Fp8Weight out;
  out.format = codes.fp8;
  out.codes = Tensor({row_end - row_begin, cols}, DType::kU8);
  file_for(name).read_rows(out.codes.data(), stored(name), row_begin, row_end);
  const int64_t first_block = row_begin / kBlock;
  const int64_t end_block = row_end > row_begin ? (row_end - 1) / kBlock + 1 : first_block;
  out.scales = file_for(scale).read_rows_as(stored(scale), first_block, end_block, DType::kF32);
  bytes_read_ += out.codes.nbytes() + out.scales.nbytes();
  return out;
}

HfCheckpoint::Fp8Weight HfCheckpoint::read_fp8(const std::string& name) const {
  const SafetensorsTensorInfo& tensor = info(name);
  MOETRAIN_ASSERT(tensor.fp8 != Fp8Format::kNone, "read_fp8 of the non-FP8 tensor " + name);
  return read_fp8_blocks(name, 0, tensor.shape.ndim() > 0 ? tensor.shape[0] : 0);
}

Tensor HfCheckpoint::read_fp8_rows(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const {
  const Fp8Weight blocks = read_fp8_blocks(name, row_begin, row_end);
  const int64_t cols = blocks.codes.size(1);
  Tensor values({row_end - row_begin, cols}, DType::kF64);
  fp8_block_dequantize(values.ptr<double>(), static_cast<const uint8_t*>(blocks.codes.data()),
                       blocks.scales.ptr<float>(), blocks.format, row_end - row_begin, cols, row_begin);
  if (dst_dtype == DType::kF64) return values;
  const std::string where = "tensor '" + name + "' in '" + file_of(name) + "' (" + fp8_dtype_name(blocks.format) + ")";
  MOETRAIN_CHECK(is_floating(dst_dtype), ExitCode::kBadCheckpoint,
                 where + " cannot be read as " + dtype_name(dst_dtype) + " (only floating types convert)");
  Tensor out(values.shape(), dst_dtype);
  convert_host(out.view(), values.view());
  return out;
}

Tensor HfCheckpoint::read_as(const std::string& name, DType dst_dtype) const {
  const SafetensorsTensorInfo& tensor = info(name);
  if (tensor.fp8 != Fp8Format::kNone) return read_fp8_rows(name, 0, tensor.shape.ndim() > 0 ? tensor.shape[0] : 0, dst_dtype);
  check_unscaled(name);
  Tensor t = file_for(name).read_as(stored(name), dst_dtype);
  bytes_read_ += info(name).nbytes;
  return t;
}

Tensor HfCheckpoint::read_rows_as(const std::string& name, int64_t row_begin, int64_t row_end, DType dst_dtype) const {
  const SafetensorsTensorInfo& tensor = info(name);
  if (tensor.fp8 != Fp8Format::kNone) {
    return read_fp8_rows(name, row_begin, row_end, dst_dtype);
  }
  check_unscaled(name);
  Tensor t = file_for(name).read_rows_as(stored(name), row_begin, row_end, dst_dtype);
  bytes_read_ += row_bytes(info(name), row_begin, row_end);
  return t;
}

void HfCheckpoint::read_rows(void* dst, const std::string& name, int64_t row_begin, int64_t row_end) const {
  file_for(name).read_rows(dst, stored(name), row_begin, row_end);
  bytes_read_ += row_bytes(info(name), row_begin, row_end);
}

void write_hf_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                         const HfShardedWriteParams& params) {
  MOETRAIN_ASSERT(params.num_shards >= 1 && static_cast<size_t>(params.num_shards) <= std::max<size_t>(tensors.size(), 1),
                  "cannot split " + std::to_string(tensors.size()) + " tensors into " +
                      std::to_string(params.num_shards) + " shards");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create directory '" + dir + "': " + ec.message());

  std::vector<const NamedTensor*> sorted;
  for (const NamedTensor& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](const NamedTensor* a, const NamedTensor* b) { return a->name < b->name; });

  if (params.num_shards == 1) {
    SafetensorsWriter writer;
    for (const NamedTensor* t : sorted) writer.add(t->name, t->tensor);
    for (const auto& [key, value] : params.metadata) writer.set_metadata(key, value);
    writer.write_atomic(join(dir, HfCheckpoint::kSingleFileName));
    return;
  }

  Json weight_map = Json::object();
  uint64_t total_size = 0;
  size_t n = sorted.size();
  for (int shard = 0; shard < params.num_shards; ++shard) {
    std::string file_name = shard_file_name(shard, params.num_shards);
    SafetensorsWriter writer;
    for (size_t i = n * shard / params.num_shards; i < n * (shard + 1) / params.num_shards; ++i) {
      writer.add(sorted[i]->name, sorted[i]->tensor);
      weight_map[sorted[i]->name] = file_name;
      total_size += sorted[i]->tensor.nbytes();
    }
    for (const auto& [key, value] : params.metadata) writer.set_metadata(key, value);
    writer.write_atomic(join(dir, file_name));
  }
  // The index goes last: a directory with an index has all its shards.
  Json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  std::string text = index.dump(2) + "\n";
  std::string index_path = join(dir, HfCheckpoint::kIndexFileName);
  OutputFile out(index_path + ".tmp");
  out.write(text.data(), text.size());
  out.sync();
  out.close();
  rename_durably(index_path + ".tmp", index_path);
}

}  // namespace moetrain
