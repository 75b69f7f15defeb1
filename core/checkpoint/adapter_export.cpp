#include "core/checkpoint/adapter_export.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/checkpoint_directory.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/checkpoint/checkpoint_reader.h"
#include "core/config/lora_patterns.h"
#include "core/io/safetensors_writer.h"
#include "core/model/peft_format.h"
#include "core/model/swiglu_experts.h"

namespace moetrain {
namespace fs = std::filesystem;

namespace {

using Json = nlohmann::json;

// A regex that matches exactly `text`.
std::string escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') out += '\\';
    out += c;
  }
  return out;
}

// A module as PEFT names it when it applies rank_pattern / alpha_pattern: `key`, a regex matching
// exactly its name(s), and `tail`, the last component(s) of that name (gate_proj, gate_proj.weight).
struct PeftModule {
  std::string key, tail;
  int64_t rank = 0;
  double alpha = 0.0;
};


// rank_pattern / alpha_pattern giving every module its rank and alpha under PEFT's rule
// (first matching key): one key `.*\.<tail>` for a tail whose modules all agree, else one key per
// module; none for a module at the default. No two keys select the same module, so the order of
// the keys (JSON objects are written sorted) does not matter.
void write_patterns(const std::vector<PeftModule>& modules, int64_t rank, double alpha, PatternMap<int64_t>& rank_pattern,
                    PatternMap<double>& alpha_pattern) {
  std::map<std::string, int64_t> ranks;
  std::map<std::string, double> alphas;
  std::map<std::string, std::vector<const PeftModule*>> by_tail;
  for (const PeftModule& m : modules) by_tail[m.tail].push_back(&m);
  for (const auto& entry : by_tail) {
    // Named references, not a structured binding: a lambda may not capture one before C++20.
    const std::string& tail = entry.first;
    const std::vector<const PeftModule*>& members = entry.second;
    auto fill = [&](auto& pattern, auto value_of, auto default_value) {
      bool uniform = true;
      for (const PeftModule* m : members) uniform &= value_of(*m) == value_of(*members.front());
      if (uniform) {
        if (value_of(*members.front()) != default_value) pattern[".*\\." + escaped(tail)] = value_of(*members.front());
        return;
      }
      for (const PeftModule* m : members)
        if (value_of(*m) != default_value) pattern[m->key] = value_of(*m);
    };
    fill(ranks, [](const PeftModule& m) { return m.rank; }, rank);
    fill(alphas, [](const PeftModule& m) { return m.alpha; }, alpha);
  }
  rank_pattern.assign(ranks.begin(), ranks.end());
  alpha_pattern.assign(alphas.begin(), alphas.end());
}

// A shared expert A [r, in] (lora.expert_a: shared) repeated for every expert of its B [E, out, r]:
// PEFT's expert adapters have one A per expert. Other tensors are passed through.
std::vector<std::pair<std::string, TensorView>> expand_shared_a(
    const std::vector<std::pair<std::string, TensorView>>& params, std::vector<Tensor>& keep) {
  std::map<std::string, TensorView> by_name(params.begin(), params.end());
  std::vector<std::pair<std::string, TensorView>> out;
  for (const auto& [name, value] : params) {
    const size_t factor = name.rfind(".lora_A.weight");
    if (value.ndim() != 2 || factor == std::string::npos || name.find(".mlp.experts.") == std::string::npos) {
      out.emplace_back(name, value);
      continue;
    }
    const auto b = by_name.find(name.substr(0, factor) + ".lora_B.weight");
    MOETRAIN_ASSERT(b != by_name.end() && b->second.ndim() == 3, "shared expert A " + name + " without its 3-D B");
    const int64_t experts = b->second.size(0), block = value.numel();
    keep.emplace_back(Shape{experts, value.size(0), value.size(1)}, DType::kF32);
    for (int64_t e = 0; e < experts; ++e)
      std::copy(value.ptr<float>(), value.ptr<float>() + block, keep.back().ptr<float>() + e * block);
    out.emplace_back(name, keep.back().view());
  }
  return out;
}

