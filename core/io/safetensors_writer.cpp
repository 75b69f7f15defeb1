#include "core/io/safetensors_writer.h"

#include <algorithm>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "core/io/output_file.h"

namespace moetrain {

namespace {

using Json = nlohmann::json;

constexpr uint64_t kDataAlignment = 8;

struct Placement {
  const std::string* name;
  const TensorView* tensor;
  uint64_t begin;
  uint64_t end;
};

std::vector<Placement> place_tensors(const std::map<std::string, TensorView>& tensors) {
  std::vector<Placement> order;
  for (const auto& [name, tensor] : tensors) order.push_back({&name, &tensor, 0, 0});
  // Widest elements first: with an 8-aligned data start every tensor stays aligned to its element.
  std::stable_sort(order.begin(), order.end(), [](const Placement& a, const Placement& b) {
    return dtype_size(a.tensor->dtype) > dtype_size(b.tensor->dtype);
  });
  uint64_t offset = 0;
  for (Placement& p : order) {
    p.begin = offset;
    p.end = offset + p.tensor->nbytes();
    offset = p.end;
  }
  return order;
}

std::string header_text(const std::vector<Placement>& placements, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const Placement& p : placements) {
    Json shape = Json::array();
    for (int64_t d : p.tensor->shape) shape.push_back(d);
    header[*p.name] = {{"dtype", dtype_name(p.tensor->dtype)}, {"shape", shape}, {"data_offsets", {p.begin, p.end}}};
  }
  std::string text = header.dump();
  text.append((kDataAlignment - (8 + text.size()) % kDataAlignment) % kDataAlignment, ' ');
  return text;
}

// The 8-byte length and the header, written to `out`.
void write_header(OutputFile& out, const std::vector<Placement>& placements,
                  const std::map<std::string, std::string>& metadata) {
  std::string header;
  try {
    header = header_text(placements, metadata);
  } catch (const Json::exception& e) {  // e.g. a name or metadata value that is not UTF-8
    throw Error(ExitCode::kBadCheckpoint, "cannot write safetensors file '" + out.path() + "': " + e.what());
  }
  uint8_t length[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(n >> (8 * i));
  out.write(length, sizeof length);
  out.write(header.data(), header.size());
}

}  // namespace

void SafetensorsWriter::add(const std::string& name, const TensorView& tensor) {
  MOETRAIN_ASSERT(name != "__metadata__", "tensor name __metadata__ is reserved by safetensors");
  MOETRAIN_ASSERT(tensor.device == Device::kCPU, "safetensors writer takes CPU tensors; '" + name + "' is on " +
                                                     device_name(tensor.device));
  MOETRAIN_ASSERT(tensor.data != nullptr || tensor.numel() == 0, "tensor '" + name + "' has no data");
  bool inserted = tensors_.emplace(name, tensor).second;
  MOETRAIN_ASSERT(inserted, "tensor '" + name + "' added twice");
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::write(const std::string& path) const { write_to(path, /*sync=*/false); }

void SafetensorsWriter::write_atomic(const std::string& path) const {
  std::string tmp = path + ".tmp";
  write_to(tmp, /*sync=*/true);
  rename_durably(tmp, path);
}

void SafetensorsWriter::write_to(const std::string& path, bool sync) const {
  std::vector<Placement> placements = place_tensors(tensors_);
  OutputFile out(path);
  write_header(out, placements, metadata_);
  for (const Placement& p : placements) out.write(p.tensor->data, p.tensor->nbytes());
  if (sync) out.sync();
  out.close();
}

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& path, const std::vector<Declared>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  std::map<std::string, TensorView> views;  // shapes and dtypes only: place_tensors reads no data
  for (const Declared& d : tensors) {
    MOETRAIN_ASSERT(d.name != "__metadata__", "tensor name __metadata__ is reserved by safetensors");
    MOETRAIN_ASSERT(views.emplace(d.name, TensorView{nullptr, d.dtype, Device::kCPU, d.shape}).second,
                    "tensor '" + d.name + "' declared twice");
    declared_.emplace(d.name, d);
  }
  std::vector<Placement> placements = place_tensors(views);
  for (const Placement& p : placements) order_.push_back(*p.name);
  out_ = std::make_unique<OutputFile>(path);
  write_header(*out_, placements, metadata);
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

void SafetensorsStreamWriter::write_next(const std::string& name, const TensorView& value) {
  MOETRAIN_ASSERT(next_ < order_.size() && order_[next_] == name,
                  "safetensors stream: '" + name + "' written out of order in " + out_->path());
  const Declared& d = declared_.at(name);
  MOETRAIN_ASSERT(value.device == Device::kCPU && value.dtype == d.dtype && value.shape == d.shape,
                  "safetensors stream: '" + name + "' is not the declared " + dtype_name(d.dtype) + " " + d.shape.str());
  out_->write(value.data, value.nbytes());
  ++next_;
}

void SafetensorsStreamWriter::finish() {
  MOETRAIN_ASSERT(next_ == order_.size(), "safetensors stream: " + out_->path() + " finished before its last tensor");
  out_->sync();
  out_->close();
}

}  // namespace moetrain
