#include "core/checkpoint/merged_export.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/base/log.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_group.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/io/hf_index.h"
#include "core/io/output_file.h"
#include "core/io/safetensors_writer.h"
#include "core/model/hf_names.h"
#include "kernels/mxfp4_format.h"
#include "parallel/watchdog.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

using Json = nlohmann::json;

// In <out>.tmp/ while a merge writes it: a leftover with this file is ours to clear.
constexpr const char* kInProgressMarker = ".moetrain-merge-in-progress";
constexpr const char* kPackedSuffix = ".weight_packed";
constexpr const char* kScaleSuffix = ".weight_scale";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Runs `phase` on this rank, then agrees with the others: every rank throws when any failed.
void agree(CheckpointGroup& group, const std::string& what, const std::function<void()>& phase) {
  run_agreed(group, "merge: " + what,
             Error(ExitCode::kInternal, fmt::format("merge failed on another rank while {} (see that rank's message)", what)),
             phase);
}

// One output tensor: a base tensor copied or merged, or an MXFP4 weight decoded (packed != "").
struct OutputTensor {
  std::string name;    // the output's (stored) name
  DType dtype = DType::kF32;
  Shape shape;
  std::string packed;  // MXFP4: the base's <name>_packed and <name>_scale
};

// Rows [delta_row, delta_row + rows) of one adapter's delta (expert `expert`'s, for routed
// experts) added into rows [tensor_row, ...) of a tensor viewed as [rows, in].
struct Contribution {
  std::string module;   // <module>.lora_A.weight / .lora_B.weight in the checkpoint
  int64_t expert = -1;  // -1: a 2-D adapter
  double scale = 1.0;
  int64_t delta_row = 0, tensor_row = 0, rows = 0;
};

// What the merge writes, the same on every rank (made from the same files).
struct MergePlan {
  std::string base_dir;
  std::map<std::string, OutputTensor> tensors;                 // by output name
  std::map<std::string, std::vector<Contribution>> deltas;     // by output name
  struct Shard {
    std::string file;
    std::vector<std::string> tensors;
  };
  std::vector<Shard> shards;
  bool decoded_mxfp4 = false;
  // Trained buffers (the selection biases of aux-loss-free balancing) that replace base tensors:
  // the checkpoint's buffer/<name> key by output name.
  std::map<std::string, std::string> buffers;
};

// Each buffer/<name> of the checkpoint replaces the base tensor of that name (or of a name ending
// in ".<name>": Kimi K3's text model under language_model.), which must exist with its element
// count: a trained bias is never dropped silently.
void plan_buffers(const CheckpointReader& reader, const HfCheckpoint& base, MergePlan& plan) {
  for (const std::string& key : reader.keys()) {
    if (key.rfind(kBufferKind, 0) != 0) continue;
    const std::string name = key.substr(std::strlen(kBufferKind));
    std::vector<std::string> matches;
    for (const auto& [out_name, t] : plan.tensors) {
      if (out_name == name || ends_with(out_name, "." + name)) matches.push_back(out_name);
    }
    MOETRAIN_CHECK(matches.size() == 1, ExitCode::kBadCheckpoint,
                   fmt::format("{}: the trained buffer \"{}\" matches {} tensors of the base {} (needs exactly one): "
                               "merge into the base model the run trained on",
                               reader.path(), key, matches.size(), base.dir()));
    const OutputTensor& t = plan.tensors.at(matches.front());
    MOETRAIN_CHECK(t.shape.numel() == reader.global_shape(key).numel(), ExitCode::kBadCheckpoint,
                   fmt::format("{}: the trained buffer \"{}\" has shape {} but the base's \"{}\" is {}", reader.path(),
                               key, reader.global_shape(key).str(), t.name, t.shape.str()));
    plan.buffers[t.name] = key;
  }
}

