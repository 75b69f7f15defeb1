#include "core/checkpoint/adapter_export.h"

#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/io/safetensors_writer.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

using Json = nlohmann::json;

constexpr const char* kPeftPrefix = "base_model.model.";

// "model.layers.1.mlp.experts.gate_proj.lora_A.weight" -> ("model.layers.1.mlp.experts",
// "gate_proj", "lora_A.weight").
struct AdapterName {
  std::string module, projection, factor;
};
AdapterName split_adapter_name(const std::string& name) {
  size_t lora = name.rfind(".lora_");
  MOETRAIN_ASSERT(lora != std::string::npos, "not a LoRA parameter name: " + name);
  AdapterName n;
  n.factor = name.substr(lora + 1);
  std::string head = name.substr(0, lora);
  size_t dot = head.rfind('.');
  n.projection = head.substr(dot + 1);
  n.module = dot == std::string::npos ? "" : head.substr(0, dot);
  return n;
}

}  // namespace

AdapterExportSettings adapter_export_settings(const Config& config) {
  AdapterExportSettings s;
  s.rank = config.lora.rank;
  s.alpha = config.lora.alpha;
  s.rslora = config.lora.rslora;
  s.base_model = config.model.hf_dir;
  return s;
}

void write_peft_adapter(const std::string& out_dir, const std::vector<std::pair<std::string, TensorView>>& params,
                        const AdapterExportSettings& settings) {
  std::error_code ec;
  MOETRAIN_CHECK(!fs::exists(fs::path(out_dir) / kManifestName, ec), ExitCode::kBadConfig,
                 "export directory " + out_dir + " is a checkpoint (holds manifest.json): choose another --out");
  fs::create_directories(out_dir, ec);
  MOETRAIN_CHECK(!ec, ExitCode::kBadCheckpoint, "cannot create adapter directory " + out_dir + ": " + ec.message());

  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");  // what PEFT's save_pretrained writes
  std::set<std::string> target_modules;
  for (const auto& [name, value] : params) {
    MOETRAIN_ASSERT(value.device == Device::kCPU, "adapter tensor " + name + " is not on the host");
    AdapterName n = split_adapter_name(name);
    target_modules.insert(n.projection);
    if (value.ndim() == 2) {
      writer.add(kPeftPrefix + name, value);
      continue;
    }
    // A stacked routed-expert adapter: expert e's 2-D factor is row block e (views, no copy).
    MOETRAIN_ASSERT(value.ndim() == 3, "adapter tensor " + name + " is neither 2-D nor stacked 3-D");
    for (int64_t e = 0; e < value.size(0); ++e) {
      std::string key = fmt::format("{}{}.{}.{}.{}", kPeftPrefix, n.module, e, n.projection, n.factor);
      writer.add(key, value.slice_rows(e, e + 1).reshaped({value.size(1), value.size(2)}));
    }
  }
  writer.write_atomic((fs::path(out_dir) / "adapter_model.safetensors").string());

  Json config = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"r", settings.rank},
                 {"lora_alpha", settings.alpha},
                 {"use_rslora", settings.rslora},
                 {"lora_dropout", 0.0},
                 {"bias", "none"},
                 {"fan_in_fan_out", false},
                 {"init_lora_weights", true},
                 {"inference_mode", true},
                 {"target_modules", std::vector<std::string>(target_modules.begin(), target_modules.end())},
                 {"base_model_name_or_path", settings.base_model ? Json(*settings.base_model) : Json(nullptr)},
                 {"modules_to_save", nullptr},
                 {"rank_pattern", Json::object()},
                 {"alpha_pattern", Json::object()},
                 {"revision", nullptr}};
  write_text_durably((fs::path(out_dir) / "adapter_config.json").string(), config.dump(2) + "\n");
  log::info(fmt::format("PEFT adapter written to {} ({} tensors)", out_dir, writer.size()));
}

void export_checkpoint_adapter(const std::string& checkpoint, const std::string& out_dir) {
  CheckpointReader reader(resolve_checkpoint_path(checkpoint));
  Config config = parse_config(reader.manifest().config_yaml, reader.path() + "/manifest.json (config)");
  std::vector<Tensor> values;
  std::vector<std::string> names;
  const std::string prefix = kParamKind;
  for (const std::string& key : reader.keys()) {
    // LoRA factors only: other trainable tensors (an unfrozen router) are not part of an adapter.
    if (key.rfind(prefix, 0) != 0 || key.find(".lora_") == std::string::npos) continue;
    names.push_back(key.substr(prefix.size()));
    values.push_back(reader.read(key, DType::kF32));
  }
  MOETRAIN_CHECK(!values.empty(), ExitCode::kBadCheckpoint, reader.path() + ": holds no trainable parameters");
  std::vector<std::pair<std::string, TensorView>> params;
  for (size_t i = 0; i < values.size(); ++i) params.emplace_back(names[i], values[i].view());
  write_peft_adapter(out_dir, params, adapter_export_settings(config));
}

}  // namespace moetrain
