// The KDA + MLA hybrid against an independent reference: transformers' KimiLinearForCausalLM with a
// PEFT LoRA adapter on every projection and the experts (tests/fixtures/golden/kimi_linear*, made
// by scripts/make_fixtures_kimi_linear.py; docs/FIXTURES.md). Two windows of 70 tokens, so KDA's
// 64-token chunks end mid-sequence. Our HF importer loads the model directory (one fixture in the
// released checkpoint layout, one in transformers' own), our PEFT importer the adapter; logits and
// loss must match to 1e-5 and every adapter gradient to 1e-4, each against its own scale.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "catch.h"
#include "core/io/safetensors.h"
#include "core/model/hf_names.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_checks.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

using testing::golden_batch;

// The fixture directory, or a failure that says how to make it.
std::string fixture_dir(const std::string& name) { return testing::fixture_dir_or_fail(name, "kimi_linear"); }

void check_fixture(const std::string& name, DType dtype) {
  const std::string dir = fixture_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");
  Batch batch = golden_batch(golden);
  REQUIRE(batch.seq_len == 70);

  ModelSpec spec = testing::golden_spec(dir, batch.seq_len);
  REQUIRE(std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kKda) >= 1);
  REQUIRE(std::count(spec.mixers.begin(), spec.mixers.end(), MixerKind::kMla) >= 1);
  auto backend = kernels::make_cpu_backend();
  const ModelOptions options =
      testing::adapter_model_options(dir, dtype, testing::kimi_adapter_targets(dir + "/adapter"));
  std::unique_ptr<Model> model = testing::load_golden_model(spec, *backend, options, dir);

  // Our gradients under our names and transformers' (the adapter's keys use the latter's).
  testing::GoldenStepChecks checks;
  checks.alias = transformers_module_name;
  testing::check_golden_step(name, *model, *backend, golden, batch, dir, checks);
}

}  // namespace

TEST_CASE("golden: Kimi-Linear (KDA + NoPE MLA), released checkpoint layout", "[golden][kda]") {
  check_fixture("kimi_linear", DType::kF32);
}

TEST_CASE("golden: Kimi-Linear with q LoRA MLA, transformers' own checkpoint layout", "[golden][kda]") {
  check_fixture("kimi_linear_t5", DType::kF32);
}

// The GPU's bf16 fixture (every expert chosen, bf16-valued frozen weights): the CPU holds it to the
// same fp32 bounds as the others.
TEST_CASE("golden: Kimi-Linear with every expert chosen and bf16-valued weights", "[golden][kda]") {
  check_fixture("kimi_linear_bf16", DType::kF32);
}

TEST_CASE("golden: Kimi-Linear in double precision", "[golden][kda]") {
  check_fixture("kimi_linear", DType::kF64);
  check_fixture("kimi_linear_t5", DType::kF64);
  check_fixture("kimi_linear_bf16", DType::kF64);
}