// The base's tensors as the output holds them: MXFP4 pairs become one BF16 weight.
std::map<std::string, OutputTensor> output_tensors(const HfCheckpoint& base, bool& decoded_mxfp4) {
  std::map<std::string, OutputTensor> out;
  for (const std::string& name : base.names()) {
    const SafetensorsTensorInfo& info = base.info(name);
    MOETRAIN_CHECK(info.fp8 == Fp8Format::kNone, ExitCode::kBadCheckpoint,
                   fmt::format("{}: \"{}\" is {}: merging adapters into an FP8 block-scaled base is not supported "
                               "(training reads it dequantized); merge into a BF16 copy of the base instead",
                               base.dir(), name, fp8_dtype_name(info.fp8)));
    if (ends_with(name, kScaleSuffix) && base.has(name.substr(0, name.size() - std::strlen(kScaleSuffix)) + kPackedSuffix))
      continue;  // decoded with its packed codes
    OutputTensor t{name, info.dtype, info.shape, ""};
    if (ends_with(name, kPackedSuffix)) {
      const std::string weight = name.substr(0, name.size() - std::strlen(kPackedSuffix)) + ".weight";
      const std::string scale = weight + "_scale";
      MOETRAIN_CHECK(base.has(scale), ExitCode::kBadCheckpoint,
                     fmt::format("{}: \"{}\" has no \"{}\" beside it (compressed-tensors mxfp4-pack-quantized stores "
                                 "both)",
                                 base.dir(), name, scale));
      const SafetensorsTensorInfo& s = base.info(scale);
      MOETRAIN_CHECK(info.dtype == DType::kU8 && s.dtype == DType::kU8 && info.shape.ndim() == 2 &&
                         s.shape.ndim() == 2 && s.shape[0] == info.shape[0] &&
                         2 * info.shape[1] == s.shape[1] * kernels::kMxfp4GroupSize,
                     ExitCode::kBadCheckpoint,
                     fmt::format("{}: \"{}\" ({} {}) and \"{}\" ({} {}) are not MXFP4 codes [out, in / 2] and scales "
                                 "[out, in / 32]",
                                 base.dir(), name, dtype_name(info.dtype), info.shape.str(), scale,
                                 dtype_name(s.dtype), s.shape.str()));
      t = OutputTensor{weight, DType::kBF16, Shape{info.shape[0], 2 * info.shape[1]}, name};
      decoded_mxfp4 = true;
    }
    MOETRAIN_CHECK(out.emplace(t.name, t).second, ExitCode::kBadCheckpoint,
                   fmt::format("{}: holds both \"{}\" and its MXFP4 codes \"{}\"", base.dir(), t.name, name));
  }
  return out;
}

// Finds each adapter's tensors and its scale.
class DeltaPlanner {
 public:
  DeltaPlanner(const CheckpointReader& reader, const Config& config, MergePlan& plan)
      : reader_(reader), settings_(adapter_export_settings(config)), plan_(plan) {}