// kTransformers5: the routed experts' stacked adapters as PEFT's 3-D adapters on the fused
// gate_up_proj and on down_proj. gate_up_proj's adapter: the model's fused one as it is, or its
// separate gate and up adapters (ranks r_g, r_u, alphas a_g, a_u) as one of rank r_g + r_u and
// alpha a_g + a_u (2r and 2 alpha when they agree, as PEFT writes its fused form) with
// A = [A_gate; A_up] and a block-diagonal B, each block scaled so that PEFT's scale for the pair
// gives the model's function (a factor 1 without rsLoRA and equal settings, 1/sqrt 2 with rsLoRA).
void fused_expert_adapters(SafetensorsWriter& writer, std::vector<Tensor>& keep, std::set<std::string>& target_parameters,
                           std::vector<PeftModule>& modules, ModuleSettings& module_settings,
                           const std::vector<std::pair<std::string, TensorView>>& params, bool rslora) {
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
    auto add_fused = [&](const std::string& a_key, const TensorView& a, const std::string& b_key, const TensorView& b) {
      keep.push_back(peft_fused_a(a));
      writer.add(a_key, keep.back().view());
      keep.push_back(peft_fused_b(b));
      writer.add(b_key, keep.back().view());
    };
    // With both targeted, PEFT nests gate_up_proj (inner: base_layer) inside down_proj.
    const std::string gate_up_a = peft_fused_gate_up_key(module, has_down, "lora_A.weight");
    const std::string gate_up_b = peft_fused_gate_up_key(module, has_down, "lora_B.weight");
    if (has_fused) {  // lora.expert_gate_up: fused: already PEFT's adapter
      const TensorView& a = f.at("gate_up_proj.lora_A.weight");
      const LoraSettings s = module_settings.of(module + ".gate_up_proj", a.size(1), /*fused=*/true);
      add_fused(gate_up_a, a, gate_up_b, f.at("gate_up_proj.lora_B.weight"));
      target_parameters.insert("mlp.experts.gate_up_proj");
      modules.push_back({escaped(module + ".gate_up_proj"), "gate_up_proj", s.rank, s.alpha});
    }
    if (has_gate_up) {  // separate gate and up adapters side by side
      const TensorView& ag = f.at("gate_proj.lora_A.weight");
      const TensorView& au = f.at("up_proj.lora_A.weight");
      const TensorView& bg = f.at("gate_proj.lora_B.weight");
      const TensorView& bu = f.at("up_proj.lora_B.weight");
      const LoraSettings gate = module_settings.of(module + ".gate_proj", ag.size(1));
      const LoraSettings up = module_settings.of(module + ".up_proj", au.size(1));
      const LoraSettings pair{gate.rank + up.rank, gate.alpha + up.alpha, rslora};
      const ExpertStacks side_by_side =
          gate_up_side_by_side(ag, bg, au, bu, gate.scale() / pair.scale(), up.scale() / pair.scale());
      add_fused(gate_up_a, side_by_side.a.view(), gate_up_b, side_by_side.b.view());
      target_parameters.insert("mlp.experts.gate_up_proj");
      modules.push_back({escaped(module + ".gate_up_proj"), "gate_up_proj", pair.rank, pair.alpha});
    }
    if (has_down) {
      const TensorView& a = f.at("down_proj.lora_A.weight");
      const LoraSettings s = module_settings.of(module + ".down_proj", a.size(1));
      add_fused(peft_fused_down_key(module, "lora_A.weight"), a, peft_fused_down_key(module, "lora_B.weight"),
                f.at("down_proj.lora_B.weight"));
      target_parameters.insert("mlp.experts.down_proj");
      modules.push_back({escaped(module + ".down_proj"), "down_proj", s.rank, s.alpha});
    }
  }
}

}  // namespace

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

ModuleSettings::ModuleSettings(const AdapterExportSettings& s)
    : ranks_(std::make_unique<LoraRanks>(s.rank, s.alpha, s.rank_pattern, s.alpha_pattern)), rslora_(s.rslora) {}
ModuleSettings::~ModuleSettings() = default;

LoraSettings ModuleSettings::of(const std::string& module, int64_t rank, bool fused) {
  const ModuleLora m = fused ? ranks_->fused_gate_up(module.substr(0, module.rfind('.'))) : ranks_->module(module);
  MOETRAIN_CHECK(m.rank == rank, ExitCode::kBadConfig,
                 fmt::format("{}: the adapter has rank {} but lora.rank and lora.rank_pattern give this module "
                             "rank {}: export it with the settings it was trained with",
                             module, rank, m.rank));
  return LoraSettings{m.rank, m.alpha, rslora_};
}

