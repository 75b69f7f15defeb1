// Shared by the tests of the adapter forms (fused gate_up, shared expert A, per-target ranks):
// the tiny model in each expert form, random non-zero adapters that an F32 export keeps exactly, lookup by name, the adapters as F32
// host tensors (what a checkpoint holds), adapter load errors, the resume check, the config key
// checks and scratch directories.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/config/config.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "gradcheck.h"
#include "tiny_model.h"
#include "training_run.h"

namespace moetrain::testing {

// Non-zero random values for every adapter (B included), as after some training, each one an F32
// value (so that an F32 export changes nothing).
inline void randomize_adapters(Model& model, uint64_t seed) {
  for (Parameter* p : model.parameters()) {
    fill_random(p->value, seed++, 0.05, 0.3);
    for (int64_t i = 0; i < p->value.numel(); ++i)
      p->value.ptr<double>()[i] = static_cast<float>(p->value.ptr<double>()[i]);
  }
}

// The expert adapter forms (ModelOptions' switches) of tiny_form_model.
struct ExpertForm {
  bool fused_gate_up = false;
  bool shared_a = false;
  bool rslora = false;
};

// The whole tiny model (tiny_model_config with q LoRA) with every target, rank 4, alpha 8, in the
// form `form`, in F64, its weights random.
inline std::unique_ptr<Model> tiny_form_model(kernels::Backend& backend, const ExpertForm& form) {
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, form.rslora};
  options.lora_targets = all_lora_targets(true);
  options.fused_expert_gate_up = form.fused_gate_up;
  options.shared_expert_a = form.shared_a;
  auto model = std::make_unique<Model>(resolve_model_spec(tiny_model_config(true)), backend, options);
  model->init_random_weights();
  return model;
}

inline Parameter* find_parameter(Model& model, const std::string& name) {
  for (Parameter* p : model.parameters())
    if (p->name == name) return p;
  return nullptr;
}

// The adapters as F32 host tensors, as a checkpoint holds them, and (name, view) pairs of them.
struct HostParameters {
  std::vector<Tensor> values;
  std::vector<std::pair<std::string, TensorView>> views;
  explicit HostParameters(Model& model) {
    for (Parameter* p : model.parameters()) {
      values.emplace_back(p->value.shape(), DType::kF32);
      convert_host(values.back(), p->value);
    }
    std::vector<Parameter*> params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) views.emplace_back(params[i]->name, values[i].view());
  }
};

// Whether two models' adapters hold the same F32 bytes, tensor by tensor.
inline bool same_adapter_bytes(Model& a, Model& b) {
  const HostParameters x(a), y(b);
  if (x.values.size() != y.values.size()) return false;
  for (size_t i = 0; i < x.values.size(); ++i) {
    if (x.values[i].nbytes() != y.values[i].nbytes() ||
        std::memcmp(x.values[i].data(), y.values[i].data(), x.values[i].nbytes()) != 0)
      return false;
  }
  return true;
}

// The resume check of the adapter forms: `c` (four_step_run_config) stopped after 2 of its 4
// steps and resumed in new objects reproduces `straight` (the same run trained through, which
// gave the losses `expected`) bit for bit, losses and adapters. Returns the resumed run.
inline std::unique_ptr<TrainingRun> check_resume_matches(const Config& c, TrainingRun& straight,
                                                         const std::vector<double>& expected) {
  std::vector<double> losses;
  std::unique_ptr<TrainingRun> resumed = run_with_resume(c, 2, losses);
  REQUIRE(losses.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(losses[i] == expected[i]);
  CHECK(same_adapter_bytes(*resumed->model, *straight.model));
  return resumed;
}

// The losses of `run` (a four_step_run_config) trained straight through its 4 steps.
inline std::vector<double> four_step_losses(TrainingRun& run) {
  std::vector<double> losses = run.trainer->run();
  REQUIRE(losses.size() == 4);
  return losses;
}

// The resume check of an expert adapter form: the four-step run with adapters on o_proj and the
// routed experts in the form `set_form` sets, trained straight through in scratch("straight")
// and again in scratch("split"), stopped after 2 steps and resumed (check_resume_matches).
struct ExpertFormResume {
  std::unique_ptr<TrainingRun> straight;
  Config split;
  std::unique_ptr<TrainingRun> resumed;
};
inline ExpertFormResume check_expert_form_resumes(
    const std::function<std::filesystem::path(const std::string&)>& scratch,
    const std::function<void(Config&)>& set_form) {
  const auto make_config = [&](const std::string& name) {
    Config c = four_step_run_config(scratch(name).string());
    c.lora.targets = {"o_proj", "experts"};
    set_form(c);
    return c;
  };
  ExpertFormResume r;
  r.straight = std::make_unique<TrainingRun>(make_config("straight"));
  const std::vector<double> expected = four_step_losses(*r.straight);
  r.split = make_config("split");
  r.resumed = check_resume_matches(r.split, *r.straight, expected);
  return r;
}

// The adapter of the newest checkpoint of the run `c` exported (`moetrain export`) into
// <run_dir>/adapter; returns that directory.
inline std::filesystem::path export_run_adapter(const Config& c) {
  const std::filesystem::path adapter = std::filesystem::path(c.logging.run_dir) / "adapter";
  export_checkpoint_adapter(c.logging.run_dir + "/checkpoints", adapter.string());
  return adapter;
}

// The Error (and its code) that loading the PEFT adapter `dir` into `model` throws; kOk and ""
// when it loads.
inline std::pair<ExitCode, std::string> load_error(Model& model, const std::filesystem::path& dir) {
  try {
    load_peft_adapter(model, dir.string());
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ExitCode::kOk, ""};
}

// Loading the PEFT adapter `dir` into `model` is refused with `code`, the message naming each of
// `parts`.
inline void check_load_refused(Model& model, const std::filesystem::path& dir, ExitCode code,
                               const std::vector<std::string>& parts) {
  auto [got, message] = load_error(model, dir);
  INFO(message);
  CHECK(got == code);
  for (const std::string& part : parts) CHECK(contains(message, part));
}

// A tiny model and data section, for the config key checks of the adapter forms.
inline const std::string kAdapterFormYaml =
    "model: {vocab_size: 64, hidden_size: 32, num_layers: 2, mla: {num_heads: 2}, moe: {num_experts: 4, top_k: 2}}\n"
    "data: {seq_len: 16}\n";

// The lora key `key` (its value read by `read`) is `absent` when not set, and `value` when set,
// also after a config_to_yaml round trip (what runs save).
inline void check_lora_key(const std::string& key, const std::string& absent, const std::string& value,
                           const std::function<std::string(const Config&)>& read) {
  CHECK(read(parse_config(kAdapterFormYaml, "x.yaml")) == absent);
  const Config set = parse_config(kAdapterFormYaml + "lora: {" + key + ": " + value + "}\n", "x.yaml");
  CHECK(read(set) == value);
  CHECK(read(parse_config(config_to_yaml(set), "resolved.yaml")) == value);
}

// The message of the Error parsing kAdapterFormYaml with `overrides` raises ("" when it parses).
inline std::string adapter_form_config_error(const std::vector<std::string>& overrides) {
  return error_message([&] { parse_config(kAdapterFormYaml, "x.yaml", overrides); });
}

// An empty directory <tmp>/moetrain_test_<test>_<name>.
inline std::filesystem::path scratch_dir(const std::string& test, const std::string& name) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moetrain_test_" + test + "_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace moetrain::testing
