// PEFT's fused expert adapter (`lora.expert_gate_up: fused`): one adapter of rank 2r and alpha
// 2 alpha per routed expert on the whole gate_up output (SwigluExperts::gate_up_lora).
//  - the forward against W'[e] = W[e] + s B_e A_e written out by hand (PEFT's ParamWrapper), and
//    every gradient (A, B, x, the down adapter's) against central differences in double;
//  - separate gate and up adapters are the block-diagonal special case: same outputs, and the
//    fused gradients' diagonal blocks are the separate ones';
//  - the whole model: gradients by finite differences, checkpoint + resume bit for bit, the
//    parameter count of `moetrain plan`;
//  - export -> reload (both model forms), and the refusals of what a form cannot hold, each
//    naming the tensor and the setting to change; the config key and its rules.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/checkpoint/checkpoint_session.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/model/swiglu_experts.h"
#include "core/plan/param_count.h"
#include "core/data/synthetic_data.h"
#include "adapter_testing.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "routed_experts.h"
#include "tiny_model.h"
#include "training_run.h"

using namespace moetrain;
using namespace moetrain::testing;
using namespace moetrain::testing::routed_experts;
namespace fs = std::filesystem;

namespace {

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// Routed experts with a fused gate_up adapter (rank 2 * 2, alpha 2 * 3) and a down adapter.
struct Experts : RoutedExperts {
  explicit Experts(bool fused)
      : RoutedExperts([&](SwigluExperts& mlp, kernels::Backend& backend) {
          const LoraSettings lora{2, 3.0, false};
          if (fused) {
            mlp.add_fused_gate_up_lora(lora, DType::kF64, backend, 3);
          } else {
            mlp.add_lora(SwigluExperts::kGate, lora, DType::kF64, backend, 3);
            mlp.add_lora(SwigluExperts::kUp, lora, DType::kF64, backend, 4);
          }
          mlp.add_lora(SwigluExperts::kDown, lora, DType::kF64, backend, 5);
        }) {}
};

// PEFT's ParamWrapper, written out: expert e's weights W'[e] = W[e] + s B_e A_e, then the SwiGLU
// expert with those weights.
Tensor reference_forward(const Experts& f) {
  const LoraAdapter& gu = *f.mlp.gate_up_lora;
  const LoraAdapter& dn = *f.mlp.lora[SwigluExperts::kDown];
  const int64_t r2 = gu.a.value.size(1), r = dn.a.value.size(1);
  Tensor out = Tensor::zeros({kRows, kHidden}, DType::kF64);
  for (int64_t e = 0; e < kGroups; ++e) {
    std::vector<double> w(2 * kWidth * kHidden), wd(kHidden * kWidth);
    for (int64_t o = 0; o < 2 * kWidth; ++o)
      for (int64_t i = 0; i < kHidden; ++i) {
        double delta = 0.0;
        for (int64_t k = 0; k < r2; ++k)
          delta += gu.b.value.ptr<double>()[(e * 2 * kWidth + o) * r2 + k] * gu.a.value.ptr<double>()[(e * r2 + k) * kHidden + i];
        w[o * kHidden + i] = f.mlp.gate_up.ptr<double>()[(e * 2 * kWidth + o) * kHidden + i] + gu.scale * delta;
      }
    for (int64_t o = 0; o < kHidden; ++o)
      for (int64_t i = 0; i < kWidth; ++i) {
        double delta = 0.0;
        for (int64_t k = 0; k < r; ++k)
          delta += dn.b.value.ptr<double>()[(e * kHidden + o) * r + k] * dn.a.value.ptr<double>()[(e * r + k) * kWidth + i];
        wd[o * kWidth + i] = f.mlp.down.ptr<double>()[(e * kHidden + o) * kWidth + i] + dn.scale * delta;
      }
    for (int64_t row = kOffsets[e]; row < kOffsets[e + 1]; ++row) {
      std::vector<double> g(2 * kWidth, 0.0), h(kWidth);
      for (int64_t o = 0; o < 2 * kWidth; ++o)
        for (int64_t i = 0; i < kHidden; ++i) g[o] += w[o * kHidden + i] * f.x.ptr<double>()[row * kHidden + i];
      for (int64_t j = 0; j < kWidth; ++j) h[j] = silu(g[j]) * g[kWidth + j];
      for (int64_t o = 0; o < kHidden; ++o)
        for (int64_t j = 0; j < kWidth; ++j) out.ptr<double>()[row * kHidden + o] += wd[o * kWidth + j] * h[j];
    }
  }
  return out;
}

// The whole tiny model (MLA, KDA, DSA, dense and MoE layers) with every target, in F64.
std::unique_ptr<Model> tiny_model(kernels::Backend& backend, bool fused, bool rslora = false) {
  return tiny_form_model(backend, {/*fused_gate_up=*/fused, /*shared_a=*/false, rslora});
}

Tensor host_copy(kernels::Backend& backend, const Tensor& t) {
  Tensor out(t.shape(), t.dtype());
  backend.copy(out, t);
  return out;
}

fs::path scratch(const std::string& name) { return scratch_dir("fused_gate_up", name); }

void export_adapter(Model& model, const fs::path& dir, bool rslora = false) {
  AdapterExportSettings settings;
  settings.rank = 4;
  settings.alpha = 8.0;
  settings.rslora = rslora;
  HostParameters values(model);
  write_peft_adapter(dir.string(), values.views, settings);
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_json(const fs::path& path, const nlohmann::json& json) { std::ofstream(path) << json.dump(2); }

const char* kGateUpB = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight";

}  // namespace

TEST_CASE("fused gate_up: the forward is the experts with W[e] + s B_e A_e, as PEFT's ParamWrapper", "[fused]") {
  Experts f(/*fused=*/true);
  REQUIRE(f.mlp.gate_up_lora);
  CHECK(f.mlp.gate_up_lora->a.name == "model.layers.1.mlp.experts.gate_up_proj.lora_A.weight");
  CHECK(f.mlp.gate_up_lora->a.value.shape() == Shape({kGroups, 4, kHidden}));  // rank 2r
  CHECK(f.mlp.gate_up_lora->b.value.shape() == Shape({kGroups, 2 * kWidth, 4}));
  CHECK(f.mlp.gate_up_lora->scale == 6.0 / 4.0);  // PEFT: (2 alpha) / (2r)
  CHECK(!f.mlp.lora[SwigluExperts::kGate]);
  Comparison c = compare_tensors(f.forward(), reference_forward(f), 1e-12, 1e-12, "out");
  INFO(c.message);
  CHECK(c.ok);
}

TEST_CASE("fused gate_up: gradients of A, B, x and the down adapter match central differences", "[fused][gradcheck]") {
  Experts f(/*fused=*/true);
  Tensor dx = f.backward();
  std::vector<Parameter*> params;
  f.mlp.collect_parameters(params);
  REQUIRE(params.size() == 4);  // gate_up A, B; down A, B
  CHECK(params[0] == &f.mlp.gate_up_lora->a);
  GradCheckOptions options;
  options.max_elements = 1000;  // every element
  options.atol = 1e-9;
  for (Parameter* p : params) {
    Comparison c = check_gradient([&] { return f.loss(); }, p->value, p->grad, p->name, options);
    INFO(c.message);
    CHECK(c.ok);
    // The expert without tokens gets no gradient; the others do, in every entry.
    const int64_t block = p->grad.numel() / kGroups;
    for (int64_t i = 0; i < p->grad.numel(); ++i) {
      const double g = p->grad.ptr<double>()[i];
      if (i / block == 1) CHECK(g == 0.0);
      else CHECK(g != 0.0);
    }
  }
  Comparison c = check_gradient([&] { return f.loss(); }, f.x, dx, "x", options);
  INFO(c.message);
  CHECK(c.ok);
}

TEST_CASE("fused gate_up: separate gate and up adapters are its block-diagonal case", "[fused]") {
  Experts separate(/*fused=*/false), fused(/*fused=*/true);
  LoraAdapter& gate = *separate.mlp.lora[SwigluExperts::kGate];
  LoraAdapter& up = *separate.mlp.lora[SwigluExperts::kUp];
  LoraAdapter& gu = *fused.mlp.gate_up_lora;
  // Same base weights, inputs and down adapter; A = [A_gate; A_up], B = diag(B_gate, B_up).
  const int64_t r = 2;
  fused.backend->fill(gu.b.value, 0.0);
  for (int64_t e = 0; e < kGroups; ++e) {
    for (int64_t k = 0; k < r; ++k)
      for (int64_t i = 0; i < kHidden; ++i) {
        gu.a.value.ptr<double>()[(e * 2 * r + k) * kHidden + i] = gate.a.value.ptr<double>()[(e * r + k) * kHidden + i];
        gu.a.value.ptr<double>()[(e * 2 * r + r + k) * kHidden + i] = up.a.value.ptr<double>()[(e * r + k) * kHidden + i];
      }
    for (int64_t o = 0; o < kWidth; ++o)
      for (int64_t k = 0; k < r; ++k) {
        gu.b.value.ptr<double>()[(e * 2 * kWidth + o) * 2 * r + k] = gate.b.value.ptr<double>()[(e * kWidth + o) * r + k];
        gu.b.value.ptr<double>()[(e * 2 * kWidth + kWidth + o) * 2 * r + r + k] =
            up.b.value.ptr<double>()[(e * kWidth + o) * r + k];
      }
  }
  LoraAdapter& down_s = *separate.mlp.lora[SwigluExperts::kDown];
  LoraAdapter& down_f = *fused.mlp.lora[SwigluExperts::kDown];
  fused.backend->copy(down_f.a.value, down_s.a.value);
  fused.backend->copy(down_f.b.value, down_s.b.value);
  REQUIRE(gu.scale == gate.scale);  // (2 alpha) / (2r) = alpha / r

  Comparison c = compare_tensors(fused.forward(), separate.forward(), 1e-12, 1e-13, "out");
  INFO(c.message);
  CHECK(c.ok);
  Tensor dx_fused = fused.backward(), dx_separate = separate.backward();
  c = compare_tensors(dx_fused, dx_separate, 1e-12, 1e-13, "dx");
  INFO(c.message);
  CHECK(c.ok);
  // Diagonal blocks: the separate adapters' gradients. Off-diagonal blocks: non-zero (training
  // would fill them: that is why a trained fused B is a full matrix).
  bool off_diagonal_moves = false;
  for (int64_t e : {0, 2}) {
    for (int64_t k = 0; k < r; ++k)
      for (int64_t i = 0; i < kHidden; ++i) {
        CHECK(gu.a.grad.ptr<double>()[(e * 2 * r + k) * kHidden + i] ==
              Approx(gate.a.grad.ptr<double>()[(e * r + k) * kHidden + i]).epsilon(1e-12));
        CHECK(gu.a.grad.ptr<double>()[(e * 2 * r + r + k) * kHidden + i] ==
              Approx(up.a.grad.ptr<double>()[(e * r + k) * kHidden + i]).epsilon(1e-12));
      }
    for (int64_t o = 0; o < kWidth; ++o)
      for (int64_t k = 0; k < r; ++k) {
        CHECK(gu.b.grad.ptr<double>()[(e * 2 * kWidth + o) * 2 * r + k] ==
              Approx(gate.b.grad.ptr<double>()[(e * kWidth + o) * r + k]).epsilon(1e-12));
        CHECK(gu.b.grad.ptr<double>()[(e * 2 * kWidth + kWidth + o) * 2 * r + r + k] ==
              Approx(up.b.grad.ptr<double>()[(e * kWidth + o) * r + k]).epsilon(1e-12));
        off_diagonal_moves |= gu.b.grad.ptr<double>()[(e * 2 * kWidth + o) * 2 * r + r + k] != 0.0;
      }
  }
  CHECK(off_diagonal_moves);
}

TEST_CASE("fused gate_up: whole-model gradients match finite differences; plan counts its parameters", "[fused][gradcheck]") {
  auto backend = kernels::make_cpu_backend();
  auto model = tiny_model(*backend, /*fused=*/true);
  randomize_adapters(*model, 300);
  Parameter* a = find_parameter(*model, "model.layers.1.mlp.experts.gate_up_proj.lora_A.weight");
  Parameter* b = find_parameter(*model, "model.layers.2.mlp.experts.gate_up_proj.lora_B.weight");
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a->value.shape() == Shape({6, 8, 16}));  // 6 experts, rank 2r = 8, hidden 16
  CHECK(b->value.shape() == Shape({6, 16, 8}));  // 2F = 16
  CHECK(!find_parameter(*model, "model.layers.1.mlp.experts.gate_proj.lora_A.weight"));
  CHECK(find_parameter(*model, "model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight"));  // shared: separate

