// The Kimi K3 golden fixtures' adapter (tests/fixtures/golden/kimi_k3*, made by
// scripts/make_fixtures_kimi_k3.py from NeMo AutoModel's K3): its keys are under the checkpoint's
// names, as NeMo saves a K3 PEFT adapter. Shared by the CPU golden test
// (tests/unit/test_golden_kimi_k3.cpp) and its CUDA twin (tests/cuda/test_cuda_golden_model.cpp).
#pragma once

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace moetrain::testing {

// An adapter key of a K3 fixture without "base_model.model." ("language_model.model.layers.1.
// block_sparse_moe.shared_experts.gate_proj.lora_A.weight") as our parameter name
// ("model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight").
inline std::string k3_parameter_name(std::string name) {
  const char* text_prefix = "language_model.";
  if (name.rfind(text_prefix, 0) == 0) name = name.substr(std::strlen(text_prefix));
  const std::string moe = ".block_sparse_moe.";
  const size_t at = name.find(moe);
  if (at != std::string::npos) name.replace(at, moe.size(), ".mlp.");
  return name;
}

// LoRA targets of a K3 fixture's adapter: its target_modules (already our names), and the modules
// whose weight target_parameters names (the dense MLP's and the shared experts' gate/up/down_proj).
inline std::vector<std::string> k3_adapter_targets(const std::string& adapter_dir) {
  std::ifstream in(adapter_dir + "/adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  std::vector<std::string> targets = config.at("target_modules").get<std::vector<std::string>>();
  const std::string suffix = ".weight";
  for (const std::string& parameter : config.value("target_parameters", std::vector<std::string>())) {
    if (parameter.size() <= suffix.size() ||
        parameter.compare(parameter.size() - suffix.size(), suffix.size(), suffix) != 0) {
      throw std::runtime_error(adapter_dir + "/adapter_config.json: target_parameters entry '" + parameter +
                               "' does not end in .weight");
    }
    targets.push_back(parameter.substr(0, parameter.size() - suffix.size()));
  }
  return targets;
}

}  // namespace moetrain::testing
