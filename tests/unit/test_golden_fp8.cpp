// FP8 block-scaled checkpoints as DeepSeek-V3 and Kimi K2 ship them, against transformers' own FP8
// loading (dequantized) + PEFT (tests/fixtures/golden/{deepseek_v3_fp8,kimi_k2_fp8}, made by
// scripts/make_fixtures_fp8.py, which checks that transformers' dequantized weights equal the block
// dequantization bit for bit). Our importer reads the F8_E4M3 codes and their weight_scale_inv
// blocks; logits, loss and every adapter gradient must match as the other golden tests do (1e-5
// for logits and loss, 1e-4 for gradients, each against its own scale).
#include <memory>
#include <string>

#include "catch.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "golden_checks.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

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