std::vector<std::string> checkpoint_adapter_names(const CheckpointReader& reader) {
  std::vector<std::string> names;
  const std::string prefix = kParamKind;
  for (const std::string& key : reader.keys()) {
    // LoRA factors only: other trainable tensors (an unfrozen router) are not part of an adapter.
    if (key.rfind(prefix, 0) != 0 || key.find(".lora_") == std::string::npos) continue;
    names.push_back(key.substr(prefix.size()));
  }
  return names;
}

AdapterExportSettings adapter_export_settings(const Config& config) {
  AdapterExportSettings s;
  s.rank = config.lora.rank;
  s.alpha = config.lora.alpha;
  s.rslora = config.lora.rslora;
  s.rank_pattern = config.lora.rank_pattern;
  s.alpha_pattern = config.lora.alpha_pattern;
  s.base_model = config.model.hf_dir;
  const std::string& layout = config.checkpoint.export_layout;
  s.layout = layout == "per_expert" ? AdapterLayout::kPerExpert
             : layout == "released" ? AdapterLayout::kReleased
                                    : AdapterLayout::kTransformers5;
  // Kimi K3's checkpoint keeps its text model under language_model.: the model type is the
  // config's, or the imported directory's.
  std::string model_type = config.model.model_type;
  if (config.model.hf_dir) {
    std::ifstream in(*config.model.hf_dir + "/config.json");
    if (in) model_type = Json::parse(in, nullptr, /*allow_exceptions=*/false).value("model_type", model_type);
  }
  s.text_under_language_model = model_type == "kimi_k3";
  return s;
}

void write_peft_adapter(const std::string& out_dir, const std::vector<std::pair<std::string, TensorView>>& given,
                        const AdapterExportSettings& settings) {
  std::error_code ec;
  MOETRAIN_CHECK(!fs::exists(fs::path(out_dir) / kManifestName, ec), ExitCode::kBadConfig,
                 "export directory " + out_dir + " is a checkpoint (holds manifest.json): choose another --out");
  fs::create_directories(out_dir, ec);
  // The output directory is the user's choice: one that cannot be made is exit 2, not a bad checkpoint.
  MOETRAIN_CHECK(!ec, ExitCode::kBadConfig,
                 "cannot create the adapter directory " + out_dir + ": " + ec.message() +
                     " (choose another --out or checkpoint.export_adapter, or check its permissions)");

  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");  // what PEFT's save_pretrained writes
  std::set<std::string> target_modules, target_parameters;
  std::vector<Tensor> fused;  // expanded shared A's and kTransformers5's re-laid factors, alive until written
  const std::vector<std::pair<std::string, TensorView>> params = expand_shared_a(given, fused);
  ModuleSettings module_settings(settings);
  std::vector<PeftModule> modules;
  const bool transformers5 = settings.layout == AdapterLayout::kTransformers5;
  // Module paths as the adapter names them: ours, or the released checkpoint's (kReleased).
  auto named = [&](const std::string& module) {
    return settings.layout == AdapterLayout::kReleased ? released_module_name(module, settings.text_under_language_model)
                                                       : module;
  };
  if (transformers5) fused_expert_adapters(writer, fused, target_parameters, modules, module_settings, params, settings.rslora);
  for (const auto& [name, value] : params) {
    MOETRAIN_ASSERT(value.device == Device::kCPU, "adapter tensor " + name + " is not on the host");
    AdapterName n = split_adapter_name(name);
    if (transformers5 && value.ndim() == 3) continue;  // written above
    const std::string module = name.substr(0, name.rfind(".lora_"));
    const bool is_a = n.factor == "lora_A.weight";
    if (transformers5 && n.module.find(".mlp") != std::string::npos) {
      target_parameters.insert(n.projection + ".weight");  // dense MLP / shared experts
      if (is_a) {
        const LoraSettings s = module_settings.of(module, value.size(0));
        modules.push_back({escaped(module + ".weight"), n.projection + ".weight", s.rank, s.alpha});
      }
    } else {
      if (value.ndim() == 2) target_modules.insert(n.projection);  // experts' below, in the layout's names
      if (is_a && value.ndim() == 2) {
        const LoraSettings s = module_settings.of(module, value.size(0));
        modules.push_back({escaped(named(module)), n.projection, s.rank, s.alpha});
      }
    }
    if (value.ndim() == 2) {
      writer.add(peft_key(named(module) + "." + n.factor), value);
      continue;
    }
    // A stacked routed-expert adapter: expert e's 2-D factor is row block e (views, no copy).
    MOETRAIN_ASSERT(value.ndim() == 3, "adapter tensor " + name + " is neither 2-D nor stacked 3-D");
    MOETRAIN_CHECK(n.projection != "gate_up_proj", ExitCode::kBadConfig,
                   name + ": the per_expert adapter layout has no key for a gate_up adapter shared by gate and up "
                          "(lora.expert_gate_up: fused); export it with checkpoint.export_layout: transformers5");
    // Expert e's module: <module>.<e>.<projection> (released: block_sparse_moe.experts.<e>.w1 ...).
    const std::string expert0 = named(n.module + ".0." + n.projection);
    const std::string projection = expert0.substr(expert0.rfind('.') + 1);
    const std::string experts_module = expert0.substr(0, expert0.rfind(".0."));
    target_modules.insert(projection);
    if (is_a) {  // every expert's module at once
      const LoraSettings s = module_settings.of(module, value.size(1));
      modules.push_back({escaped(experts_module) + "\\.[0-9]+\\." + escaped(projection), projection, s.rank, s.alpha});
    }
    for (int64_t e = 0; e < value.size(0); ++e) {
      const std::string key = peft_key(fmt::format("{}.{}.{}.{}", experts_module, e, projection, n.factor));
      writer.add(key, value.slice_rows(e, e + 1).reshaped({value.size(1), value.size(2)}));
    }
  }
  PeftAdapterConfig config;
  config.rank = settings.rank;
  config.alpha = settings.alpha;
  config.rslora = settings.rslora;
  config.target_modules.assign(target_modules.begin(), target_modules.end());
  config.target_parameters.assign(target_parameters.begin(), target_parameters.end());
  config.base_model = settings.base_model;
  write_patterns(modules, settings.rank, settings.alpha, config.rank_pattern, config.alpha_pattern);
  writer.write_atomic((fs::path(out_dir) / kPeftWeightsFile).string());
  write_text_durably((fs::path(out_dir) / kPeftConfigFile).string(), peft_adapter_config_text(config));
  log::info(fmt::format("PEFT adapter written to {} ({} tensors)", out_dir, writer.size()));
}