  void add_module(const std::string& module) {
    const Shape& a = reader_.global_shape(kParamKind + module + ".lora_A.weight");
    const Shape& b = reader_.global_shape(kParamKind + module + ".lora_B.weight");
    if (b.ndim() == 3) {
      add_routed_experts(module, a, b);
      return;
    }
    MOETRAIN_CHECK(a.ndim() == 2 && b.ndim() == 2 && a[0] == b[1], ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter {} has A {} and B {}, not [r, in] and [out, r]", reader_.path(), module,
                               a.str(), b.str()));
    const double scale = settings_.of(module, a[0]).scale();
    const int64_t out = b[0], in = a[1];
    // The layouts the loader accepts for this weight, first complete one (model_weights.cpp).
    const std::vector<HfLayout> layouts = hf_layouts({hf_piece(module + ".weight", Shape{out, in})});
    std::vector<std::string> tried;
    for (const HfLayout& layout : layouts) {
      bool complete = true;
      for (const HfPiece& piece : layout) {
        complete = complete && !stored(piece.name).empty();
        tried.push_back("\"" + piece.name + "\"");
      }
      if (!complete) continue;
      for (const HfPiece& piece : layout) {
        const OutputTensor& t = plan_.tensors.at(stored(piece.name));
        const int64_t rows = piece.rows < 0 ? (t.shape.ndim() == 2 ? t.shape[0] : -1) : piece.rows;
        MOETRAIN_CHECK(t.shape.ndim() == 2 && t.shape[1] == in && rows * in == piece.numel &&
                           piece.first_row + rows <= t.shape[0] && piece.offset % in == 0,
                       ExitCode::kBadCheckpoint,
                       fmt::format("{}: tensor \"{}\" has shape {}, which adapter {} (B A: [{}, {}]) does not fit: the "
                                   "checkpoint was not trained on this base model",
                                   plan_.base_dir, t.name, t.shape.str(), module, out, in));
        plan_.deltas[t.name].push_back(Contribution{module, -1, scale, piece.offset / in, piece.first_row, rows});
      }
      return;
    }
    not_found(module, tried);
  }

 private:
  // The output name of the base tensor `name` (ours, maybe under language_model.), "" if none.
  std::string stored(const std::string& name) const {
    if (plan_.tensors.count(name)) return name;
    const std::string text = "language_model." + name;
    return plan_.tensors.count(text) ? text : "";
  }

  [[noreturn]] void not_found(const std::string& module, const std::vector<std::string>& tried) const {
    std::string names;
    for (const std::string& t : tried) names += (names.empty() ? "" : ", ") + t;
    throw Error(ExitCode::kBadCheckpoint,
                fmt::format("{}: no tensor for adapter {} (looked for {}): the checkpoint was not trained on this "
                            "base model (set --base to the model it was trained on)",
                            plan_.base_dir, module, names));
  }

  // A [E, r, in] (or a shared [r, in]), B [E, out, r] of `experts.projection`; projection
  // gate_proj, up_proj, down_proj or the fused gate_up_proj (lora.expert_gate_up: fused).
  void add_routed_experts(const std::string& module, const Shape& a, const Shape& b) {
    const AdapterName n = split_adapter_name(module + ".lora_A.weight");
    const std::string& experts = n.module;
    const std::string& projection = n.projection;
    const bool shared_a = a.ndim() == 2;
    const int64_t count = b[0], out = b[1], rank = shared_a ? a[0] : a[1], in = a[a.ndim() - 1];
    MOETRAIN_CHECK((shared_a || (a.ndim() == 3 && a[0] == count)) && b[2] == rank, ExitCode::kBadCheckpoint,
                   fmt::format("{}: routed-expert adapter {} has A {} and B {}", reader_.path(), module, a.str(),
                               b.str()));
    const bool fused = projection == "gate_up_proj";
    const double scale = settings_.of(module, rank, fused).scale();
    const bool down = projection == "down_proj";
    // Where each expert's delta rows go: [gate | up] halves of a gate_up weight.
    struct Part {
      const char* projection;  // the per-expert tensor's
      int64_t delta_row, rows, fused_row;  // fused_row: offset in the fused gate_up_proj's rows
    };
    std::vector<Part> parts;
    if (fused) {
      parts = {{"gate_proj", 0, out / 2, 0}, {"up_proj", out / 2, out / 2, out / 2}};
    } else {
      parts = {{projection.c_str(), 0, out, projection == "up_proj" ? out : 0}};
    }
    const int64_t fused_rows = down ? out : (fused ? out : 2 * out);
    const std::string fused_name = stored(experts + (down ? ".down_proj" : ".gate_up_proj"));
    std::vector<std::string> tried = {"\"" + experts + (down ? ".down_proj" : ".gate_up_proj") + "\""};
    if (!fused_name.empty()) {  // transformers 5: [E, 2F, D] / [E, D, F]
      const OutputTensor& t = plan_.tensors.at(fused_name);
      MOETRAIN_CHECK(t.shape.ndim() == 3 && t.shape == Shape({count, fused_rows, in}), ExitCode::kBadCheckpoint,
                     fmt::format("{}: tensor \"{}\" has shape {} but adapter {} needs [{}, {}, {}]: the checkpoint was "
                                 "not trained on this base model",
                                 plan_.base_dir, t.name, t.shape.str(), module, count, fused_rows, in));
      for (int64_t e = 0; e < count; ++e)
        for (const Part& p : parts)
          plan_.deltas[t.name].push_back(
              Contribution{module, e, scale, p.delta_row, e * fused_rows + p.fused_row, p.rows});
      return;
    }
    // Per-expert tensors: the first naming (ours, Moonshot's) whose expert 0 the base has.
    const std::vector<std::string> first = hf_expert_names(experts, 0, parts.front().projection);
    size_t naming = 0;
    while (naming < first.size() && stored(first[naming]).empty()) {
      tried.push_back("\"" + first[naming] + "\"");
      ++naming;
    }
    if (naming == first.size()) not_found(module, tried);
    for (int64_t e = 0; e < count; ++e) {
      for (const Part& p : parts) {
        const std::string name = stored(hf_expert_names(experts, e, p.projection)[naming]);
        if (name.empty()) not_found(module, {"\"" + hf_expert_names(experts, e, p.projection)[naming] + "\""});
        const OutputTensor& t = plan_.tensors.at(name);
        MOETRAIN_CHECK(t.shape == Shape({p.rows, in}), ExitCode::kBadCheckpoint,
                       fmt::format("{}: tensor \"{}\" has shape {} but adapter {} gives expert {} a [{}, {}] delta: the "
                                   "checkpoint was not trained on this base model",
                                   plan_.base_dir, t.name, t.shape.str(), module, e, p.rows, in));
        plan_.deltas[name].push_back(Contribution{module, e, scale, p.delta_row, 0, p.rows});
      }
    }
  }

  const CheckpointReader& reader_;
  ModuleSettings settings_;
  MergePlan& plan_;
};

