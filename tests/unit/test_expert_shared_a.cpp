// A shared expert A (`lora.expert_a: shared`): one A [r, in] per routed projection for all experts
// of a layer, per-expert B [E, out, r] (SwigluExperts::shared_lora_a).
//  - it is the per-expert form with every expert's A equal: same outputs and dx, same B gradients,
//    and A's gradient the sum of the per-expert A gradients (separate gate/up/down and fused
//    gate_up); every gradient against central differences in double;
//  - the whole model: gradients by finite differences, the shared A in the replicated parameter
//    group, moetrain plan's count, checkpoint + resume bit for bit;
//  - export writes it expanded (the same A for every expert, PEFT's per-expert form) and both
//    model forms reload it exactly; an adapter whose experts' A differ is refused by the shared form.
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_session.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/model/swiglu_experts.h"
#include "core/plan/param_count.h"
#include "core/data/synthetic_data.h"
#include "adapter_testing.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "model_gradcheck.h"
#include "routed_experts.h"
#include "tiny_model.h"
#include "training_run.h"

using namespace moetrain;
using namespace moetrain::testing;
using namespace moetrain::testing::routed_experts;
namespace fs = std::filesystem;

namespace {

// Routed experts with adapters on every projection (gate and up separate, or PEFT's fused
// gate_up), each A shared by the experts or one per expert.
struct Experts : RoutedExperts {
  Experts(bool shared, bool fused)
      : RoutedExperts([&](SwigluExperts& mlp, kernels::Backend& backend) {
          mlp.shared_lora_a = shared;
          if (fused) {
            mlp.add_gate_up_lora(LoraSettings{3, 5.0, false}, DType::kF64, backend, 3);
          } else {
            mlp.add_lora(SwigluExperts::kGate, LoraSettings{2, 3.0, false}, DType::kF64, backend, 3);
            mlp.add_lora(SwigluExperts::kUp, LoraSettings{3, 2.0, false}, DType::kF64, backend, 4);
          }
          mlp.add_lora(SwigluExperts::kDown, LoraSettings{2, 7.0, true}, DType::kF64, backend, 5);
        }) {}
};

void check_equal(const TensorView& actual, const TensorView& expected, const std::string& name) {
  Comparison c = compare_tensors(actual, expected, 1e-12, 1e-13, name);
  INFO(c.message);
  CHECK(c.ok);
}

// Per-expert adapters whose A is the shared one for every expert: the shared form's reference.
void copy_as_per_expert(Experts& shared, Experts& per_expert) {
  std::vector<Parameter*> s = shared.params(), p = per_expert.params();
  REQUIRE(s.size() == p.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i]->value.shape().ndim() == 3) {  // B: as it is
      REQUIRE(s[i]->value.shape() == p[i]->value.shape());
      std::memcpy(p[i]->value.data(), s[i]->value.data(), s[i]->value.nbytes());
      continue;
    }
    // A [r, in] into every expert's block of [E, r, in]
    REQUIRE(p[i]->value.shape() == Shape({kGroups, s[i]->value.size(0), s[i]->value.size(1)}));
    for (int64_t e = 0; e < kGroups; ++e)
      std::memcpy(p[i]->value.ptr<double>() + e * s[i]->value.numel(), s[i]->value.data(), s[i]->value.nbytes());
  }
}

// The whole tiny model with every target, in F64.
std::unique_ptr<Model> tiny_model(kernels::Backend& backend, bool shared, bool fused) {
  return tiny_form_model(backend, {/*fused_gate_up=*/fused, /*shared_a=*/shared, /*rslora=*/false});
}

fs::path scratch(const std::string& name) { return scratch_dir("expert_shared_a", name); }

void export_adapter(Model& model, const fs::path& dir, AdapterLayout layout) {
  AdapterExportSettings settings;
  settings.layout = layout;
  settings.rank = 4;
  settings.alpha = 8.0;
  HostParameters values(model);
  write_peft_adapter(dir.string(), values.views, settings);
}

const char* kGateA = "model.layers.1.mlp.experts.gate_proj.lora_A.weight";

}  // namespace

