// DSA against an independent reference: transformers' DeepseekV32ForCausalLM with a PEFT LoRA
// adapter on every MLA projection, the MLPs and the experts (tests/fixtures/golden/deepseek_v32*,
// made by scripts/make_fixtures_deepseek_v32.py; docs/FIXTURES.md). Two windows of 16 tokens whose
// queries keep the indexer's top 5 keys (deepseek_v32: YaRN, fused experts) or top 3
// (deepseek_v32_plain: default RoPE, per-expert checkpoint), so the selection matters. Our HF
// importer loads the model directory (indexer weights included), our PEFT importer the adapter;
// logits and loss must match to 1e-5 and every adapter gradient to 1e-4, each against its own
// scale. Until the fixtures are generated and committed, every case here fails and says how.
#include <cmath>
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

using testing::golden_batch;

// The fixture directory, or a failure that says how to make it.
std::string fixture_dir(const std::string& name) { return testing::fixture_dir_or_fail(name, "deepseek_v32"); }

void check_fixture(const std::string& name, DType dtype, int64_t top_k) {
  const std::string dir = fixture_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");
  Batch batch = golden_batch(golden);
  REQUIRE(batch.seq_len == 16);

  ModelSpec spec = testing::golden_spec(dir, batch.seq_len);
  REQUIRE(spec.mixers == std::vector<MixerKind>(spec.mixers.size(), MixerKind::kDsa));
  REQUIRE(spec.config.dsa.index_topk == top_k);  // fewer than the window's 16 keys: the selection matters
  auto backend = kernels::make_cpu_backend();
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  std::unique_ptr<Model> model = testing::load_golden_model(spec, *backend, options, dir);

  testing::check_golden_step(name, *model, *backend, golden, batch, dir);
}

}  // namespace

TEST_CASE("golden: DeepSeek-V3.2 (DSA top 5 of 16, YaRN, fused experts)", "[golden][dsa]") {
  check_fixture("deepseek_v32", DType::kF32, 5);
}

TEST_CASE("golden: DeepSeek-V3.2 in double precision", "[golden][dsa]") {
  check_fixture("deepseek_v32", DType::kF64, 5);
}

TEST_CASE("golden: DeepSeek-V3.2 with plain RoPE (DSA top 3 of 16, per-expert checkpoint)", "[golden][dsa]") {
  check_fixture("deepseek_v32_plain", DType::kF32, 3);
  check_fixture("deepseek_v32_plain", DType::kF64, 3);
}
