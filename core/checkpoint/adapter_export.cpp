#include "core/checkpoint/adapter_export.h"

#include <fmt/format.h>

#include <algorithm>
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
#include "core/model/swiglu_experts.h"

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

Json unique_sorted(const Json& names) {
  std::set<std::string> set;
  for (const Json& n : names) set.insert(n.get<std::string>());
  return Json(std::vector<std::string>(set.begin(), set.end()));
}

// PEFT's 3-D factors of stacked expert adapters A [E, R, in] / B [E, out, R] (F32): A [E R, in]
// with expert-major rows (the same memory), B [out, R E] with column k E + e. B times `factor`.
Tensor peft_fused_a(const TensorView& a) {
  Tensor out({a.size(0) * a.size(1), a.size(2)}, DType::kF32);
  std::copy(a.ptr<float>(), a.ptr<float>() + out.numel(), out.ptr<float>());
  return out;
}
Tensor peft_fused_b(const TensorView& b, double factor) {
  const int64_t experts = b.size(0), rows = b.size(1), rank = b.size(2);
  Tensor out({rows, rank * experts}, DType::kF32);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t k = 0; k < rank; ++k)
        out.ptr<float>()[(o * rank + k) * experts + e] =
            static_cast<float>(factor * b.ptr<float>()[(e * rows + o) * rank + k]);
  return out;
}

// kTransformers5: the routed experts' stacked adapters as PEFT's 3-D adapters on the fused
// gate_up_proj and on down_proj (rank r). gate_up_proj's adapter has rank 2r and alpha 2 alpha
// (rank_pattern / alpha_pattern): the model's fused one as it is, or its separate gate and up
// adapters as [A_gate; A_up] with a block-diagonal B, scaled so that PEFT's scale for (2r,
// 2 alpha) gives the model's function (a factor 1 without rsLoRA, 1/sqrt 2 with it).
void fused_expert_adapters(SafetensorsWriter& writer, std::vector<Tensor>& keep, Json& target_parameters,
                           const std::vector<std::pair<std::string, TensorView>>& params,
                           const AdapterExportSettings& settings) {
  const int64_t rank = settings.rank;
  const LoraSettings separate{settings.rank, settings.alpha, settings.rslora};
  const double peft_gate_up_scale = fused_gate_up_settings(separate).scale();
  std::map<std::string, std::map<std::string, TensorView>> experts;  // module -> "gate_proj.lora_A.weight" -> value
  for (const auto& [name, value] : params) {
    if (value.ndim() != 3) continue;
    AdapterName n = split_adapter_name(name);
    MOETRAIN_ASSERT(value.dtype == DType::kF32, "adapter tensor " + name + " is not F32");
    experts[n.module][n.projection + "." + n.factor] = value;
  }
  for (auto& [module, f] : experts) {
    const bool has_down = f.count("down_proj.lora_A.weight") != 0;
    const bool has_fused = f.count("gate_up_proj.lora_A.weight") != 0;
    const bool has_gate_up = f.count("gate_proj.lora_A.weight") != 0 && f.count("up_proj.lora_A.weight") != 0;
    MOETRAIN_CHECK(has_gate_up || f.count("gate_proj.lora_A.weight") == f.count("up_proj.lora_A.weight"),
                   ExitCode::kBadConfig,
                   module + ": the transformers 5 adapter layout needs adapters on both gate and up of the routed "
                            "experts (target `experts`), or on neither");
    // With both targeted, PEFT nests gate_up_proj (inner: base_layer) inside down_proj.
    const std::string gate_up_prefix = kPeftPrefix + module + (has_down ? ".base_layer." : ".");
    if (has_fused) {  // lora.expert_gate_up: fused: already PEFT's adapter, rank 2r
      keep.push_back(peft_fused_a(f.at("gate_up_proj.lora_A.weight")));
      writer.add(gate_up_prefix + "lora_A.weight", keep.back().view());
      keep.push_back(peft_fused_b(f.at("gate_up_proj.lora_B.weight"), 1.0));
      writer.add(gate_up_prefix + "lora_B.weight", keep.back().view());
      target_parameters.push_back("mlp.experts.gate_up_proj");
    }
    if (has_gate_up) {  // separate gate and up adapters side by side
      const TensorView& ag = f.at("gate_proj.lora_A.weight");
      const TensorView& au = f.at("up_proj.lora_A.weight");
      const TensorView& bg = f.at("gate_proj.lora_B.weight");
      const TensorView& bu = f.at("up_proj.lora_B.weight");
      const int64_t e_count = ag.size(0), in = ag.size(2), width = bg.size(1), r2 = 2 * rank;
      Tensor a({e_count, r2, in}, DType::kF32);
      Tensor b = Tensor::zeros({e_count, 2 * width, r2}, DType::kF32);
      for (int64_t e = 0; e < e_count; ++e) {
        const int64_t block = rank * in;
        std::copy(ag.ptr<float>() + e * block, ag.ptr<float>() + (e + 1) * block, a.ptr<float>() + 2 * e * block);
        std::copy(au.ptr<float>() + e * block, au.ptr<float>() + (e + 1) * block, a.ptr<float>() + (2 * e + 1) * block);
        for (int64_t o = 0; o < width; ++o)
          for (int64_t k = 0; k < rank; ++k) {
            b.ptr<float>()[(e * 2 * width + o) * r2 + k] = bg.ptr<float>()[(e * width + o) * rank + k];
            b.ptr<float>()[(e * 2 * width + width + o) * r2 + rank + k] = bu.ptr<float>()[(e * width + o) * rank + k];
          }
      }
      keep.push_back(peft_fused_a(a.view()));
      writer.add(gate_up_prefix + "lora_A.weight", keep.back().view());
      keep.push_back(peft_fused_b(b.view(), separate.scale() / peft_gate_up_scale));
      writer.add(gate_up_prefix + "lora_B.weight", keep.back().view());
      target_parameters.push_back("mlp.experts.gate_up_proj");
    }
    if (has_down) {
      keep.push_back(peft_fused_a(f.at("down_proj.lora_A.weight")));
      writer.add(kPeftPrefix + module + ".lora_A.weight", keep.back().view());
      keep.push_back(peft_fused_b(f.at("down_proj.lora_B.weight"), 1.0));
      writer.add(kPeftPrefix + module + ".lora_B.weight", keep.back().view());
      target_parameters.push_back("mlp.experts.down_proj");
    }
  }
}

}  // namespace