TEST_CASE("shared expert A: the per-expert form with equal A's; A's gradient is their sum", "[shared_a]") {
  for (bool fused : {false, true}) {
    INFO((fused ? "fused gate_up" : "separate gate and up"));
    Experts shared(true, fused), per_expert(false, fused);
    for (Parameter* p : shared.params()) {
      const bool is_a = p->name.find("lora_A") != std::string::npos;
      CHECK(p->value.shape().ndim() == (is_a ? 2 : 3));  // A [r, in], B [E, out, r]
    }
    copy_as_per_expert(shared, per_expert);
    check_equal(shared.forward(), per_expert.forward(), "out");
    check_equal(shared.backward(), per_expert.backward(), "dx");
    std::vector<Parameter*> s = shared.params(), p = per_expert.params();
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i]->grad.shape().ndim() == 3) {
        check_equal(s[i]->grad, p[i]->grad, s[i]->name);
        continue;
      }
      Tensor sum = Tensor::zeros(s[i]->grad.shape(), DType::kF64);
      const int64_t block = sum.numel();
      for (int64_t e = 0; e < kGroups; ++e)
        for (int64_t j = 0; j < block; ++j) sum.ptr<double>()[j] += p[i]->grad.ptr<double>()[e * block + j];
      check_equal(s[i]->grad, sum, s[i]->name + " (sum over experts)");
      CHECK(dot(s[i]->grad, s[i]->grad) > 0.0);
    }
  }
}

TEST_CASE("shared expert A: every gradient matches central differences", "[shared_a][gradcheck]") {
  for (bool fused : {false, true}) {
    INFO((fused ? "fused gate_up" : "separate gate and up"));
    Experts f(true, fused);
    Tensor dx = f.backward();
    GradCheckOptions options;
    options.max_elements = 1000;  // every element
    options.atol = 1e-9;
    for (Parameter* p : f.params()) {
      Comparison c = check_gradient([&] { return f.loss(); }, p->value, p->grad, p->name, options);
      INFO(c.message);
      CHECK(c.ok);
    }
    Comparison c = check_gradient([&] { return f.loss(); }, f.x, dx, "x", options);
    INFO(c.message);
    CHECK(c.ok);
  }
}

TEST_CASE("shared expert A: whole-model gradients, the replicated group, plan's count", "[shared_a][gradcheck]") {
  auto backend = kernels::make_cpu_backend();
  for (bool fused : {false, true}) {
    INFO((fused ? "fused gate_up" : "separate gate and up"));
    auto model = tiny_model(*backend, true, fused);
    randomize_adapters(*model, 300);
    const std::string gate_up = fused ? "gate_up_proj" : "gate_proj";
    Parameter* a = find_parameter(*model, "model.layers.1.mlp.experts." + gate_up + ".lora_A.weight");
    Parameter* b = find_parameter(*model, "model.layers.2.mlp.experts.down_proj.lora_B.weight");
    REQUIRE(a);
    REQUIRE(b);
    CHECK(a->value.shape() == Shape({fused ? 8 : 4, 16}));  // one A, hidden 16
    CHECK(b->value.shape() == Shape({6, 16, 4}));           // per expert
    // The shared A's are replicated like the attention adapters (summed over every data-parallel
    // rank); the per-expert B's are the only 3-D parameters (sliced under expert parallelism).
    for (ParameterGroup* group : model->parameter_groups()) {
      for (Parameter* p : group->params()) {
        if (p->name.find(".mlp.experts.") == std::string::npos || p->name.find("lora_A") == std::string::npos) continue;
        CHECK(p->value.shape().ndim() == 2);
        CHECK(group->name() == "replicated adapters");
      }
    }

    Batch batch = tiny_batch(37, 3);
    const double scale = 1.0 / static_cast<double>(batch.num_targets());
    // Copied now: every evaluation below adds to p->grad.
    const std::vector<Tensor> grads = lora_gradients(*model, *backend, batch, scale);
    GradCheckOptions options = whole_model_gradcheck_options();
    options.max_elements = 8;
    const auto objective = [&] {
      StepResult r = model->forward_backward(batch, scale);
      return r.loss_sum * scale + r.aux_loss;
    };
    const auto experts = [](const std::string& name) {
      return name.find(".mlp.experts.") != std::string::npos;  // test_model_gradcheck covers the others
    };
    for (size_t i : check_selected_gradients(*model, grads, objective, options, experts))
      CHECK(backend->sum_squares(grads[i]) > 0.0);

    Config config = tiny_model_config(true);
    config.lora.rank = 4;
    config.lora.targets = all_lora_targets(true);
    config.lora.expert_gate_up = fused ? "fused" : "separate";
    config.lora.expert_a = "shared";
    int64_t trainable = 0, shared_a = 0;
    for (Parameter* p : model->parameters()) {
      trainable += p->value.numel();
      if (p->name.find(".mlp.experts.") != std::string::npos && p->value.shape().ndim() == 2) shared_a += p->value.numel();
    }
    LoraParameterCount count = count_lora_parameters(resolve_model_spec(config), config.lora);
    CHECK(count.total() == trainable);
    CHECK(count.shared_expert_a == shared_a);
  }
}

