#include "core/model/peft_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>
#include <utility>

#include "core/base/error.h"
#include "core/config/lora_patterns.h"
#include "core/io/json_integer.h"

namespace moetrain {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Calls `f` with a null pointer of the element type of `dtype` (F32 or F64).
template <class F>
void with_float_type(DType dtype, const F& f) {
  MOETRAIN_ASSERT(dtype == DType::kF32 || dtype == DType::kF64, "PEFT layout conversion of a tensor not F32 or F64");
  if (dtype == DType::kF32) f(static_cast<float*>(nullptr));
  else f(static_cast<double*>(nullptr));
}

// A pattern map of adapter_config.json, in the file's order; Error(kBadCheckpoint) naming the key
// on a pattern moetrain does not evaluate as PEFT does, or a value that is not positive.
template <class T>
PatternMap<T> read_pattern(const OrderedJson& json, const char* name, const std::string& path) {
  PatternMap<T> out;
  if (!json.contains(name) || json[name].is_null()) return out;
  for (const auto& [key, value] : json[name].items()) {
    const std::string problem = lora_pattern_problem(key);
    MOETRAIN_CHECK(problem.empty(), ExitCode::kBadCheckpoint,
                   fmt::format("{}: {} key \"{}\": {}", path, name, key, problem));
    if constexpr (std::is_integral_v<T>) {
      T rank = 0;
      MOETRAIN_CHECK(json_integer(value, &rank), ExitCode::kBadCheckpoint,
                     fmt::format("{}: {} \"{}\" is {}, expected an integer", path, name, key, value.dump()));
      out.emplace_back(key, rank);
    } else {
      out.emplace_back(key, value.template get<T>());
    }
    MOETRAIN_CHECK(out.back().second > 0, ExitCode::kBadCheckpoint,
                   fmt::format("{}: {} \"{}\" must be positive", path, name, key));
  }
  return out;
}

template <class T>
Json pattern_json(const PatternMap<T>& pattern) {
  Json out = Json::object();
  for (const auto& [key, value] : pattern) out[key] = value;
  return out;
}

}  // namespace

std::string peft_key(const std::string& parameter_name) { return kPeftPrefix + parameter_name; }

std::string peft_module(const std::string& key) {
  const size_t prefix = std::strlen(kPeftPrefix);
  return key.substr(prefix, key.rfind(".lora_") - prefix);
}

std::string peft_fused_gate_up_key(const std::string& experts_module, bool down_targeted, const std::string& factor) {
  return peft_key(experts_module + (down_targeted ? ".base_layer." : ".") + factor);
}

std::string peft_fused_down_key(const std::string& experts_module, const std::string& factor) {
  return peft_key(experts_module + "." + factor);
}

std::string released_module_name(std::string name, bool text_under_language_model) {
  auto replace = [&](const std::string& from, const std::string& to) {
    const size_t at = name.find(from);
    if (at != std::string::npos) name.replace(at, from.size(), to);
  };
  for (const char* moe_module : {".mlp.experts.", ".mlp.shared_experts.", ".mlp.routed_expert_"}) {
    replace(moe_module, std::string(".block_sparse_moe.") + (moe_module + 5));
  }
  const size_t experts = name.find(".block_sparse_moe.experts.");
  if (experts != std::string::npos) {
    for (const auto& [ours, released] : {std::pair<const char*, const char*>{".gate_proj", ".w1"},
                                         {".up_proj", ".w3"},
                                         {".down_proj", ".w2"}}) {
      const size_t at = name.find(ours, experts);
      if (at != std::string::npos) {
        name.replace(at, std::strlen(ours), released);
        break;
      }
    }
  }
  if (text_under_language_model && name.rfind("model.", 0) == 0) name = "language_model." + name;
  return name;
}

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

// A's expert-major rows are the stack's memory as it is: only the shape differs.
Tensor peft_fused_a(const TensorView& stack_a) {
  Tensor out({stack_a.size(0) * stack_a.size(1), stack_a.size(2)}, stack_a.dtype);
  std::memcpy(out.data(), stack_a.data, out.nbytes());
  return out;
}

Tensor stack_from_peft_a(const TensorView& fused_a, int64_t experts) {
  Tensor out({experts, fused_a.size(0) / experts, fused_a.size(1)}, fused_a.dtype);
  std::memcpy(out.data(), fused_a.data, out.nbytes());
  return out;
}

namespace {

// B between the stack [E, out, R] and PEFT's [out, R E] (expert e's rank k in column k E + e).
Tensor relaid_b(const TensorView& src, int64_t experts, int64_t rows, int64_t rank, bool to_peft) {
  Tensor out(to_peft ? Shape{rows, rank * experts} : Shape{experts, rows, rank}, src.dtype);
  with_float_type(src.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* from = src.ptr<T>();
    T* to = out.ptr<T>();
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t o = 0; o < rows; ++o)
        for (int64_t k = 0; k < rank; ++k) {
          const int64_t stack = (e * rows + o) * rank + k, peft = (o * rank + k) * experts + e;
          to[to_peft ? peft : stack] = from[to_peft ? stack : peft];
        }
  });
  return out;
}

}  // namespace

