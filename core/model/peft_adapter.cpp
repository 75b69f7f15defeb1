#include "core/model/peft_adapter.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "core/base/host_convert.h"
#include "core/io/safetensors.h"
#include "core/model/hf_names.h"
#include "core/model/swiglu_experts.h"

namespace moetrain {
namespace {

using Json = nlohmann::json;

constexpr const char* kPeftPrefix = "base_model.model.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// An adapter key in our names when it was saved under a released checkpoint's (Kimi K3's, as
// NeMo AutoModel saves PEFT adapters): the text model under language_model., the MoE's modules
// under block_sparse_moe, routed experts' projections as w1 / w3 / w2. Other keys are unchanged.
std::string our_adapter_key(std::string key) {
  const std::string text_prefix = std::string(kPeftPrefix) + "language_model.";
  if (key.compare(0, text_prefix.size(), text_prefix) == 0) key = kPeftPrefix + key.substr(text_prefix.size());
  const std::string moe = ".block_sparse_moe.";
  for (size_t at = key.find(moe); at != std::string::npos; at = key.find(moe, at)) key.replace(at, moe.size(), ".mlp.");
  const size_t experts = key.find(".mlp.experts.");
  if (experts != std::string::npos) {
    const size_t index = experts + std::strlen(".mlp.experts.");
    const size_t dot = key.find_first_not_of("0123456789", index);
    if (dot != std::string::npos && dot > index && key[dot] == '.') {
      for (const auto& [released, ours] : {std::pair<const char*, const char*>{".w1.", ".gate_proj."},
                                           {".w3.", ".up_proj."},
                                           {".w2.", ".down_proj."}}) {
        if (key.compare(dot, 4, released) == 0) {
          key.replace(dot, 4, ours);
          break;
        }
      }
    }
  }
  return key;
}

// Reads adapter keys as F64, remembering which were used. A key stored under a released
// checkpoint's names answers to ours too (our_adapter_key).
class AdapterFile {
 public:
  explicit AdapterFile(const std::string& path) : file_(path), path_(path) {
    for (const std::string& stored : file_.names()) {
      const std::string ours = our_adapter_key(stored);
      if (ours != stored && !file_.has(ours)) stored_name_.emplace(ours, stored);
    }
  }

  bool has(const std::string& key) const { return file_.has(key) || stored_name_.count(key) != 0; }
  const std::string& path() const { return path_; }

  Tensor read(const std::string& name, const Shape& expected) {
    auto alias = stored_name_.find(name);
    const std::string& key = alias == stored_name_.end() ? name : alias->second;
    MOETRAIN_CHECK(file_.has(key), ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" is missing (the model has a LoRA adapter there: "
                               "lora.targets or the adapter does not match)",
                               path_, key));
    const Shape& shape = file_.info(key).shape;
    MOETRAIN_CHECK(shape == expected, ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" has shape {} but the model expects {} (check lora.rank "
                               "and the model dimensions)",
                               path_, key, shape.str(), expected.str()));
    used_.insert(key);
    return file_.read_as(key, DType::kF64);
  }

  void check_all_used() const {
    for (const std::string& key : file_.names()) {
      MOETRAIN_CHECK(used_.count(key), ExitCode::kBadCheckpoint,
                     fmt::format("{}: adapter tensor \"{}\" matches no LoRA adapter of the model; add its module "
                                 "to lora.targets",
                                 path_, key));
    }
  }

 private:
  SafetensorsFile file_;
  std::string path_;
  std::set<std::string> used_;
  std::map<std::string, std::string> stored_name_;  // our key -> the file's, where they differ
};

void store(kernels::Backend& backend, Tensor& dst, const TensorView& host_f64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged, host_f64);
  backend.copy(dst, staged);
}

// The routed experts' place: every stack read from the file covers all `total` experts (so every
// key is used and checked on every rank); this rank's parameters hold [first, first + count).
struct ExpertRows {
  int64_t total = 0, first = 0;
};

// Host F64 stacks [E, d0, d1] of every expert.
Tensor read_per_expert(AdapterFile& file, const std::string& module, const std::string& what, const Shape& per_expert,
                       int64_t experts) {
  Tensor out({experts, per_expert[0], per_expert[1]}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e) {
    Tensor one = file.read(peft_key(module + "." + std::to_string(e) + "." + what), per_expert);
    std::memcpy(out.ptr<double>() + e * per_expert.numel(), one.data(), one.nbytes());
  }
  return out;
}

