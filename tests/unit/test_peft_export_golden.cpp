// Our exported adapter, made to be read by PEFT: the golden "noqlora" model with the reference
// adapter loaded, its routed-expert gate and up adapters then untied (so the export's per-expert
// keys carry independent gate/up factors), exported with write_peft_adapter, and read back here:
// same values and same logits (this part runs in CI). With MOETRAIN_PEFT_EXPORT_DIR set, the
// adapter, the batch and our logits are left in that directory for
// scripts/check_peft_export.py, which loads them (both adapter layouts) with transformers + PEFT
// on a machine with torch and compares the logits. The same for PEFT's fused expert adapter
// (lora.expert_gate_up: fused, every B random and non-zero: a full gate_up B):
// adapter_fused/ and ours_fused.safetensors.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_files.h"
#include "kernels/ops.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

const std::string kModelDir = std::string(MOETRAIN_FIXTURE_DIR) + "/golden/noqlora";

std::unique_ptr<Model> golden_model(kernels::Backend& backend, bool fused_gate_up = false) {
  Config config;
  config.model.hf_dir = kModelDir;
  config.data.seq_len = 16;
  ModelSpec spec = resolve_model_spec(config);
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj", "shared_experts", "experts"};
  options.fused_expert_gate_up = fused_gate_up;
  auto model = std::make_unique<Model>(spec, backend, options);
  model->load_weights(HfCheckpoint(kModelDir));
  return model;
}


// The adapters as F32 host tensors, as a checkpoint holds them (the model here computes in F64).
struct ExportedParameters {
  std::vector<Tensor> values;
  std::vector<std::pair<std::string, TensorView>> views;
};
ExportedParameters exported(Model& model) {
  ExportedParameters out;
  for (Parameter* p : model.parameters()) {
    Tensor value(p->value.shape(), DType::kF32);
    convert_host(value, p->value);
    out.values.push_back(std::move(value));
  }
  std::vector<Parameter*> params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) out.views.emplace_back(params[i]->name, out.values[i].view());
  return out;
}

// The batch and our logits (f64 forward, stored as f32) for scripts/check_peft_export.py.
void write_ours(const Batch& batch, const Tensor& logits, const fs::path& path) {
  Tensor ids({batch.batch_size, batch.seq_len}, DType::kI32);
  std::copy(batch.input_ids.begin(), batch.input_ids.end(), ids.ptr<int32_t>());
  Tensor logits32(logits.shape(), DType::kF32);
  for (int64_t i = 0; i < logits.numel(); ++i) logits32.ptr<float>()[i] = static_cast<float>(logits.ptr<double>()[i]);
  SafetensorsWriter writer;
  writer.add("input_ids", ids.view());
  writer.add("logits", logits32.view().reshaped({batch.batch_size, batch.seq_len, logits.size(1)}));
  writer.write(path.string());
}

fs::path export_dir() {
  const char* keep = std::getenv("MOETRAIN_PEFT_EXPORT_DIR");
  return keep ? fs::path(keep) : fs::temp_directory_path() / "moetrain_peft_export";
}

}  // namespace

