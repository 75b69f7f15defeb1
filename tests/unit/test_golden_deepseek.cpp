// The whole model against an independent reference: transformers' DeepseekV3ForCausalLM with a
// PEFT LoRA adapter (tests/fixtures/golden, made by scripts/make_fixtures.py; docs/FIXTURES.md).
// Our HF importer loads the model directory, our PEFT importer the adapter; then logits, loss
// and every adapter gradient must match the reference's, each compared against its own scale:
// max |ours - golden| <= tol * max |golden| (1e-5 for logits and loss, 1e-4 for gradients).
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_files.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

using testing::golden_batch;
using testing::gradient_for;
using testing::host_f64;
using testing::scaled_error;

void check_config(const std::string& name, DType dtype) {
  const std::string dir = testing::golden_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");

  Config config;
  config.model.hf_dir = dir;
  config.data.seq_len = 16;
  ModelSpec spec = resolve_model_spec(config);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  Model model(spec, *backend, options);
  model.load_weights(HfCheckpoint(dir));
  load_peft_adapter(model, dir + "/adapter");
  Batch batch = golden_batch(golden);

  // Logits.
  Tensor logits = model.logits(batch);
  Tensor golden_logits = golden.read_as("logits", DType::kF64);
  double logits_error = scaled_error(logits, golden_logits);
  INFO(name << ": logits scaled error " << logits_error);
  CHECK(logits_error <= 1e-5);

  // Loss and gradients.
  const int64_t targets = batch.num_targets();
  REQUIRE(targets == 25);
  StepResult result = model.forward_backward(batch, 1.0 / static_cast<double>(targets));
  double loss = result.loss_sum / static_cast<double>(targets);
  double golden_loss = golden.read_as("loss", DType::kF64).ptr<double>()[0];
  INFO(name << ": loss " << loss << " vs " << golden_loss);
  CHECK(std::fabs(loss - golden_loss) <= 1e-5 * std::fabs(golden_loss));

  std::map<std::string, Tensor> grads;
  for (Parameter* p : model.parameters()) grads.emplace(p->name, host_f64(*backend, p->grad));
  int compared = 0;
  for (const std::string& key : golden.names()) {
    if (key.rfind("grad.", 0) != 0) continue;
    std::string peft = key.substr(5);
    std::string param = peft.substr(std::string("base_model.model.").size());
    Tensor ours = gradient_for(grads, param);
    Tensor expected = golden.read_as(key, DType::kF64);
    double error = scaled_error(ours, expected);
    INFO(name << ": " << key << " scaled error " << error);
    CHECK(error <= 1e-4);
    ++compared;
  }
  // One gradient per adapter tensor, none left unchecked.
  CHECK(compared == static_cast<int>(SafetensorsFile(dir + "/adapter/adapter_model.safetensors").names().size()));
}

}  // namespace

TEST_CASE("golden: DeepSeek-V3 with q LoRA, YaRN, fused experts, PEFT target_parameters", "[golden]") {
  check_config("qlora", DType::kF32);
}

TEST_CASE("golden: DeepSeek-V3 without q LoRA, per-expert checkpoint", "[golden]") {
  check_config("noqlora", DType::kF32);
}

TEST_CASE("golden: the same in double precision", "[golden]") {
  check_config("qlora", DType::kF64);
  check_config("noqlora", DType::kF64);
}