std::string shard_name(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

// The output files: the base's own (a lone model.safetensors as one shard), or tensors in name
// order cut at max_shard_bytes.
void plan_shards(const HfCheckpoint& base, uint64_t max_shard_bytes, MergePlan& plan) {
  if (max_shard_bytes == 0) {
    std::map<std::string, std::vector<std::string>> by_file;
    for (const auto& [name, t] : plan.tensors) {
      const std::string file = fs::path(base.file_of(t.packed.empty() ? name : t.packed)).filename().string();
      by_file[file].push_back(name);
    }
    for (auto& [file, names] : by_file) {
      plan.shards.push_back({base.sharded() ? file : shard_name(0, 1), names});
    }
    return;
  }
  std::vector<std::vector<std::string>> groups;
  uint64_t filled = 0;
  for (const auto& [name, t] : plan.tensors) {
    const uint64_t bytes = static_cast<uint64_t>(t.shape.numel()) * dtype_size(t.dtype);
    if (groups.empty() || (filled > 0 && filled + bytes > max_shard_bytes)) {
      groups.emplace_back();
      filled = 0;
    }
    groups.back().push_back(name);
    filled += bytes;
  }
  for (size_t i = 0; i < groups.size(); ++i) plan.shards.push_back({shard_name(i, groups.size()), groups[i]});
}

MergePlan make_plan(const CheckpointReader& reader, const Config& config, const std::string& base_dir,
                    uint64_t max_shard_bytes) {
  MergePlan plan;
  plan.base_dir = base_dir;
  HfCheckpoint base(base_dir);
  plan.tensors = output_tensors(base, plan.decoded_mxfp4);
  std::set<std::string> modules;
  for (const std::string& key : reader.keys()) {
    MOETRAIN_CHECK(key.rfind(kParamKind, 0) != 0 || key.find(".lora_") != std::string::npos, ExitCode::kBadCheckpoint,
                   fmt::format("{}: trainable tensor {} is not a LoRA factor, and merge folds in LoRA adapters only",
                               reader.path(), key));
  }
  for (const std::string& name : checkpoint_adapter_names(reader)) modules.insert(name.substr(0, name.rfind(".lora_")));
  MOETRAIN_CHECK(!modules.empty(), ExitCode::kBadCheckpoint, reader.path() + ": holds no LoRA adapters to merge");
  DeltaPlanner planner(reader, config, plan);
  for (const std::string& module : modules) planner.add_module(module);
  plan_buffers(reader, base, plan);
  plan_shards(base, max_shard_bytes, plan);
  return plan;
}

// out[rows, in] += scale * B[rows, r] A[r, in], rows split over the host's cores when large.
void add_product(double* out, const double* b, const double* a, int64_t rows, int64_t rank, int64_t in, double scale) {
  auto work = [=](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      double* row = out + o * in;
      for (int64_t k = 0; k < rank; ++k) {
        const double w = scale * b[o * rank + k];
        const double* a_row = a + k * in;
        for (int64_t i = 0; i < in; ++i) row[i] += w * a_row[i];
      }
    }
  };
  const int64_t threads =
      std::clamp<int64_t>(rows * rank * in / (1 << 22), 1, std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 1) return work(0, rows);
  std::vector<std::thread> workers;
  for (int64_t t = 0; t < threads; ++t) workers.emplace_back(work, rows * t / threads, rows * (t + 1) / threads);
  for (std::thread& w : workers) w.join();
}

