// The checks every golden test makes of a model loaded with a fixture's weights and adapter
// (golden_files.h): logits, loss and every adapter gradient against golden.safetensors.
#pragma once

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/io/hf_index.h"
#include "golden_files.h"

namespace moetrain::testing {

#ifdef MOETRAIN_FIXTURE_DIR
// The directory of fixture `name`, or a failure that says how to make it: the script
// scripts/make_fixtures_<family>.py, run with `--out tests/fixtures/golden` and `extra_args`,
// needing torch, transformers, peft and `extra_needs`; then commit tests/fixtures/golden/<family>*/.
inline std::string fixture_dir_or_fail(const std::string& name, const std::string& family,
                                       const std::string& extra_needs = "", const std::string& extra_args = "") {
  const std::string dir = golden_dir(name);
  if (!std::filesystem::exists(dir + "/golden.safetensors")) {
    FAIL("missing golden fixture " << dir << ": make it on a machine with torch, transformers 5.17, peft 0.21 "
                                   << (extra_needs.empty() ? "" : extra_needs + " ") << "(no GPU needed) with\n  python3 "
                                   << "scripts/make_fixtures_" << family << ".py --out tests/fixtures/golden" << extra_args
                                   << "\nand commit tests/fixtures/golden/" << family << "*/ (docs/FIXTURES.md)");
  }
  return dir;
}
#endif

// The spec of the fixture directory `dir` for windows of `seq_len` tokens, as a config naming it
// resolves it.
inline ModelSpec golden_spec(const std::string& dir, int64_t seq_len) {
  Config config;
  config.model.hf_dir = dir;
  config.data.seq_len = seq_len;
  return resolve_model_spec(config);
}

// Options in `dtype` with the reference adapter's rank, alpha and rsLoRA, on `targets`.
inline ModelOptions adapter_model_options(const std::string& dir, DType dtype, std::vector<std::string> targets) {
  const PeftAdapterConfig adapter = read_peft_adapter_config(dir + "/adapter");
  ModelOptions options;
  options.dtype = dtype;
  options.lora = LoraSettings{adapter.rank, adapter.alpha, adapter.rslora};
  options.lora_targets = std::move(targets);
  return options;
}

// The fixture's model: the weights of the Hugging Face directory `dir` and its PEFT adapter
// (dir/adapter) loaded into a model of `spec` built with `options`.
inline std::unique_ptr<Model> load_golden_model(const ModelSpec& spec, kernels::Backend& backend,
                                                const ModelOptions& options, const std::string& dir) {
  auto model = std::make_unique<Model>(spec, backend, options);
  model->load_weights(HfCheckpoint(dir));
  load_peft_adapter(*model, dir + "/adapter");
  return model;
}

// Bounds of a golden comparison, each relative to the reference's own scale (its largest logit,
// |loss|, each gradient's largest entry).
struct GoldenBounds {
  double logits = 1e-5;
  double loss = 1e-5;
  double gradient = 1e-4;
};

// The model's logits and the mean loss of one forward/backward on the golden batch against the
// file's (the backward leaves the gradients for check_adapter_gradients).
inline void check_logits_and_loss(const std::string& label, Model& model, const SafetensorsFile& golden,
                                  const Batch& batch, const GoldenBounds& bounds = {}) {
  const double logits_error = scaled_error(model.logits(batch), golden.read_as("logits", DType::kF64));
  INFO(label << ": logits scaled error " << logits_error);
  CHECK(logits_error <= bounds.logits);
  const double targets = static_cast<double>(batch.num_targets());
  const double loss = model.forward_backward(batch, 1.0 / targets).loss_sum / targets;
  const double golden_loss = golden.read_as("loss", DType::kF64).ptr<double>()[0];
  INFO(label << ": loss " << loss << " vs " << golden_loss);
  CHECK(std::fabs(loss - golden_loss) <= bounds.loss * std::fabs(golden_loss));
}

// Our gradients (host F64) by parameter name.
inline std::map<std::string, Tensor> host_gradients(Model& model, kernels::Backend& backend) {
  std::map<std::string, Tensor> grads;
  for (Parameter* p : model.parameters()) grads.emplace(p->name, host_f64(backend, p->grad));
  return grads;
}

// Every adapter gradient the golden file holds ("grad.<PEFT key>") against ours: `our_key` maps
// the PEFT key to the name gradient_for looks up (by default the key without
// "base_model.model."). None of the adapter's tensors may be left unchecked. Returns the PEFT
// keys compared.
inline std::vector<std::string> check_adapter_gradients(
    const std::string& label, const SafetensorsFile& golden, std::map<std::string, Tensor> grads,
    const std::string& adapter_dir, double bound = 1e-4,
    const std::function<std::string(const std::string&)>& our_key = nullptr) {
  const std::string prefix = "base_model.model.";
  std::vector<std::string> compared;
  for (const std::string& key : golden.names()) {
    if (key.rfind("grad.", 0) != 0) continue;
    const std::string peft = key.substr(5);
    const std::string param = our_key ? our_key(peft) : peft.substr(prefix.size());
    const double error = scaled_error(gradient_for(grads, param), golden.read_as(key, DType::kF64));
    INFO(label << ": " << key << " (ours: " << param << ") scaled error " << error);
    CHECK(error <= bound);
    compared.push_back(peft);
  }
  CHECK(compared.size() == SafetensorsFile(adapter_dir + "/adapter_model.safetensors").names().size());
  return compared;
}

// How check_golden_step reads the reference: the bounds; our_key as check_adapter_gradients takes
// it; `alias` (optional) a second name each of our gradients may be looked up by (the spelling of
// the fixture's adapter, where it differs).
struct GoldenStepChecks {
  GoldenBounds bounds;
  std::function<std::string(const std::string&)> our_key;
  std::function<std::string(const std::string&)> alias;
};

// One golden step: check_logits_and_loss, then every adapter gradient against the reference's
// (check_adapter_gradients). Returns the PEFT keys compared.
inline std::vector<std::string> check_golden_step(const std::string& label, Model& model, kernels::Backend& backend,
                                                  const SafetensorsFile& golden, const Batch& batch,
                                                  const std::string& dir, const GoldenStepChecks& checks = {}) {
  check_logits_and_loss(label, model, golden, batch, checks.bounds);
  std::map<std::string, Tensor> grads = host_gradients(model, backend);
  if (checks.alias) {
    for (Parameter* p : model.parameters()) {
      const std::string renamed = checks.alias(p->name);
      if (renamed != p->name) grads.emplace(renamed, host_f64(backend, p->grad));
    }
  }
  return check_adapter_gradients(label, golden, std::move(grads), dir + "/adapter", checks.bounds.gradient,
                                 checks.our_key);
}

}  // namespace moetrain::testing
