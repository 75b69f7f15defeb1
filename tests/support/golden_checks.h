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

}  // namespace moetrain::testing
