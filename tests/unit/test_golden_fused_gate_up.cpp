// PEFT's fused expert adapter against transformers + PEFT: the golden models qlora (fused expert
// tensors in model.safetensors) and noqlora (per-expert tensors), each with an adapter whose
// routed experts' gate_up_proj has rank 2r and alpha 2 alpha (rank_pattern / alpha_pattern) and a
// random B non-zero everywhere (tests/fixtures/golden/{qlora,noqlora}_fused_gate_up, made by
// scripts/make_fixtures.py; docs/FIXTURES.md). Loaded with lora.expert_gate_up: fused, the model
// must reproduce the reference's logits and loss (1e-5) and every adapter gradient (1e-4), each
// against its own scale; separate gate and up adapters must refuse that adapter; and moetrain's
// export of the loaded adapter must be PEFT's file again: the same keys, shapes and values, and
// the same r, alpha, patterns and targets in adapter_config.json. Until the files exist the tests
// say so and pass.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "core/checkpoint/adapter_export.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_checks.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

using testing::golden_batch;
using testing::host_f64;

bool fixture_present(const std::string& name) {
  const std::string dir = testing::golden_dir(name);
  if (std::filesystem::exists(dir + "/golden.safetensors")) return true;
  WARN("SKIPPED: " << dir << " does not exist yet; make it with python3 scripts/make_fixtures.py --out "
                   << "tests/fixtures/golden --configs " << name << " (torch, transformers 5, peft)");
  return false;
}

std::unique_ptr<Model> golden_model(const std::string& dir, kernels::Backend& backend, DType dtype, bool fused) {
  ModelSpec spec = testing::golden_spec(dir, 16);
  ModelOptions options = testing::golden_model_options(dir, spec);
  options.dtype = dtype;
  options.fused_expert_gate_up = fused;
  auto model = std::make_unique<Model>(spec, backend, options);
  model->load_weights(HfCheckpoint(dir));
  return model;
}

void check_fixture(const std::string& name, DType dtype) {
  if (!fixture_present(name)) return;
  const std::string dir = testing::golden_dir(name);
  SafetensorsFile golden(dir + "/golden.safetensors");
  const PeftAdapterConfig adapter = read_peft_adapter_config(dir + "/adapter");
  // PEFT's fused form
  REQUIRE(adapter.rank_pattern == PatternMap<int64_t>{{".*\\.gate_up_proj", 2 * adapter.rank}});
  REQUIRE(adapter.alpha_pattern == PatternMap<double>{{".*\\.gate_up_proj", 2 * adapter.alpha}});

  auto backend = kernels::make_cpu_backend();
  auto model = golden_model(dir, *backend, dtype, /*fused=*/true);
  load_peft_adapter(*model, dir + "/adapter");
  Batch batch = golden_batch(golden);

  REQUIRE(batch.num_targets() == 25);
  const std::vector<std::string> compared = testing::check_golden_step(name, *model, *backend, golden, batch, dir);
  CHECK(std::count_if(compared.begin(), compared.end(), [](const std::string& key) {
          return key.find(".experts.base_layer.") != std::string::npos;
        }) == 4);  // A and B of both MoE layers' fused gate_up

  // Separate gate and up adapters cannot hold a B that mixes them: refused, naming the fix.
  auto separate = golden_model(dir, *backend, dtype, /*fused=*/false);
  std::string message = testing::error_message([&] { load_peft_adapter(*separate, dir + "/adapter"); });
  INFO(message);
  CHECK(testing::contains(message, "experts.base_layer.lora_B.weight"));
  CHECK(testing::contains(message, "Set lora.expert_gate_up: fused"));
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// PEFT's adapter loaded with lora.expert_gate_up: fused and exported again is PEFT's adapter.
void check_export(const std::string& name) {
  if (!fixture_present(name)) return;
  const std::string dir = testing::golden_dir(name);
  auto backend = kernels::make_cpu_backend();
  auto model = golden_model(dir, *backend, DType::kF32, /*fused=*/true);
  load_peft_adapter(*model, dir + "/adapter");
  std::vector<Tensor> values;
  std::vector<std::pair<std::string, TensorView>> views;
  for (Parameter* p : model->parameters()) {
    values.push_back(host_f64(*backend, p->value));
    Tensor f32(p->value.shape(), DType::kF32);
    convert_host(f32, values.back());
    values.back() = std::move(f32);
    views.emplace_back(p->name, values.back().view());
  }
  const std::string out = (std::filesystem::temp_directory_path() / ("moetrain_golden_export_" + name)).string();
  std::filesystem::remove_all(out);
  AdapterExportSettings settings;
  settings.rank = 4;
  settings.alpha = 8.0;
  write_peft_adapter(out, views, settings);

  SafetensorsFile peft(dir + "/adapter/adapter_model.safetensors"), ours(out + "/adapter_model.safetensors");
  CHECK(ours.names().size() == peft.names().size());
  for (const std::string& key : peft.names()) {
    INFO(name << ": " << key);
    REQUIRE(ours.has(key));
    REQUIRE(ours.info(key).shape == peft.info(key).shape);
    Tensor a = ours.read_as(key, DType::kF32), b = peft.read_as(key, DType::kF32);
    CHECK(std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
  }
  const nlohmann::json want = read_json(dir + "/adapter/adapter_config.json");
  const nlohmann::json got = read_json(out + "/adapter_config.json");
  for (const char* field : {"r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_parameters",
                            "target_modules", "peft_type"}) {
    INFO(name << ": " << field << " ours " << got[field].dump() << " PEFT's " << want[field].dump());
    CHECK(got[field] == want[field]);
  }
}

}  // namespace

TEST_CASE("golden fused gate_up: moetrain's export of PEFT's fused adapter is PEFT's file", "[golden][fused][export]") {
  check_export("qlora_fused_gate_up");
  check_export("noqlora_fused_gate_up");
}

TEST_CASE("golden fused gate_up: q LoRA, YaRN, fused expert tensors", "[golden][fused]") {
  check_fixture("qlora_fused_gate_up", DType::kF32);
}

TEST_CASE("golden fused gate_up: no q LoRA, per-expert expert tensors", "[golden][fused]") {
  check_fixture("noqlora_fused_gate_up", DType::kF32);
}

TEST_CASE("golden fused gate_up: the same in double precision", "[golden][fused]") {
  check_fixture("qlora_fused_gate_up", DType::kF64);
  check_fixture("noqlora_fused_gate_up", DType::kF64);
}
