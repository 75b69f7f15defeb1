// The golden files of tests/fixtures/golden (made by scripts/make_fixtures.py from transformers'
// DeepseekV3ForCausalLM + PEFT; docs/FIXTURES.md), shared by the CPU golden test
// (tests/unit/test_golden_deepseek.cpp) and its CUDA twin (tests/cuda/test_cuda_golden_model.cpp):
// the model options of a fixture, its batch, and our gradients in PEFT's key layout.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/base/host_convert.h"
#include "core/io/safetensors.h"
#include "core/model/hf_names.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_k3.h"
#include "gradcheck.h"
#include "kernels/ops.h"

namespace moetrain::testing {

#ifdef MOETRAIN_FIXTURE_DIR
inline std::string golden_dir(const std::string& fixture) {
  return std::string(MOETRAIN_FIXTURE_DIR) + "/golden/" + fixture;
}
#endif

inline double max_abs(const TensorView& t) {
  double m = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(get_element(t, i)));
  return m;
}

inline int64_t non_finite_count(const TensorView& t) {
  int64_t count = 0;
  for (int64_t i = 0; i < t.numel(); ++i) count += std::isfinite(get_element(t, i)) ? 0 : 1;
  return count;
}

// max |ours - golden| / max |golden|; a NaN or Inf in `ours` gives infinity (fails every tolerance).
inline double scaled_error(const TensorView& ours, const TensorView& golden) {
  if (ours.numel() != golden.numel()) return INFINITY;
  double worst = 0.0;
  for (int64_t i = 0; i < ours.numel(); ++i) {
    const double d = std::fabs(get_element(ours, i) - get_element(golden, i));
    if (!std::isfinite(d)) return INFINITY;
    worst = std::max(worst, d);
  }
  const double scale = max_abs(golden);
  return scale > 0 ? worst / scale : worst;
}

// A tensor of any float dtype, on the backend's device, as a host F64 tensor.
inline Tensor host_f64(kernels::Backend& backend, const Tensor& t) {
  Tensor staged(t.shape(), t.dtype());
  backend.copy(staged, t);
  Tensor out(t.shape(), DType::kF64);
  convert_host(out, staged);
  return out;
}

// The fixture's model with every LoRA target the reference adapter has, at the adapter's rank.
inline ModelOptions golden_model_options(const std::string& dir, const ModelSpec& spec) {
  const PeftAdapterConfig adapter = read_peft_adapter_config(dir + "/adapter");
  ModelOptions options;
  options.lora = LoraSettings{adapter.rank, adapter.alpha, adapter.rslora};
  options.lora_targets = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "shared_experts", "experts"};
  if (spec.config.mla.q_lora_rank) {
    options.lora_targets.push_back("q_a_proj");
    options.lora_targets.push_back("q_b_proj");
  } else {
    options.lora_targets.push_back("q_proj");
  }
  return options;
}

// The reference's batch: input_ids and labels [windows, seq] (HF's ignore index -100 -> -1).
inline Batch golden_batch(const SafetensorsFile& golden) {
  Tensor ids = golden.read_as("input_ids", DType::kI32);
  Tensor labels = golden.read_as("labels", DType::kI32);
  Batch b;
  b.batch_size = ids.size(0);
  b.seq_len = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    b.input_ids.push_back(ids.ptr<int32_t>()[i]);
    const int32_t label = labels.ptr<int32_t>()[i];
    b.labels.push_back(label == -100 ? -1 : label);
    b.positions.push_back(static_cast<int32_t>(i % b.seq_len));
  }
  for (int64_t w = 0; w <= b.batch_size; ++w) b.cu_seqlens.push_back(static_cast<int32_t>(w * b.seq_len));
  return b;
}

// A DSA fixture's indexer selection of layer l as moetrain's indexer writes it: I32 [tokens, top_k]. The
// fixture numbers keys within each window; ours are token indices.
inline Tensor fixture_selection(const SafetensorsFile& golden, int64_t l, int64_t seq_len) {
  Tensor keys = golden.read_as("indexer.layers." + std::to_string(l) + ".topk_index", DType::kI32);
  const int64_t k = keys.size(1);
  int32_t* p = keys.ptr<int32_t>();
  for (int64_t i = 0; i < keys.numel(); ++i)
    if (p[i] >= 0) p[i] += static_cast<int32_t>(i / k / seq_len * seq_len);
  return keys;
}
inline std::vector<Tensor> fixture_selections(const SafetensorsFile& golden, int64_t layers, int64_t seq_len) {
  std::vector<Tensor> out;
  for (int64_t l = 0; l < layers; ++l) out.push_back(fixture_selection(golden, l, seq_len));
  return out;
}