  Batch batch = tiny_batch(37, 3);
  const double scale = 1.0 / static_cast<double>(batch.num_targets());
  for (Parameter* p : model->parameters()) backend->fill(p->grad, 0.0);
  model->forward_backward(batch, scale);
  std::vector<Tensor> grads;  // copied now: every evaluation below adds to p->grad
  for (Parameter* p : model->parameters()) grads.push_back(host_copy(*backend, p->grad));
  GradCheckOptions options;
  options.eps = 1e-6;
  options.rtol = 1e-5;
  options.atol = 1e-9;
  options.max_elements = 8;
  std::vector<Parameter*> params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter* p = params[i];
    const Tensor& grad = grads[i];
    if (p->value.shape().ndim() != 3) continue;  // test_model_gradcheck covers the others
    auto objective = [&] {
      StepResult r = model->forward_backward(batch, scale);
      return r.loss_sum * scale + r.aux_loss;
    };
    Comparison c = check_gradient(objective, p->value, grad, p->name, options);
    INFO(c.message);
    CHECK(c.ok);
    CHECK(backend->sum_squares(grad) > 0.0);
  }

  Config config = tiny_model_config(true);
  config.lora.rank = 4;
  config.lora.targets = all_lora_targets(true);
  config.lora.expert_gate_up = "fused";
  int64_t trainable = 0;
  for (Parameter* p : model->parameters()) trainable += p->value.numel();
  CHECK(count_lora_parameters(resolve_model_spec(config), config.lora).total() == trainable);
}

