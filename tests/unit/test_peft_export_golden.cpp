// Our exported adapter, made to be read by PEFT: the golden "noqlora" model with the reference
// adapter loaded, its routed-expert gate and up adapters then untied (so the export's per-expert
// keys carry independent gate/up factors), exported with write_peft_adapter, and read back here:
// same values and same logits (this part runs in CI). With MOETRAIN_PEFT_EXPORT_DIR set, the
// adapter, the batch and our logits are left in that directory for
// scripts/check_peft_export.py, which loads them with transformers + PEFT on a machine with
// torch and compares the logits.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "catch.h"
#include "core/checkpoint/adapter_export.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "gradcheck.h"
#include "kernels/ops.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

const std::string kModelDir = std::string(MOETRAIN_FIXTURE_DIR) + "/golden/noqlora";

std::unique_ptr<Model> golden_model(kernels::Backend& backend) {
  Config config;
  config.model.hf_dir = kModelDir;
  config.data.seq_len = 16;
  ModelSpec spec = resolve_model_spec(config);
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj", "shared_experts", "experts"};
  auto model = std::make_unique<Model>(spec, backend, options);
  model->load_weights(HfCheckpoint(kModelDir));
  return model;
}

Batch golden_batch() {
  SafetensorsFile golden(kModelDir + "/golden.safetensors");
  Tensor ids = golden.read_as("input_ids", DType::kI32);
  Batch b;
  b.batch_size = ids.size(0);
  b.seq_len = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    b.input_ids.push_back(ids.ptr<int32_t>()[i]);
    b.labels.push_back(-1);
    b.positions.push_back(static_cast<int32_t>(i % b.seq_len));
  }
  for (int64_t w = 0; w <= b.batch_size; ++w) b.cu_seqlens.push_back(static_cast<int32_t>(w * b.seq_len));
  return b;
}

std::vector<std::pair<std::string, TensorView>> parameter_views(Model& model) {
  std::vector<std::pair<std::string, TensorView>> out;
  for (Parameter* p : model.parameters()) out.emplace_back(p->name, p->value.view());
  return out;
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
  Batch batch = golden_batch();
  Tensor logits = model->logits(batch);

  const char* keep = std::getenv("MOETRAIN_PEFT_EXPORT_DIR");
  fs::path dir = keep ? fs::path(keep) : fs::temp_directory_path() / "moetrain_peft_export";
  fs::remove_all(dir);
  AdapterExportSettings settings;
  settings.rank = 4;
  settings.alpha = 8.0;
  settings.base_model = kModelDir;
  write_peft_adapter((dir / "adapter").string(), parameter_views(*model), settings);

  auto reloaded = golden_model(*backend);
  load_peft_adapter(*reloaded, (dir / "adapter").string());
  std::vector<Parameter*> a = model->parameters(), b = reloaded->parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    testing::Comparison c = testing::compare_tensors(b[i]->value, a[i]->value, 0.0, 0.0, a[i]->name);
    INFO(c.message);
    CHECK(c.ok);
  }
  Tensor again = reloaded->logits(batch);
  testing::Comparison c = testing::compare_tensors(again, logits, 0.0, 0.0, "logits");
  INFO(c.message);
  CHECK(c.ok);

  // For scripts/check_peft_export.py: the batch and our logits (f64 forward, stored as f32).
  Tensor ids({batch.batch_size, batch.seq_len}, DType::kI32);
  std::copy(batch.input_ids.begin(), batch.input_ids.end(), ids.ptr<int32_t>());
  Tensor logits32(logits.shape(), DType::kF32);
  for (int64_t i = 0; i < logits.numel(); ++i) logits32.ptr<float>()[i] = static_cast<float>(logits.ptr<double>()[i]);
  SafetensorsWriter writer;
  writer.add("input_ids", ids.view());
  writer.add("logits", logits32.view().reshaped({batch.batch_size, batch.seq_len, logits.size(1)}));
  writer.write((dir / "ours.safetensors").string());
  CHECK(fs::exists(dir / "adapter" / "adapter_config.json"));
}