TEST_CASE("an exported adapter reads back to the same values and logits", "[export][golden]") {
  auto backend = kernels::make_cpu_backend();
  auto model = golden_model(*backend);
  load_peft_adapter(*model, kModelDir + "/adapter");
  // Untie the routed experts' gate and up adapters (the fused PEFT layout ties their A).
  for (Parameter* p : model->parameters()) {
    if (p->value.shape().ndim() == 3 && p->name.find(".up_proj.lora_A") != std::string::npos) {
      double* v = p->value.ptr<double>();
      for (int64_t i = 0; i < p->value.numel(); ++i) v[i] *= 1.0 + 0.25 * std::sin(0.37 * static_cast<double>(i));
    }
  }
  Batch batch = testing::golden_batch(SafetensorsFile(kModelDir + "/golden.safetensors"));
  Tensor logits = model->logits(batch);

  fs::path dir = export_dir();
  fs::remove_all(dir / "adapter");
  fs::remove_all(dir / "adapter_transformers5");
  AdapterExportSettings settings;
  settings.layout = AdapterLayout::kPerExpert;
  settings.rank = 4;
  settings.alpha = 8.0;
  settings.base_model = kModelDir;
  ExportedParameters values = exported(*model);
  write_peft_adapter((dir / "adapter").string(), values.views, settings);

  auto reloaded = golden_model(*backend);
  load_peft_adapter(*reloaded, (dir / "adapter").string());
  std::vector<Parameter*> b = reloaded->parameters();
  REQUIRE(b.size() == values.values.size());
  for (size_t i = 0; i < b.size(); ++i) {  // exactly the F32 values written
    testing::Comparison c = testing::compare_tensors(b[i]->value, values.values[i], 0.0, 0.0, values.views[i].first);
    INFO(c.message);
    CHECK(c.ok);
  }
  // The same function of the input, up to the adapters' rounding to F32.
  Tensor again = reloaded->logits(batch);
  testing::Comparison c = testing::compare_tensors(again, logits, 1e-6, 1e-6, "logits");
  INFO(c.message);
  CHECK(c.ok);

  write_ours(batch, logits, dir / "ours.safetensors");
  CHECK(fs::exists(dir / "adapter" / "adapter_config.json"));

  // The transformers 5 layout of the same adapter: gate and up become one rank-2r adapter on
  // the fused gate_up_proj, which reads back into the separate adapters exactly.
  settings.layout = AdapterLayout::kTransformers5;
  write_peft_adapter((dir / "adapter_transformers5").string(), values.views, settings);
  SafetensorsFile fused((dir / "adapter_transformers5" / "adapter_model.safetensors").string());
  const std::string gate_up = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight";
  REQUIRE(fused.has(gate_up));
  CHECK(fused.info(gate_up).shape == Shape({8 * 8, 32}));  // 8 experts x rank 2r, hidden 32
  CHECK(fused.has("base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"));
  auto from_fused = golden_model(*backend);
  load_peft_adapter(*from_fused, (dir / "adapter_transformers5").string());
  std::vector<Parameter*> f = from_fused->parameters();
  for (size_t i = 0; i < f.size(); ++i) {
    testing::Comparison cf = testing::compare_tensors(f[i]->value, values.values[i], 0.0, 0.0, values.views[i].first);
    INFO(cf.message);
    CHECK(cf.ok);
  }
}

TEST_CASE("a fused gate_up adapter (full B) exports in PEFT's form and reads back exactly", "[export][golden][fused]") {
  auto backend = kernels::make_cpu_backend();
  auto model = golden_model(*backend, /*fused_gate_up=*/true);
  // Every adapter random and non-zero (the gate_up B a full matrix, as PEFT training leaves it), each
  // value an F32 so that the export is exact.
  uint64_t seed = 900;
  for (Parameter* p : model->parameters()) {
    testing::fill_random(p->value, seed++, 0.02, 0.2);
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.ptr<double>()[i] = static_cast<float>(p->value.ptr<double>()[i]);
  }
  Batch batch = testing::golden_batch(SafetensorsFile(kModelDir + "/golden.safetensors"));
  Tensor logits = model->logits(batch);

  fs::path dir = export_dir();
  fs::remove_all(dir / "adapter_fused");
  AdapterExportSettings settings;
  settings.rank = 4;
  settings.alpha = 8.0;
  settings.base_model = kModelDir;
  ExportedParameters values = exported(*model);
  write_peft_adapter((dir / "adapter_fused").string(), values.views, settings);
  write_ours(batch, logits, dir / "ours_fused.safetensors");

  SafetensorsFile file((dir / "adapter_fused" / "adapter_model.safetensors").string());
  CHECK(file.info("base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight").shape == Shape({32, 8 * 8}));
  auto reloaded = golden_model(*backend, /*fused_gate_up=*/true);
  load_peft_adapter(*reloaded, (dir / "adapter_fused").string());
  testing::Comparison c = testing::compare_tensors(reloaded->logits(batch), logits, 0.0, 0.0, "logits");
  INFO(c.message);
  CHECK(c.ok);
}