Tensor peft_fused_b(const TensorView& stack_b) {
  return relaid_b(stack_b, stack_b.size(0), stack_b.size(1), stack_b.size(2), /*to_peft=*/true);
}

Tensor stack_from_peft_b(const TensorView& fused_b, int64_t experts) {
  return relaid_b(fused_b, experts, fused_b.size(0), fused_b.size(1) / experts, /*to_peft=*/false);
}

ExpertStacks gate_up_side_by_side(const TensorView& gate_a, const TensorView& gate_b, const TensorView& up_a,
                                  const TensorView& up_b, double gate_factor, double up_factor) {
  const int64_t experts = gate_a.size(0), rg = gate_a.size(1), ru = up_a.size(1), in = gate_a.size(2);
  const int64_t f = gate_b.size(1), r2 = rg + ru;
  ExpertStacks out{Tensor({experts, r2, in}, gate_a.dtype), Tensor::zeros({experts, 2 * f, r2}, gate_a.dtype)};
  with_float_type(gate_a.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* a = out.a.ptr<T>();
    T* b = out.b.ptr<T>();
    for (int64_t e = 0; e < experts; ++e) {
      std::copy(gate_a.ptr<T>() + e * rg * in, gate_a.ptr<T>() + (e + 1) * rg * in, a + e * r2 * in);
      std::copy(up_a.ptr<T>() + e * ru * in, up_a.ptr<T>() + (e + 1) * ru * in, a + (e * r2 + rg) * in);
      for (int64_t o = 0; o < f; ++o) {
        for (int64_t k = 0; k < rg; ++k)
          b[(e * 2 * f + o) * r2 + k] = static_cast<T>(gate_factor * gate_b.ptr<T>()[(e * f + o) * rg + k]);
        for (int64_t k = 0; k < ru; ++k)
          b[(e * 2 * f + f + o) * r2 + rg + k] = static_cast<T>(up_factor * up_b.ptr<T>()[(e * f + o) * ru + k]);
      }
    }
  });
  return out;
}

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  std::string path = dir + "/" + kPeftConfigFile;
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), ExitCode::kBadCheckpoint, "cannot read " + path + " (is " + dir + " a PEFT adapter?)");
  std::stringstream text;
  text << in.rdbuf();
  OrderedJson json;  // the patterns' order matters: PEFT takes the first matching key
  try {
    json = OrderedJson::parse(text.str());
  } catch (const OrderedJson::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  PeftAdapterConfig config;
  try {
    MOETRAIN_CHECK(json.value("peft_type", "LORA") == "LORA", ExitCode::kBadCheckpoint,
                   path + ": peft_type is not LORA");
    MOETRAIN_CHECK(json_integer(json.at("r"), &config.rank), ExitCode::kBadCheckpoint,
                   fmt::format("{}: r is {}, expected an integer", path, json.at("r").dump()));
    config.alpha = json.at("lora_alpha").get<double>();
    config.rslora = json.value("use_rslora", false);
    MOETRAIN_CHECK(config.rank > 0 && config.alpha > 0, ExitCode::kBadCheckpoint,
                   path + ": r and lora_alpha must be positive");
    config.rank_pattern = read_pattern<int64_t>(json, "rank_pattern", path);
    config.alpha_pattern = read_pattern<double>(json, "alpha_pattern", path);
    if (json.contains("target_parameters") && json["target_parameters"].is_array()) {
      config.target_parameters = json["target_parameters"].get<std::vector<std::string>>();
    }
  } catch (const OrderedJson::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: {}", path, e.what()));
  }
  return config;
}

std::string peft_adapter_config_text(const PeftAdapterConfig& config) {
  Json json = {{"peft_type", "LORA"},
               {"task_type", "CAUSAL_LM"},
               {"r", config.rank},
               {"lora_alpha", config.alpha},
               {"use_rslora", config.rslora},
               {"lora_dropout", 0.0},
               {"bias", "none"},
               {"fan_in_fan_out", false},
               {"init_lora_weights", true},
               {"inference_mode", true},
               {"target_modules", config.target_modules},
               {"target_parameters", config.target_parameters},
               {"base_model_name_or_path", config.base_model ? Json(*config.base_model) : Json(nullptr)},
               {"modules_to_save", nullptr},
               {"rank_pattern", pattern_json(config.rank_pattern)},
               {"alpha_pattern", pattern_json(config.alpha_pattern)},
               {"revision", nullptr}};
  return json.dump(2) + "\n";
}

}  // namespace moetrain
