// FP8 block-scaled checkpoints as DeepSeek-V3 and Kimi K2 ship them, against transformers' own FP8
// loading (dequantized) + PEFT (tests/fixtures/golden/{deepseek_v3_fp8,kimi_k2_fp8}, made by
// scripts/make_fixtures_fp8.py, which checks that transformers' dequantized weights equal the block
// dequantization bit for bit). Our importer reads the F8_E4M3 codes and their weight_scale_inv
// blocks; logits, loss and every adapter gradient must match as the other golden tests do (1e-5
// for logits and loss, 1e-4 for gradients, each against its own scale). With model.weight_format:
// fp8 the weights stay FP8 and the GEMMs decode them (kernels/cpu/fp8.h): the CPU backend then
// computes exactly what it computes on the importer's dequantized weights, bit for bit.
#include <map>
#include <memory>
#include <string>

#include "catch.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "golden_checks.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

// One forward/backward on the golden batch: logits, loss and every adapter gradient (host F64).
struct StepResult {
  Tensor logits;
  double loss = 0.0;
  std::map<std::string, Tensor> grads;
};

StepResult run_step(Model& model, kernels::Backend& backend, const Batch& batch) {
  StepResult r;
  r.logits = model.logits(batch);
  r.loss = model.forward_backward(batch, 1.0 / static_cast<double>(batch.num_targets())).loss_sum;
  r.grads = testing::host_gradients(model, backend);
  return r;
}

bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (a.ptr<double>()[i] != b.ptr<double>()[i]) return false;
  return true;
}

void check_fp8_storage(const std::string& name, DType dtype) {
  const std::string dir = testing::golden_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");
  auto backend = kernels::make_cpu_backend();
  const Batch batch = testing::golden_batch(golden);
  ModelSpec spec = testing::golden_spec(dir, 16);
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  std::unique_ptr<Model> dequantized = testing::load_golden_model(spec, *backend, options, dir);
  spec.config.weight_format = "fp8";
  std::unique_ptr<Model> stored = testing::load_golden_model(spec, *backend, options, dir);
  // The FP8 model holds its quantized weights as one byte each (plus scales): fewer frozen bytes.
  CHECK(stored->frozen_non_expert_bytes().full < dequantized->frozen_non_expert_bytes().full);
  const StepResult a = run_step(*dequantized, *backend, batch);
  const StepResult b = run_step(*stored, *backend, batch);
  CHECK(same_values(b.logits, a.logits));
  CHECK(b.loss == a.loss);
  REQUIRE(b.grads.size() == a.grads.size());
  for (const auto& [param, grad] : a.grads) {
    INFO(name << " " << dtype_name(dtype) << ": " << param);
    CHECK(same_values(b.grads.at(param), grad));
  }
  // And the golden step itself, on the FP8 model.
  std::unique_ptr<Model> fresh = testing::load_golden_model(spec, *backend, options, dir);
  testing::check_golden_step(name + " (weight_format fp8)", *fresh, *backend, golden, batch, dir);
}

void check_config(const std::string& name, DType dtype) {
  const std::string dir = testing::golden_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");
  // The checkpoint really is the shipped layout: FP8 codes with a scale per 128 x 128 block.
  SafetensorsFile checkpoint(dir + "/model.safetensors");
  const std::string weight = "model.layers.0.mlp.gate_proj.weight";
  REQUIRE(checkpoint.info(weight).fp8 == Fp8Format::kE4M3);
  REQUIRE(checkpoint.has(weight + "_scale_inv"));

  ModelSpec spec = testing::golden_spec(dir, 16);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  std::unique_ptr<Model> model = testing::load_golden_model(spec, *backend, options, dir);
  const Batch batch = testing::golden_batch(golden);
  testing::check_golden_step(name, *model, *backend, golden, batch, dir);
}

}  // namespace

TEST_CASE("golden: DeepSeek-V3 as shipped in FP8 (e4m3, 128 x 128 block scales)", "[golden][fp8]") {
  check_config("deepseek_v3_fp8", DType::kF32);
}

TEST_CASE("golden: Kimi K2 as shipped in FP8 (model_type kimi_k2)", "[golden][fp8]") {
  check_config("kimi_k2_fp8", DType::kF32);
}

TEST_CASE("golden: both FP8 checkpoints in double precision", "[golden][fp8]") {
  check_config("deepseek_v3_fp8", DType::kF64);
  check_config("kimi_k2_fp8", DType::kF64);
}

TEST_CASE("golden: weight_format fp8 keeps the weights in FP8 and equals the dequantized model bit for bit",
          "[golden][fp8]") {
  for (DType dtype : {DType::kF32, DType::kF64}) {
    check_fp8_storage("deepseek_v3_fp8", dtype);
    check_fp8_storage("kimi_k2_fp8", dtype);
  }
}