// One output tensor's values: the base's, decoded if packed, plus its adapters' deltas.
Tensor merged_tensor(const HfCheckpoint& base, const CheckpointReader& reader, const OutputTensor& t,
                     const std::vector<Contribution>& deltas) {
  Tensor values = t.packed.empty() ? base.read_as(t.name, DType::kF64) : Tensor(t.shape, DType::kF64);
  if (!t.packed.empty()) {
    const Tensor packed = base.read_as(t.packed, DType::kU8);
    const Tensor scales = base.read_as(t.name + "_scale", DType::kU8);
    kernels::mxfp4_dequantize(values.view(), packed.view(), scales.view());
  }
  const int64_t in = t.shape[t.shape.ndim() - 1];
  for (const Contribution& c : deltas) {
    const std::string a_key = kParamKind + c.module + ".lora_A.weight";
    const std::string b_key = kParamKind + c.module + ".lora_B.weight";
    const bool routed = c.expert >= 0;
    const bool shared_a = routed && reader.global_shape(a_key).ndim() == 2;
    Tensor a = routed && !shared_a ? reader.read_rows(a_key, c.expert, c.expert + 1, DType::kF64)
                                   : reader.read(a_key, DType::kF64);
    Tensor b = routed ? reader.read_rows(b_key, c.expert, c.expert + 1, DType::kF64) : reader.read(b_key, DType::kF64);
    const int64_t rank = b.shape()[b.shape().ndim() - 1];
    MOETRAIN_ASSERT(a.numel() == rank * in && (c.tensor_row + c.rows) * in <= values.numel(),
                    "merge: " + c.module + " does not fit " + t.name);
    add_product(values.ptr<double>() + c.tensor_row * in, b.ptr<double>() + c.delta_row * rank, a.ptr<double>(),
                c.rows, rank, in, c.scale);
  }
  for (int64_t i = 0; i < values.numel() && !deltas.empty(); ++i) {
    MOETRAIN_CHECK(std::isfinite(values.ptr<double>()[i]), ExitCode::kBadCheckpoint,
                   fmt::format("{}: merged tensor \"{}\" has a non-finite value at element {} (base or adapter {} "
                               "not finite)",
                               reader.path(), t.name, i, deltas.front().module));
  }
  Tensor out(t.shape, t.dtype);
  convert_host(out.view(), values.view());
  return out;
}