TEST_CASE("fused gate_up: export writes PEFT's rank-2r adapter, which reloads exactly", "[fused][export]") {
  auto backend = kernels::make_cpu_backend();
  auto model = tiny_model(*backend, /*fused=*/true);
  randomize_adapters(*model, 400);
  Batch batch = tiny_batch(37, 5);
  Tensor logits = model->logits(batch);
  fs::path dir = scratch("export") / "adapter";
  export_adapter(*model, dir);

  nlohmann::json config = read_json(dir / "adapter_config.json");
  CHECK(config["r"] == 4);
  CHECK(config["lora_alpha"] == 8.0);
  CHECK(config["rank_pattern"] == nlohmann::json({{".*\\.gate_up_proj", 8}}));
  CHECK(config["alpha_pattern"] == nlohmann::json({{".*\\.gate_up_proj", 16.0}}));
  CHECK(config["target_parameters"] ==
        nlohmann::json({"down_proj.weight", "gate_proj.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                        "up_proj.weight"}));
  SafetensorsFile file((dir / "adapter_model.safetensors").string());
  CHECK(file.info("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight").shape == Shape({6 * 8, 16}));
  CHECK(file.info(kGateUpB).shape == Shape({16, 8 * 6}));
  CHECK(file.info("base_model.model.model.layers.1.mlp.experts.lora_B.weight").shape == Shape({16, 4 * 6}));
  // PEFT's layout of B: expert e's rank k is column k E + e.
  Parameter* b = find_parameter(*model, "model.layers.1.mlp.experts.gate_up_proj.lora_B.weight");
  Tensor written = file.read_as(kGateUpB, DType::kF64);
  for (int64_t e : {0, 5})
    for (int64_t o : {0, 15})
      for (int64_t k : {0, 7})
        CHECK(written.ptr<double>()[o * 48 + k * 6 + e] ==
              static_cast<double>(static_cast<float>(b->value.ptr<double>()[(e * 16 + o) * 8 + k])));

  auto reloaded = tiny_model(*backend, /*fused=*/true);
  load_peft_adapter(*reloaded, dir.string());
  HostParameters before(*model), after(*reloaded);
  REQUIRE(before.values.size() == after.values.size());
  for (size_t i = 0; i < before.values.size(); ++i) {
    Comparison c = compare_tensors(after.values[i], before.values[i], 0.0, 0.0, before.views[i].first);
    INFO(c.message);
    CHECK(c.ok);
  }
  Comparison c = compare_tensors(reloaded->logits(batch), logits, 0.0, 0.0, "logits");
  INFO(c.message);
  CHECK(c.ok);
}

TEST_CASE("fused gate_up: what each model form holds, and the refusals naming the tensor and the fix", "[fused][export]") {
  auto backend = kernels::make_cpu_backend();
  Batch batch = tiny_batch(37, 6);

  SECTION("a full-B fused adapter into separate adapters: refused, set lora.expert_gate_up: fused") {
    auto fused = tiny_model(*backend, true);
    randomize_adapters(*fused, 500);
    fs::path dir = scratch("full_b") / "adapter";
    export_adapter(*fused, dir);
    auto separate = tiny_model(*backend, false);
    check_load_refused(*separate, dir, ExitCode::kBadConfig,
                       {kGateUpB, "B mixes gate and up", "Set lora.expert_gate_up: fused"});
  }

  SECTION("separate adapters (block-diagonal export, and per expert) load into the fused form exactly") {
    for (bool rslora : {false, true}) {
      auto separate = tiny_model(*backend, false, rslora);
      randomize_adapters(*separate, 600);
      Tensor expected = separate->logits(batch);
      fs::path root = scratch(rslora ? "separate_rslora" : "separate");
      export_adapter(*separate, root / "transformers5", rslora);
      AdapterExportSettings per_expert;
      per_expert.layout = AdapterLayout::kPerExpert;
      per_expert.rank = 4;
      per_expert.alpha = 8.0;
      per_expert.rslora = rslora;
      HostParameters values(*separate);
      write_peft_adapter((root / "per_expert").string(), values.views, per_expert);
      for (const char* layout : {"transformers5", "per_expert"}) {
        auto fused = tiny_model(*backend, true, rslora);
        load_peft_adapter(*fused, (root / layout).string());
        Comparison c = compare_tensors(fused->logits(batch), expected, 1e-6, 1e-6, layout);
        INFO(c.message << (rslora ? " (rsLoRA)" : ""));
        CHECK(c.ok);
        // And back into separate adapters: exactly the values exported.
        auto again = tiny_model(*backend, false, rslora);
        load_peft_adapter(*again, (root / layout).string());
        std::vector<Parameter*> a = again->parameters(), s = separate->parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          Comparison v = compare_tensors(a[i]->value, s[i]->value, rslora ? 1e-7 : 0.0, 0.0, a[i]->name);
          INFO(v.message);
          CHECK(v.ok);
        }
      }
    }
  }

  SECTION("a rank-r gate_up adapter (no rank_pattern, A shared) into the fused form: refused, set separate") {
    auto fused = tiny_model(*backend, true);
    fs::path dir = scratch("rank_r") / "adapter";
    export_adapter(*fused, dir);
    // Rewrite it as PEFT writes a plain target_parameters adapter: gate_up at rank r.
    SafetensorsFile file((dir / "adapter_model.safetensors").string());
    std::vector<Tensor> keep;
    SafetensorsWriter writer;
    for (const std::string& key : file.names()) {
      Tensor t = file.read_as(key, DType::kF32);
      if (key.find(".experts.base_layer.") != std::string::npos) {  // keep ranks [0, r): rows / columns
        const bool is_a = key.find("lora_A") != std::string::npos;
        Tensor cut(is_a ? Shape{6 * 4, 16} : Shape{16, 4 * 6}, DType::kF32);
        for (int64_t i = 0; i < cut.numel(); ++i) {
          const int64_t row = i / cut.size(1), col = i % cut.size(1);
          cut.ptr<float>()[i] = is_a ? t.ptr<float>()[((row / 4) * 8 + row % 4) * 16 + col] : t.ptr<float>()[row * 48 + col];
        }
        t = std::move(cut);
      }
      keep.push_back(std::move(t));
      writer.add(key, keep.back().view());
    }
    writer.write((dir / "adapter_model.safetensors").string());
    nlohmann::json config = read_json(dir / "adapter_config.json");
    config["rank_pattern"] = nlohmann::json::object();
    config["alpha_pattern"] = nlohmann::json::object();
    write_json(dir / "adapter_config.json", config);

    check_load_refused(*fused, dir, ExitCode::kBadConfig,
                       {kGateUpB, "rank-4 gate_up adapter", "Set lora.expert_gate_up: separate"});
    auto separate = tiny_model(*backend, false);
    CHECK(load_error(*separate, dir).first == ExitCode::kOk);  // which holds it exactly
    // A shared by gate and up; B's rows split.
    Parameter* gate_a = find_parameter(*separate, "model.layers.1.mlp.experts.gate_proj.lora_A.weight");
    Parameter* up_a = find_parameter(*separate, "model.layers.1.mlp.experts.up_proj.lora_A.weight");
    CHECK(std::memcmp(gate_a->value.data(), up_a->value.data(), gate_a->value.nbytes()) == 0);
  }

  SECTION("a gate_up rank neither form holds, and unsupported patterns: refused naming them") {
    auto fused = tiny_model(*backend, true);
    fs::path dir = scratch("rank_12") / "adapter";
    export_adapter(*fused, dir);
    nlohmann::json config = read_json(dir / "adapter_config.json");
    config["rank_pattern"] = {{".*\\.gate_up_proj", 12}};
    write_json(dir / "adapter_config.json", config);
    // base_layer.lora_A.weight: its shape [48, 16] is not rank 12's [72, 16].
    check_load_refused(*fused, dir, ExitCode::kBadCheckpoint, {"base_layer.lora_A.weight"});

    config["rank_pattern"] = {{"o_proj", 8}};
    write_json(dir / "adapter_config.json", config);
    check_load_refused(*fused, dir, ExitCode::kBadCheckpoint, {"rank_pattern", "\"o_proj\""});
  }

  SECTION("the per_expert export layout has no key for a fused adapter") {
    auto fused = tiny_model(*backend, true);
    AdapterExportSettings settings;
    settings.layout = AdapterLayout::kPerExpert;
    settings.rank = 4;
    settings.alpha = 8.0;
    HostParameters values(*fused);
    std::string message = error_message([&] { write_peft_adapter(scratch("per_expert").string(), values.views, settings); });
    CHECK(contains(message, "gate_up_proj"));
    CHECK(contains(message, "export_layout: transformers5"));
  }
}

TEST_CASE("fused gate_up: the config key and its rules", "[fused][config]") {
  check_lora_key("expert_gate_up", "separate", "fused", [](const Config& c) { return c.lora.expert_gate_up; });
  std::string message = adapter_form_config_error({"lora.expert_gate_up=fuse"});
  CHECK(contains(message, "lora.expert_gate_up"));
  CHECK(contains(message, "fused"));
  message = adapter_form_config_error({"lora.expert_gate_up=fused", "checkpoint.export_layout=per_expert"});
  CHECK(contains(message, "`checkpoint.export_layout` = `per_expert` cannot hold `lora.expert_gate_up` = `fused`"));
}

TEST_CASE("fused gate_up: training checkpoints and resumes bit for bit, and exports the fused adapter", "[fused][checkpoint]") {
  const ExpertFormResume run =
      check_expert_form_resumes(scratch, [](Config& c) { c.lora.expert_gate_up = "fused"; });
  // Training moves the fused B (zero at the start) off zero everywhere: an expert that got tokens
  // has a full B, gate rows in the up ranks included.
  Parameter* b = find_parameter(*run.straight->model, "model.layers.1.mlp.experts.gate_up_proj.lora_B.weight");
  REQUIRE(b);
  const int64_t block = b->value.numel() / b->value.size(0);
  int64_t full = 0;
  for (int64_t e = 0; e < b->value.size(0); ++e) {
    bool all = true;
    for (int64_t i = 0; i < block; ++i) all &= b->value.ptr<float>()[e * block + i] != 0.0f;
    full += all;
  }
  CHECK(full >= 1);

  const fs::path adapter = testing::export_run_adapter(run.split);
  SafetensorsFile file((adapter / "adapter_model.safetensors").string());
  CHECK(file.info(kGateUpB).shape == Shape({16, 8 * 6}));
  CHECK(read_json(adapter / "adapter_config.json")["rank_pattern"] == nlohmann::json({{".*\\.gate_up_proj", 8}}));
}