// LoRA targets in our names for a Kimi-Linear fixture's adapter: its target_modules (KDA's in
// transformers' spelling, hf_names.h) plus the MLPs and experts it reaches through
// target_parameters.
inline std::vector<std::string> kimi_adapter_targets(const std::string& adapter_dir) {
  static const char* const kKdaProjections[] = {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj",
                                                "b_proj", "g_a_proj", "g_b_proj", "o_proj"};
  std::ifstream in(adapter_dir + "/adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  std::vector<std::string> targets = {"gate_proj", "up_proj", "down_proj", "shared_experts", "experts"};
  for (const std::string& module : config.at("target_modules").get<std::vector<std::string>>()) {
    std::string ours = module;
    for (const char* name : kKdaProjections) {
      if (transformers_module_name(std::string(".self_attn.") + name) == ".self_attn." + module) ours = name;
    }
    targets.push_back(ours);
  }
  return targets;
}

// golden_model_options with the targets of the fixture's adapter where they are its own: a
// Kimi-Linear adapter also sits on KDA's projections (some under transformers' names), a K3
// adapter names ours (and reaches the MLPs through target_parameters).
inline ModelOptions fixture_model_options(const std::string& dir, const ModelSpec& spec) {
  ModelOptions options = golden_model_options(dir, spec);
  if (spec.config.model_type == "kimi_k3") {
    options.lora_targets = k3_adapter_targets(dir + "/adapter");
  } else if (std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kKda) > 0) {
    options.lora_targets = kimi_adapter_targets(dir + "/adapter");
  }
  return options;
}

// Our stacked routed-expert gradients (host F64) in PEFT's fused 3-D layout: the fused A feeds
// both gate and up, so its gradient is the sum of ours; B's gate rows come first, column k E + e.
inline Tensor fused_expert_gradient(const Tensor& gate, const Tensor& up, bool is_a) {
  const int64_t experts = gate.size(0);
  if (is_a) {
    const int64_t rank = gate.size(1), in = gate.size(2);
    Tensor out({experts * rank, in}, DType::kF64);
    for (int64_t i = 0; i < out.numel(); ++i)
      out.ptr<double>()[i] = gate.ptr<double>()[i] + (up.defined() ? up.ptr<double>()[i] : 0.0);
    return out;
  }
  const int64_t rows = gate.size(1), rank = gate.size(2);
  const int64_t out_rows = up.defined() ? 2 * rows : rows;
  Tensor out({out_rows, rank * experts}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < out_rows; ++o)
      for (int64_t k = 0; k < rank; ++k) {
        const Tensor& src = o < rows ? gate : up;
        out.ptr<double>()[o * rank * experts + k * experts + e] = src.ptr<double>()[(e * rows + (o % rows)) * rank + k];
      }
  return out;
}

// Our gradient (host F64) for the PEFT key `param` (without "base_model.model."); the fused
// expert keys ("<...>.experts.base_layer.lora_A.weight" for gate_up, "<...>.experts.lora_A.weight"
// for down) are assembled from our per-projection stacks, or re-laid from our fused gate_up stack
// (lora.expert_gate_up: fused). Takes a plain key's tensor out of `grads`.
inline Tensor gradient_for(std::map<std::string, Tensor>& grads, const std::string& param) {
  auto found = grads.find(param);
  if (found != grads.end()) return std::move(found->second);
  const bool is_a = param.find("lora_A") != std::string::npos;
  const std::string factor = is_a ? "lora_A.weight" : "lora_B.weight";
  const std::string module = param.substr(0, param.find(".experts.") + 8);
  if (param.find(".base_layer.") != std::string::npos) {
    auto fused = grads.find(module + ".gate_up_proj." + factor);
    if (fused != grads.end()) return fused_expert_gradient(fused->second, Tensor(), is_a);
    return fused_expert_gradient(grads.at(module + ".gate_proj." + factor), grads.at(module + ".up_proj." + factor),
                                 is_a);
  }
  return fused_expert_gradient(grads.at(module + ".down_proj." + factor), Tensor(), is_a);
}

}  // namespace moetrain::testing
