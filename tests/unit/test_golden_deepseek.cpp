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
#include "gradcheck.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

const std::string kGoldenDir = std::string(MOETRAIN_FIXTURE_DIR) + "/golden/";

double max_abs(const TensorView& t) {
  double m = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(testing::get_element(t, i)));
  return m;
}

// max |a - b| / max |b|, with NaN counting as a failure.
double scaled_error(const TensorView& ours, const TensorView& golden) {
  REQUIRE(ours.numel() == golden.numel());
  double worst = 0.0;
  for (int64_t i = 0; i < ours.numel(); ++i) {
    double d = std::fabs(testing::get_element(ours, i) - testing::get_element(golden, i));
    if (std::isnan(d)) return INFINITY;
    worst = std::max(worst, d);
  }
  double scale = max_abs(golden);
  return scale > 0 ? worst / scale : worst;
}

Tensor host_f64(kernels::Backend& backend, const Tensor& t) {
  Tensor staged(t.shape(), t.dtype());
  backend.copy(staged, t);
  Tensor out(t.shape(), DType::kF64);
  convert_host(out, staged);
  return out;
}

Batch golden_batch(const SafetensorsFile& golden) {
  Tensor ids = golden.read_as("input_ids", DType::kI32);
  Tensor labels = golden.read_as("labels", DType::kI32);
  Batch b;
  b.batch_size = ids.size(0);
  b.seq_len = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    b.input_ids.push_back(ids.ptr<int32_t>()[i]);
    int32_t label = labels.ptr<int32_t>()[i];
    b.labels.push_back(label == -100 ? -1 : label);  // HF's ignore index -> ours
    b.positions.push_back(static_cast<int32_t>(i % b.seq_len));
  }
  for (int64_t w = 0; w <= b.batch_size; ++w) b.cu_seqlens.push_back(static_cast<int32_t>(w * b.seq_len));
  return b;
}

// Our stacked routed-expert gradients in PEFT's fused 3-D layout: the fused A feeds both gate
// and up, so its gradient is the sum of ours; B's gate rows come first, column k E + e.
Tensor fused_expert_gradient(const Tensor& gate, const Tensor& up, bool is_a) {
  const int64_t experts = gate.size(0);
  if (is_a) {
    const int64_t rank = gate.size(1), in = gate.size(2);
    Tensor out({experts * rank, in}, DType::kF64);
    for (int64_t i = 0; i < out.numel(); ++i)
      out.ptr<double>()[i] = gate.ptr<double>()[i] + (up.defined() ? up.ptr<double>()[i] : 0.0);
    return out;
  }
  const int64_t rows = gate.size(1), rank = gate.size(2);
  const int64_t out_rows = up.defined() ? 2 * rows : rows;
  Tensor out({out_rows, rank * experts}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < out_rows; ++o)
      for (int64_t k = 0; k < rank; ++k) {
        const Tensor& src = o < rows ? gate : up;
        out.ptr<double>()[o * rank * experts + k * experts + e] =
            src.ptr<double>()[(e * rows + (o % rows)) * rank + k];
      }
  return out;
}

void check_config(const std::string& name, DType dtype) {
  const std::string dir = kGoldenDir + name;
  SafetensorsFile golden(dir + "/golden.safetensors");
  PeftAdapterConfig adapter = read_peft_adapter_config(dir + "/adapter");

  Config config;
  config.model.hf_dir = dir;
  config.data.seq_len = 16;
  ModelSpec spec = resolve_model_spec(config);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = dtype;
  options.lora = LoraSettings{adapter.rank, adapter.alpha, adapter.rslora};
  options.lora_targets = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "shared_experts", "experts"};
  if (spec.config.mla.q_lora_rank) {
    options.lora_targets.push_back("q_a_proj");
    options.lora_targets.push_back("q_b_proj");
  } else {
    options.lora_targets.push_back("q_proj");
  }
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
    Tensor ours;
    if (grads.count(param)) {
      ours = std::move(grads.at(param));
    } else {
      // Fused expert keys: "<...>.experts.base_layer.lora_A.weight" (gate_up) or "<...>.experts.lora_A.weight" (down).
      bool is_a = param.find("lora_A") != std::string::npos;
      std::string factor = is_a ? "lora_A.weight" : "lora_B.weight";
      bool gate_up = param.find(".base_layer.") != std::string::npos;
      std::string module = param.substr(0, param.find(".experts.") + 8);
      if (gate_up) {
        ours = fused_expert_gradient(grads.at(module + ".gate_proj." + factor), grads.at(module + ".up_proj." + factor),
                                     is_a);
      } else {
        ours = fused_expert_gradient(grads.at(module + ".down_proj." + factor), Tensor(), is_a);
      }
    }
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