// One factor of PEFT's 3-D adapter, A [E R, in] (rows e R + k) or B [out, R E] (column k E + e),
// as the stack A [E, R, in] or B [E, out, R].
Tensor read_fused(AdapterFile& file, const std::string& key, bool is_a, int64_t rank, int64_t in_or_out,
                  int64_t experts) {
  if (is_a) {  // expert-major rows: the stack is the same memory
    Tensor fused = file.read(key, Shape{experts * rank, in_or_out});
    Tensor out({experts, rank, in_or_out}, DType::kF64);
    std::memcpy(out.data(), fused.data(), out.nbytes());
    return out;
  }
  Tensor fused = file.read(key, Shape{in_or_out, rank * experts});
  Tensor out({experts, in_or_out, rank}, DType::kF64);
  const double* src = fused.ptr<double>();
  double* dst = out.ptr<double>();
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < in_or_out; ++o)
      for (int64_t k = 0; k < rank; ++k) dst[(e * in_or_out + o) * rank + k] = src[(o * rank + k) * experts + e];
  return out;
}

// A gate_up adapter as one adapter on [gate | up] per expert: A [E, R, D], B [E, 2F, R], its
// scale, and the file key of its B (for messages).
struct GateUp {
  Tensor a, b;
  double scale = 1.0;
  std::string key;
  int64_t rank() const { return a.size(1); }
};

// Separate gate and up adapters side by side: A [A_gate; A_up], B block diagonal.
GateUp side_by_side(const Tensor& gate_a, const Tensor& gate_b, const Tensor& up_a, const Tensor& up_b, double scale,
                    std::string key) {
  const int64_t experts = gate_a.size(0), r = gate_a.size(1), in = gate_a.size(2), f = gate_b.size(1);
  GateUp g{Tensor({experts, 2 * r, in}, DType::kF64), Tensor::zeros({experts, 2 * f, 2 * r}, DType::kF64), scale,
           std::move(key)};
  for (int64_t e = 0; e < experts; ++e) {
    const size_t block = static_cast<size_t>(r * in);
    std::memcpy(g.a.ptr<double>() + e * 2 * block, gate_a.ptr<double>() + e * block, block * sizeof(double));
    std::memcpy(g.a.ptr<double>() + (e * 2 + 1) * block, up_a.ptr<double>() + e * block, block * sizeof(double));
    for (int64_t o = 0; o < f; ++o)
      for (int64_t k = 0; k < r; ++k) {
        g.b.ptr<double>()[(e * 2 * f + o) * 2 * r + k] = gate_b.ptr<double>()[(e * f + o) * r + k];
        g.b.ptr<double>()[(e * 2 * f + f + o) * 2 * r + r + k] = up_b.ptr<double>()[(e * f + o) * r + k];
      }
  }
  return g;
}

// Whether the rank-2r B [E, 2F, 2r] is block diagonal: gate rows zero in the up ranks [r, 2r) and
// up rows zero in the gate ranks [0, r).
bool block_diagonal(const Tensor& b, int64_t r) {
  const int64_t experts = b.size(0), rows = b.size(1), f = rows / 2;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < rows; ++o) {
      const int64_t other = o < f ? r : 0;
      for (int64_t k = 0; k < r; ++k)
        if (b.ptr<double>()[(e * rows + o) * 2 * r + other + k] != 0.0) return false;
    }
  return true;
}

// Expert e's A rows [k0, k0 + r) and B rows [o0, o0 + f) x columns [k0, k0 + r), B times
// `factor`: one separate adapter's stacks out of a gate_up one.
std::pair<Tensor, Tensor> take_part(const GateUp& g, int64_t k0, int64_t o0, int64_t r, int64_t f, double factor) {
  const int64_t experts = g.a.size(0), in = g.a.size(2), big_r = g.rank(), rows = g.b.size(1);
  Tensor a({experts, r, in}, DType::kF64), b({experts, f, r}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e) {
    std::memcpy(a.ptr<double>() + e * r * in, g.a.ptr<double>() + (e * big_r + k0) * in,
                static_cast<size_t>(r * in) * sizeof(double));
    for (int64_t o = 0; o < f; ++o)
      for (int64_t k = 0; k < r; ++k)
        b.ptr<double>()[(e * f + o) * r + k] = factor * g.b.ptr<double>()[(e * rows + o0 + o) * big_r + k0 + k];
  }
  return {std::move(a), std::move(b)};
}