const std::vector<std::string>& export_override_keys() {
  static const std::vector<std::string> keys = {"checkpoint.export_layout"};
  return keys;
}

void export_checkpoint_adapter(const std::string& checkpoint, const std::string& out_dir,
                               const std::vector<std::string>& overrides) {
  // Only the export's own settings may change: the LoRA shape and the model are the checkpoint's,
  // and any other key would be silently ignored.
  const std::vector<std::string>& allowed = export_override_keys();
  for (const std::string& text : overrides) {
    const std::string key = text.substr(0, text.find('='));
    MOETRAIN_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(), ExitCode::kBadConfig,
                   fmt::format("command line: --set {}: `moetrain export` takes only the export's settings ({}); the "
                               "LoRA settings and the model are the checkpoint's own",
                               text, fmt::join(allowed, ", ")));
  }
  CheckpointReader reader(resolve_checkpoint_path(checkpoint));
  Config config = parse_config(reader.manifest().config_yaml, reader.path() + "/manifest.json (config)", overrides);
  std::vector<Tensor> values;
  const std::vector<std::string> names = checkpoint_adapter_names(reader);
  for (const std::string& name : names) values.push_back(reader.read(kParamKind + name, DType::kF32));
  MOETRAIN_CHECK(!values.empty(), ExitCode::kBadCheckpoint, reader.path() + ": holds no trainable parameters");
  std::vector<std::pair<std::string, TensorView>> params;
  for (size_t i = 0; i < values.size(); ++i) params.emplace_back(names[i], values[i].view());
  write_peft_adapter(out_dir, params, adapter_export_settings(config));
  // A PEFT adapter holds LoRA factors only (vLLM refuses modules it does not expect): the
  // selection biases of aux-loss-free balancing stay out, and the merged export carries them.
  size_t buffers = 0;
  for (const std::string& key : reader.keys()) buffers += key.rfind(kBufferKind, 0) == 0 ? 1 : 0;
  if (buffers > 0) {
    log::warn(fmt::format("{}: the adapter does not carry the {} expert selection bias(es) the run trained "
                          "(model.moe.bias_update_rate): served with it, the model routes with the base's bias. "
                          "To serve the trained routing, use the merged export (`moetrain merge {}`), which writes them",
                          out_dir, buffers, reader.path()));
  }
}

}  // namespace moetrain