AdapterExportSettings adapter_export_settings(const Config& config) {
  AdapterExportSettings s;
  s.rank = config.lora.rank;
  s.alpha = config.lora.alpha;
  s.rslora = config.lora.rslora;
  s.base_model = config.model.hf_dir;
  s.layout = config.checkpoint.export_layout == "per_expert" ? AdapterLayout::kPerExpert : AdapterLayout::kTransformers5;
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
  Json target_parameters = Json::array(), rank_pattern = Json::object(), alpha_pattern = Json::object();
  std::vector<Tensor> fused;  // kTransformers5's re-laid routed-expert factors, alive until written
  if (settings.layout == AdapterLayout::kTransformers5) {
    fused_expert_adapters(writer, fused, target_parameters, params, settings);
    if (std::find(target_parameters.begin(), target_parameters.end(), "mlp.experts.gate_up_proj") !=
        target_parameters.end()) {
      rank_pattern[".*\\.gate_up_proj"] = 2 * settings.rank;
      alpha_pattern[".*\\.gate_up_proj"] = 2 * settings.alpha;
    }
  }
  for (const auto& [name, value] : params) {
    MOETRAIN_ASSERT(value.device == Device::kCPU, "adapter tensor " + name + " is not on the host");
    AdapterName n = split_adapter_name(name);
    if (settings.layout == AdapterLayout::kTransformers5 && value.ndim() == 3) continue;  // written above
    if (settings.layout == AdapterLayout::kTransformers5 && n.module.find(".mlp") != std::string::npos) {
      target_parameters.push_back(n.projection + ".weight");  // dense MLP / shared experts
    } else {
      target_modules.insert(n.projection);
    }
    if (value.ndim() == 2) {
      writer.add(kPeftPrefix + name, value);
      continue;
    }
    // A stacked routed-expert adapter: expert e's 2-D factor is row block e (views, no copy).
    MOETRAIN_ASSERT(value.ndim() == 3, "adapter tensor " + name + " is neither 2-D nor stacked 3-D");
    MOETRAIN_CHECK(n.projection != "gate_up_proj", ExitCode::kBadConfig,
                   name + ": the per_expert adapter layout has no key for a gate_up adapter shared by gate and up "
                          "(lora.expert_gate_up: fused); export it with checkpoint.export_layout: transformers5");
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
                 {"target_parameters", unique_sorted(target_parameters)},
                 {"base_model_name_or_path", settings.base_model ? Json(*settings.base_model) : Json(nullptr)},
                 {"modules_to_save", nullptr},
                 {"rank_pattern", rank_pattern},
                 {"alpha_pattern", alpha_pattern},
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