// One routed-experts module's stacked adapters (3-D parameters), by "projection.factor", e.g.
// "gate_up_proj.lora_B.weight".
using ExpertParams = std::map<std::string, Parameter*>;

class ExpertLoader {
 public:
  ExpertLoader(AdapterFile& file, const PeftAdapterConfig& config, const std::string& dir, const Model& model,
               kernels::Backend& backend, ExpertRows rows)
      : file_(file), config_(config), dir_(dir), lora_(model.options().lora), backend_(backend), rows_(rows) {
    for (const std::string& target : config.target_parameters) {
      fused_gate_up_ |= ends_with(target, "gate_up_proj");
      fused_down_ |= ends_with(target, "down_proj") && target.find("experts") != std::string::npos;
    }
  }

  void load(const std::string& module, const ExpertParams& params) {
    if (params.count("gate_up_proj.lora_A.weight") || params.count("gate_proj.lora_A.weight")) {
      GateUp source = read_gate_up(module, params);
      if (params.count("gate_up_proj.lora_A.weight")) store_fused(params, source);
      else store_separate(params, source);
    }
    if (params.count("down_proj.lora_A.weight")) load_down(module, params);
  }

 private:
  Parameter& param(const ExpertParams& params, const std::string& what) const { return *params.at(what); }

  void store_rows(Parameter& p, const Tensor& all) {
    store(backend_, p.value, all.view().slice_rows(rows_.first, rows_.first + p.value.size(0)));
  }

  std::string fused_key(const std::string& module, bool down, const char* factor) const {
    // gate_up_proj is the inner wrapper (base_layer) when down_proj is targeted too.
    return peft_key(module + (!down && fused_down_ ? ".base_layer." : ".") + factor);
  }

  // The file's gate_up adapter, whatever its form: per-expert gate and up keys (side by side),
  // or PEFT's fused one of rank R.
  GateUp read_gate_up(const std::string& module, const ExpertParams& params) {
    const bool model_fused = params.count("gate_up_proj.lora_A.weight") != 0;
    const Shape& a_shape = param(params, model_fused ? "gate_up_proj.lora_A.weight" : "gate_proj.lora_A.weight").value.shape();
    const Shape& b_shape = param(params, model_fused ? "gate_up_proj.lora_B.weight" : "gate_proj.lora_B.weight").value.shape();
    const int64_t in = a_shape[2], f = model_fused ? b_shape[1] / 2 : b_shape[1], r = lora_.rank;
    const std::string first_key = peft_key(module + ".0.gate_proj.lora_A.weight");
    if (file_.has(first_key)) {
      auto part = [&](const char* what, const Shape& shape) {
        return read_per_expert(file_, module, what, shape, rows_.total);
      };
      return side_by_side(part("gate_proj.lora_A.weight", {r, in}), part("gate_proj.lora_B.weight", {f, r}),
                          part("up_proj.lora_A.weight", {r, in}), part("up_proj.lora_B.weight", {f, r}),
                          LoraSettings{r, config_.alpha, config_.rslora}.scale(),
                          module + ".<e>.{gate,up}_proj (per expert)");
    }
    MOETRAIN_CHECK(fused_gate_up_, ExitCode::kBadCheckpoint,
                   fmt::format("{}: no adapter for the gate and up projections of {} (neither per-expert keys like "
                               "\"{}\" nor a gate_up_proj entry in target_parameters)",
                               dir_, module, first_key));
    const int64_t big_r = config_.gate_up_rank;
    GateUp g;
    g.key = fused_key(module, false, "lora_B.weight");
    g.a = read_fused(file_, fused_key(module, false, "lora_A.weight"), true, big_r, in, rows_.total);
    g.b = read_fused(file_, g.key, false, big_r, 2 * f, rows_.total);
    g.scale = LoraSettings{big_r, config_.gate_up_alpha, config_.rslora}.scale();
    return g;
  }