TEST_CASE("shared expert A: export writes it per expert; both forms reload it exactly", "[shared_a][export]") {
  auto backend = kernels::make_cpu_backend();
  Batch batch = tiny_batch(37, 5);
  for (bool fused : {false, true}) {
    auto model = tiny_model(*backend, true, fused);
    randomize_adapters(*model, 400);
    Tensor logits = model->logits(batch);
    for (AdapterLayout layout : {AdapterLayout::kTransformers5, AdapterLayout::kPerExpert}) {
      if (fused && layout == AdapterLayout::kPerExpert) continue;  // no per-expert key for gate_up (test_fused_gate_up)
      const bool t5 = layout == AdapterLayout::kTransformers5;
      INFO((fused ? "fused" : "separate") << ", " << (t5 ? "transformers5" : "per_expert"));
      fs::path dir = scratch(std::string(fused ? "fused_" : "separate_") + (t5 ? "t5" : "per_expert")) / "adapter";
      export_adapter(*model, dir, layout);

      // Every expert's A is the shared one (PEFT's layout: A [E R, in], expert-major rows).
      SafetensorsFile file((dir / "adapter_model.safetensors").string());
      Parameter* down_a = find_parameter(*model, "model.layers.2.mlp.experts.down_proj.lora_A.weight");
      REQUIRE(down_a);
      const int64_t block = down_a->value.numel();
      for (int64_t e = 0; e < 6; ++e) {
        const std::string key = t5 ? "base_model.model.model.layers.2.mlp.experts.lora_A.weight"
                                   : "base_model.model.model.layers.2.mlp.experts." + std::to_string(e) +
                                         ".down_proj.lora_A.weight";
        Tensor written = file.read_as(key, DType::kF64);
        const double* rows = written.ptr<double>() + (t5 ? e * block : 0);
        for (int64_t i = 0; i < block; ++i) CHECK(rows[i] == down_a->value.ptr<double>()[i]);
      }

      for (bool shared : {true, false}) {
        auto reloaded = tiny_model(*backend, shared, fused);
        load_peft_adapter(*reloaded, dir.string());
        Comparison c = compare_tensors(reloaded->logits(batch), logits, 1e-12, 1e-12, "logits");
        INFO(c.message << (shared ? " (shared)" : " (per expert)"));
        CHECK(c.ok);
        if (!shared) continue;
        std::vector<Parameter*> a = reloaded->parameters(), s = model->parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          Comparison v = compare_tensors(a[i]->value, s[i]->value, 0.0, 0.0, a[i]->name);
          INFO(v.message);
          CHECK(v.ok);
        }
      }
    }
  }
}

TEST_CASE("shared expert A: an adapter whose experts' A differ is refused, naming it and the fix", "[shared_a][export]") {
  auto backend = kernels::make_cpu_backend();
  auto per_expert = tiny_model(*backend, false, false);  // PEFT's init: a different A per expert
  fs::path dir = scratch("differ") / "adapter";
  export_adapter(*per_expert, dir, AdapterLayout::kPerExpert);
  auto shared = tiny_model(*backend, true, false);
  std::string message;
  ExitCode code = ExitCode::kOk;
  try {
    load_peft_adapter(*shared, dir.string());
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  }
  INFO(message);
  CHECK(code == ExitCode::kBadConfig);
  CHECK(contains(message, "expert 1's A differs from expert 0's"));
  CHECK(contains(message, "set lora.expert_a: per_expert"));
  CHECK(contains(message, "model.layers.1.mlp.experts"));
}

TEST_CASE("shared expert A: the config key", "[shared_a][config]") {
  check_lora_key("expert_a", "per_expert", "shared", [](const Config& c) { return c.lora.expert_a; });
  CHECK(contains(adapter_form_config_error({"lora.expert_a=one"}),
                 "`lora.expert_a` = `one` is not allowed: use one of per_expert | shared"));
}

TEST_CASE("shared expert A: training checkpoints and resumes bit for bit", "[shared_a][checkpoint]") {
  const ExpertFormResume run = check_expert_form_resumes(scratch, [](Config& c) { c.lora.expert_a = "shared"; });
  Parameter* a = find_parameter(*run.straight->model, kGateA);
  REQUIRE(a);
  CHECK(a->value.shape() == Shape({4, 16}));
  const Config& split = run.split;
  TrainingRun& second = *run.resumed;

  // The checkpoint holds the one A whole; the exported adapter has it once per expert.
  const fs::path adapter = testing::export_run_adapter(split);
  SafetensorsFile file((adapter / "adapter_model.safetensors").string());
  CHECK(file.info("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight").shape == Shape({6 * 8, 16}));
  auto reloaded = std::make_unique<Model>(resolve_model_spec(split), *second.backend, [&] {
    ModelOptions options;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = split.lora.targets;
    options.shared_expert_a = true;
    return options;
  }());
  load_peft_adapter(*reloaded, adapter.string());
  CHECK(same_adapter_bytes(*reloaded, *second.model));
}