void write_shard(const HfCheckpoint& base, const CheckpointReader& reader, const MergePlan& plan,
                 const MergePlan::Shard& shard, const std::string& dir) {
  std::vector<SafetensorsStreamWriter::Declared> declared;
  for (const std::string& name : shard.tensors) {
    const OutputTensor& t = plan.tensors.at(name);
    declared.push_back({name, t.dtype, t.shape});
  }
  SafetensorsStreamWriter writer((fs::path(dir) / shard.file).string(), declared, {{"format", "pt"}});
  for (const std::string& name : writer.order()) {
    watchdog_progress("merge: " + name);
    const OutputTensor& t = plan.tensors.at(name);
    const auto deltas = plan.deltas.find(name);
    if (const auto buffer = plan.buffers.find(name); buffer != plan.buffers.end()) {
      const Tensor trained = reader.read(buffer->second, DType::kF64);
      Tensor out(t.shape, t.dtype);
      convert_host(out.view(), trained.view());
      writer.write_next(name, out.view());
      continue;
    }
    if (deltas == plan.deltas.end() && t.packed.empty()) {
      writer.write_next(name, base.file_for(name).view(name));  // untouched: the base's bytes
      continue;
    }
    const Tensor merged =
        merged_tensor(base, reader, t, deltas == plan.deltas.end() ? std::vector<Contribution>{} : deltas->second);
    writer.write_next(name, merged.view());
  }
  writer.finish();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOETRAIN_CHECK(static_cast<bool>(in), ExitCode::kBadCheckpoint, "cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Weights of any format the merged directory must not carry unmerged.
bool is_weight_file(const std::string& name) {
  for (const char* ext : {".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf",
                          ".ckpt", ".h5", ".msgpack"})
    if (ends_with(name, ext)) return true;
  return false;
}

// config.json (without quantization_config when MXFP4 was decoded), the base's other files,
// then the index: rank 0, after every shard is written.
void write_directory_files(const MergePlan& plan, const std::string& tmp) {
  std::string config = read_text((fs::path(plan.base_dir) / "config.json").string());
  if (plan.decoded_mxfp4) {
    Json json = Json::parse(config);
    json.erase("quantization_config");
    if (json.contains("text_config") && json["text_config"].is_object()) json["text_config"].erase("quantization_config");
    config = json.dump(2) + "\n";
  }
  write_text_durably((fs::path(tmp) / "config.json").string(), config);
  for (const fs::directory_entry& entry : fs::directory_iterator(plan.base_dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == "config.json" || is_weight_file(name) || name[0] == '.') continue;
    write_text_durably((fs::path(tmp) / name).string(), read_text(entry.path().string()));
  }
  Json weight_map = Json::object();
  uint64_t total = 0;
  for (const MergePlan::Shard& shard : plan.shards) {
    for (const std::string& name : shard.tensors) {
      const OutputTensor& t = plan.tensors.at(name);
      weight_map[name] = shard.file;
      total += static_cast<uint64_t>(t.shape.numel()) * dtype_size(t.dtype);
    }
  }
  const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_durably((fs::path(tmp) / HfCheckpoint::kIndexFileName).string(), index.dump(2) + "\n");
}

bool is_empty_directory(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::directory_iterator(path, ec) == fs::directory_iterator();
}

}  // namespace

uint64_t parse_byte_size(const std::string& text, const std::string& what) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) ++digits;
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, double> units = {{"", 1.0},      {"B", 1.0},          {"KB", 1e3},
                                               {"MB", 1e6},    {"GB", 1e9},         {"TB", 1e12},
                                               {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  double value = 0.0;
  bool ok = digits > 0 && units.count(unit) != 0;
  if (ok) {
    try {
      value = std::stod(text.substr(0, digits)) * units.at(unit);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  MOETRAIN_CHECK(ok && value >= 1.0, ExitCode::kBadConfig,
                 fmt::format("{} `{}` is not a size: give bytes or a number with KB, MB, GB (or KiB, MiB, GiB), e.g. "
                             "5GB",
                             what, text));
  return static_cast<uint64_t>(value);
}

void merge_checkpoint(CheckpointGroup& group, const MergeOptions& options) {
  const fs::path out = fs::path(options.out_dir).lexically_normal();
  const fs::path tmp = out.string() + ".tmp";
  agree(group, "checking --out " + out.string(), [&] {
    if (!group.is_root()) return;
    std::error_code ec;
    MOETRAIN_CHECK(!fs::exists(out, ec) || is_empty_directory(out), ExitCode::kBadConfig,
                   fmt::format("--out {} exists and is not an empty directory: merge never overwrites; choose another "
                               "--out or remove it",
                               out.string()));
  });

  std::unique_ptr<CheckpointReader> reader;
  std::unique_ptr<HfCheckpoint> base;
  MergePlan plan;
  agree(group, "reading the checkpoint and the base model", [&] {
    reader = std::make_unique<CheckpointReader>(resolve_checkpoint_path(options.checkpoint));
    const Config config = parse_config(reader->manifest().config_yaml, reader->path() + "/manifest.json (config)");
    const std::optional<std::string> base_dir = options.base_dir ? options.base_dir : config.model.hf_dir;
    MOETRAIN_CHECK(base_dir.has_value(), ExitCode::kBadConfig,
                   reader->path() + " was trained on random base weights (no model.hf_dir): there is no base model to "
                                    "merge into (give one with --base HF_DIR)");
    base = std::make_unique<HfCheckpoint>(*base_dir);
    plan = make_plan(*reader, config, *base_dir, options.max_shard_bytes);
  });

  agree(group, "creating " + tmp.string(), [&] {
    if (!group.is_root()) return;
    std::error_code ec;
    if (fs::exists(tmp, ec)) {
      MOETRAIN_CHECK(fs::exists(tmp / kInProgressMarker, ec), ExitCode::kBadConfig,
                     fmt::format("{} exists and is not a merge's leftover: move it away or choose another --out",
                                 tmp.string()));
      fs::remove_all(tmp, ec);  // an interrupted merge's
    }
    fs::create_directories(tmp, ec);
    MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                   fmt::format("cannot create {}: {} (choose a writable --out)", tmp.string(), ec.message()));
    write_text_durably((tmp / kInProgressMarker).string(), "moetrain merge\n");
  });

  agree(group, "writing the shards", [&] {
    for (size_t i = static_cast<size_t>(group.rank()); i < plan.shards.size(); i += static_cast<size_t>(group.world())) {
      write_shard(*base, *reader, plan, plan.shards[i], tmp.string());
      log::info(fmt::format("merge: wrote {} ({} tensors)", plan.shards[i].file, plan.shards[i].tensors.size()));
    }
  });

  agree(group, "committing " + out.string(), [&] {
    if (!group.is_root()) return;
    write_directory_files(plan, tmp.string());
    std::error_code ec;
    fs::remove(tmp / kInProgressMarker, ec);
    if (fs::exists(out, ec)) fs::remove(out, ec);  // an empty directory (checked above)
    rename_durably(tmp.string(), out.string());
    size_t merged = plan.deltas.size();
    log::info(fmt::format("merged model written to {}: {} tensors in {} shard(s), {} changed by the adapters of {}{}",
                          out.string(), plan.tensors.size(), plan.shards.size(), merged, reader->path(),
                          plan.decoded_mxfp4 ? "; MXFP4 experts written as BF16 (quantization_config removed)" : ""));
  });
}

}  // namespace moetrain