  // lora.expert_gate_up: fused: any rank-2r gate_up adapter, B rescaled to the model's scale.
  void store_fused(const ExpertParams& params, GateUp& g) {
    const LoraSettings fused = fused_gate_up_settings(lora_);
    MOETRAIN_CHECK(g.rank() != lora_.rank, ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is a rank-{} gate_up adapter (no rank_pattern: one A shared by gate and "
                               "up), but lora.expert_gate_up: fused holds PEFT's gate_up adapter of rank 2r = {}. Set "
                               "lora.expert_gate_up: separate, which holds this adapter exactly (its A copied into the "
                               "gate and the up adapter)",
                               dir_, g.key, g.rank(), fused.rank));
    MOETRAIN_CHECK(g.rank() == fused.rank, ExitCode::kBadCheckpoint, wrong_rank(g));
    const double factor = g.scale / fused.scale();
    if (factor != 1.0)
      for (int64_t i = 0; i < g.b.numel(); ++i) g.b.ptr<double>()[i] *= factor;
    store_rows(param(params, "gate_up_proj.lora_A.weight"), g.a);
    store_rows(param(params, "gate_up_proj.lora_B.weight"), g.b);
  }

  // lora.expert_gate_up: separate: a rank-r gate_up adapter (A into both) or a rank-2r one with a
  // block-diagonal B (split in two).
  void store_separate(const ExpertParams& params, const GateUp& g) {
    const int64_t r = lora_.rank, f = g.b.size(1) / 2;
    MOETRAIN_CHECK(g.rank() == r || g.rank() == 2 * r, ExitCode::kBadCheckpoint, wrong_rank(g));
    MOETRAIN_CHECK(g.rank() == r || block_diagonal(g.b, r), ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is PEFT's fused gate_up adapter of rank {}: its B mixes gate and up (gate "
                               "rows use the up ranks or the other way round; after any PEFT training it does), so "
                               "separate gate and up adapters of rank {} cannot hold it. Set lora.expert_gate_up: "
                               "fused (one rank-{} adapter on gate_up_proj, as PEFT trains it)",
                               dir_, g.key, g.rank(), r, 2 * r));
    const double factor = g.scale / lora_.scale();
    const int64_t up_rank = g.rank() == r ? 0 : r;  // rank r: A is shared by gate and up
    auto [gate_a, gate_b] = take_part(g, 0, 0, r, f, factor);
    auto [up_a, up_b] = take_part(g, up_rank, f, r, f, factor);
    store_rows(param(params, "gate_proj.lora_A.weight"), gate_a);
    store_rows(param(params, "gate_proj.lora_B.weight"), gate_b);
    store_rows(param(params, "up_proj.lora_A.weight"), up_a);
    store_rows(param(params, "up_proj.lora_B.weight"), up_b);
  }

  std::string wrong_rank(const GateUp& g) const {
    return fmt::format("{}: \"{}\" is a gate_up adapter of rank {} (rank_pattern), but with r {} moetrain holds a "
                       "gate_up adapter of rank {} (lora.expert_gate_up: separate, A shared by gate and up or B block "
                       "diagonal) or {} (fused) only; no setting of this model reads it",
                       dir_, g.key, g.rank(), lora_.rank, lora_.rank, 2 * lora_.rank);
  }

  void load_down(const std::string& module, const ExpertParams& params) {
    Parameter& a = param(params, "down_proj.lora_A.weight");
    Parameter& b = param(params, "down_proj.lora_B.weight");
    const int64_t r = lora_.rank, f = a.value.size(2), d = b.value.size(1);
    const std::string first_key = peft_key(module + ".0.down_proj.lora_A.weight");
    if (file_.has(first_key)) {
      store_rows(a, read_per_expert(file_, module, "down_proj.lora_A.weight", {r, f}, rows_.total));
      store_rows(b, read_per_expert(file_, module, "down_proj.lora_B.weight", {d, r}, rows_.total));
      return;
    }
    MOETRAIN_CHECK(fused_down_, ExitCode::kBadCheckpoint,
                   fmt::format("{}: no adapter for {}.down_proj (neither per-expert keys like \"{}\" nor a down_proj "
                               "entry in target_parameters)",
                               dir_, module, first_key));
    store_rows(a, read_fused(file_, fused_key(module, true, "lora_A.weight"), true, r, f, rows_.total));
    store_rows(b, read_fused(file_, fused_key(module, true, "lora_B.weight"), false, r, d, rows_.total));
  }

  AdapterFile& file_;
  const PeftAdapterConfig& config_;
  const std::string& dir_;
  const LoraSettings& lora_;
  kernels::Backend& backend_;
  ExpertRows rows_;
  bool fused_gate_up_ = false, fused_down_ = false;
};

}  // namespace

