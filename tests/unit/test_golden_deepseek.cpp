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
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "golden_checks.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

using testing::golden_batch;

void check_config(const std::string& name, DType dtype) {
  const std::string dir = testing::golden_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");

  ModelSpec spec = testing::golden_spec(dir, 16);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  std::unique_ptr<Model> model = testing::load_golden_model(spec, *backend, options, dir);
  Batch batch = golden_batch(golden);

  REQUIRE(batch.num_targets() == 25);
  testing::check_golden_step(name, *model, *backend, golden, batch, dir);
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