std::string peft_key(const std::string& parameter_name) { return kPeftPrefix + parameter_name; }

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  std::string path = dir + "/adapter_config.json";
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), ExitCode::kBadCheckpoint, "cannot read " + path + " (is " + dir + " a PEFT adapter?)");
  std::stringstream text;
  text << in.rdbuf();
  Json json;
  try {
    json = Json::parse(text.str());
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  PeftAdapterConfig config;
  try {
    MOETRAIN_CHECK(json.value("peft_type", "LORA") == "LORA", ExitCode::kBadCheckpoint,
                   path + ": peft_type is not LORA");
    config.rank = json.at("r").get<int64_t>();
    config.alpha = json.at("lora_alpha").get<double>();
    config.rslora = json.value("use_rslora", false);
    config.gate_up_rank = config.rank;
    config.gate_up_alpha = config.alpha;
    // The one supported pattern key: gate_up_proj's (PEFT's get_pattern_key matches "(.*\.)?(key)$",
    // so both spellings select the routed experts' gate_up_proj and nothing else).
    auto pattern = [&](const char* key) -> const Json* {
      const Json* value = nullptr;
      if (!json.contains(key) || json[key].is_null()) return value;
      for (const auto& [name, entry] : json[key].items()) {
        MOETRAIN_CHECK(name == ".*\\.gate_up_proj" || name == "gate_up_proj", ExitCode::kBadCheckpoint,
                       fmt::format("{}: {} {} sets a per-module value for \"{}\"; moetrain gives every adapter "
                                   "lora.rank and lora.alpha except the routed experts' gate_up_proj "
                                   "(\".*\\\\.gate_up_proj\")",
                                   path, key, json[key].dump(), name));
        value = &entry;
      }
      return value;
    };
    if (const Json* rank = pattern("rank_pattern")) config.gate_up_rank = rank->get<int64_t>();
    if (const Json* alpha = pattern("alpha_pattern")) config.gate_up_alpha = alpha->get<double>();
    MOETRAIN_CHECK(config.rank > 0 && config.gate_up_rank > 0 && config.alpha > 0 && config.gate_up_alpha > 0,
                   ExitCode::kBadCheckpoint, path + ": r, lora_alpha and their patterns must be positive");
    if (json.contains("target_parameters") && json["target_parameters"].is_array()) {
      config.target_parameters = json["target_parameters"].get<std::vector<std::string>>();
    }
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: {}", path, e.what()));
  }
  return config;
}

void load_peft_adapter(Model& model, const std::string& dir) {
  PeftAdapterConfig config = read_peft_adapter_config(dir);
  const LoraSettings& lora = model.options().lora;
  MOETRAIN_CHECK(config.rank == lora.rank && config.alpha == lora.alpha && config.rslora == lora.rslora,
                 ExitCode::kBadConfig,
                 fmt::format("{}: the adapter has r {}, lora_alpha {}, use_rslora {} but the config says lora.rank "
                             "{}, lora.alpha {}, lora.rslora {}: set the config to the adapter's values",
                             dir, config.rank, config.alpha, config.rslora, lora.rank, lora.alpha, lora.rslora));
  AdapterFile file(dir + "/adapter_model.safetensors");
  kernels::Backend& backend = model.backend();
  std::map<std::string, ExpertParams> experts;  // routed-experts module -> its stacked adapters

  for (Parameter* p : model.parameters()) {
    if (p->value.shape().ndim() == 3) {
      // "model.layers.1.mlp.experts.gate_proj.lora_A.weight" -> module, "gate_proj.lora_A.weight"
      const size_t projection = p->name.rfind('.', p->name.rfind(".lora_") - 1);
      experts[p->name.substr(0, projection)][p->name.substr(projection + 1)] = p;
      continue;
    }
    // Kimi-Linear adapters made on transformers 5 name some KDA modules its way (hf_names.h).
    std::string key = peft_key(p->name);
    const std::string transformers_key = peft_key(transformers_module_name(p->name));
    if (!file.has(key) && file.has(transformers_key)) key = transformers_key;
    store(backend, p->value, file.read(key, p->value.shape()));
  }
  const ParallelGroups* parallel = model.options().parallel;
  ExpertRows rows{model.spec().config.moe.num_experts, parallel ? parallel->first_expert() : 0};
  ExpertLoader loader(file, config, dir, model, backend, rows);
  for (const auto& [module, params] : experts) loader.load(module, params);
  file.check_all_used();
}

}  // namespace moetrain
