// The dsa mixer in the whole model: with top-k >= the window it is dense MLA (the absorbed MQA
// form against MlaAttention's expanded keys and values, LoRA on kv_b_proj included), with a
// small top-k the selection changes the result; LoRA gradients against central differences in
// double with the attention gate in both forms (and on MLA); the dsa config rules; its FLOPs by
// hand; and the import of a deepseek_v32 config.json and checkpoint. (tests/unit/test_model_gradcheck.cpp and
// test_data_model.cpp cover DSA through tiny_model_config too.)
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors_writer.h"
#include "core/model/model.h"
#include "core/plan/memory_plan.h"
#include "core/plan/model_flops.h"
#include "core/plan/param_count.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// Every projection of tiny_model_config(true) plus the gate's.
std::vector<std::string> gated_targets() {
  std::vector<std::string> t = all_lora_targets(true);
  t.push_back("g_proj");
  return t;
}

struct Built {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
};

// A double-precision model of `config` with random base weights and random (non-zero B) adapters:
// weights and adapters are drawn by name, so an MLA layer and a DSA layer at the same position
// get the same projections.
Built build(const Config& config, const std::vector<std::string>& targets, bool recompute = false) {
  Built b;
  ModelOptions options;
  options.dtype = DType::kF64;
  options.recompute = recompute;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = targets;
  b.model = std::make_unique<Model>(resolve_model_spec(config), *b.backend, options);
  b.model->init_random_weights();
  for (Parameter* p : b.model->parameters()) fill_random(p->value, std::hash<std::string>{}(p->name) % 1000003, 0.05, 0.3);
  return b;
}

std::vector<Tensor> gradients(Built& b, const Batch& batch, double* loss) {
  for (Parameter* p : b.model->parameters()) b.backend->fill(p->grad, 0.0);
  StepResult r = b.model->forward_backward(batch, 1.0 / static_cast<double>(batch.num_targets()));
  *loss = r.loss_sum;
  std::vector<Tensor> grads;
  for (Parameter* p : b.model->parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    b.backend->copy(g, p->grad);
    grads.push_back(std::move(g));
  }
  return grads;
}

void check(const Comparison& c) {
  INFO(c.message);
  CHECK(c.ok);
}

}  // namespace

TEST_CASE("dsa with top-k >= the window is dense MLA: logits, loss and every adapter gradient", "[model][dsa]") {
  for (const char* gate : {"none", "headwise", "elementwise"}) {
    for (bool rope : {true, false}) {
      INFO("gate " << gate << ", rope " << rope);
      Config dsa = tiny_model_config(true);
      dsa.model.attention_gate = gate;
      dsa.model.mla.use_rope = rope;
      if (!rope) dsa.model.mla.rope_scaling.type = "none";
      dsa.model.layers = {"dsa", "kda", "dsa"};
      dsa.model.dsa.index_topk = 8;  // tiny_batch's windows are 8 tokens
      Config mla = dsa;
      mla.model.layers = {"mla", "kda", "mla"};
      const std::vector<std::string> targets = std::string(gate) == "none" ? all_lora_targets(true) : gated_targets();
      Built a = build(dsa, targets), b = build(mla, targets);
      REQUIRE(a.model->parameters().size() == b.model->parameters().size());
      const Batch batch = tiny_batch(dsa.model.vocab_size, 5);
      check(compare_tensors(a.model->logits(batch), b.model->logits(batch), 1e-11, 1e-12, "logits"));
      double loss_a = 0, loss_b = 0;
      std::vector<Tensor> ga = gradients(a, batch, &loss_a), gb = gradients(b, batch, &loss_b);
      CHECK(std::fabs(loss_a - loss_b) <= 1e-11 * std::fabs(loss_b));
      for (size_t i = 0; i < ga.size(); ++i) check(compare_tensors(ga[i], gb[i], 1e-9, 1e-12, a.model->parameters()[i]->name));
    }
  }
}

TEST_CASE("dsa's selection matters when top-k is smaller than the keys", "[model][dsa]") {
  Config config = tiny_model_config(true);  // MLA, KDA, DSA keeping 3 keys
  Config dense = config;
  dense.model.dsa.index_topk = 8;
  const Batch batch = tiny_batch(config.model.vocab_size, 5);
  Built a = build(config, all_lora_targets(true)), b = build(dense, all_lora_targets(true));
  const Tensor sparse_logits = a.model->logits(batch), dense_logits = b.model->logits(batch);
  // Tokens of tiny_batch's first document (5 tokens) see at most 3 keys up to position 2: equal
  // there; from position 3 on, some keys are dropped.
  const int64_t vocab = config.model.vocab_size;
  double early = 0, late = 0;
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t v = 0; v < vocab; ++v) {
      const double d = std::fabs(sparse_logits.ptr<double>()[t * vocab + v] - dense_logits.ptr<double>()[t * vocab + v]);
      (t < 3 ? early : late) = std::max(t < 3 ? early : late, d);
    }
  CHECK(early <= 1e-12);
  CHECK(late > 1e-6);
}

TEST_CASE("model LoRA gradients match finite differences with gated DSA and gated MLA", "[model][dsa][gradcheck]") {
  struct Variant {
    const char* gate;
    bool interleaved_indexer_rope;
    bool recompute;
  };
  for (Variant v : {Variant{"headwise", true, false}, Variant{"elementwise", false, true}}) {
    INFO("gate " << v.gate);
    Config config = tiny_model_config(true);
    config.model.layers = {"dsa", "kda", "mla"};
    config.model.attention_gate = v.gate;
    config.model.dsa.indexer_rope_interleave = v.interleaved_indexer_rope;
    Built b = build(config, gated_targets(), v.recompute);
    const Batch batch = tiny_batch(config.model.vocab_size, 3);
    const double scale = 1.0 / static_cast<double>(batch.num_targets());
    double loss = 0;
    std::vector<Tensor> grads = gradients(b, batch, &loss);
    std::vector<Parameter*> params = b.model->parameters();
    GradCheckOptions options;
    options.max_elements = 6;
    options.atol = 1e-9;
    int nonzero = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      auto objective = [&] { return b.model->forward_backward(batch, scale).loss_sum * scale; };
      check(check_gradient(objective, params[i]->value, grads[i], params[i]->name, options));
      nonzero += b.backend->sum_squares(grads[i]) > 0.0;
    }
    CHECK(nonzero == static_cast<int>(params.size()));
  }
}

TEST_CASE("dsa config rules name the keys", "[model][dsa][config]") {
  auto message = [](const Config& c) { return error_message([&] { validate_config(c); }); };
  Config config = tiny_model_config(true);
  validate_config(config);
  CHECK(resolve_model_spec(config).mixers[2] == MixerKind::kDsa);

  Config no_q_latent = config;
  no_q_latent.model.mla.q_lora_rank.reset();
  CHECK(contains(message(no_q_latent), "`model.layers` has dsa layers but `model.mla.q_lora_rank` is null"));
  no_q_latent.model.layers = {"mla", "kda", "mla"};
  CHECK(message(no_q_latent).empty());

  Config narrow = config;
  narrow.model.dsa.index_head_dim = 2;  // rope dims 4
  CHECK(contains(message(narrow), "`model.dsa.index_head_dim` = 2 is smaller than `model.mla.qk_rope_head_dim` = 4"));
  narrow.model.mla.use_rope = false;  // NoPE: nothing to rotate
  narrow.model.mla.rope_scaling.type = "none";
  CHECK(message(narrow).empty());

  Config zero = config;
  zero.model.dsa.index_topk = 0;
  CHECK(contains(message(zero), "`model.dsa.index_topk` = 0 must be > 0"));
  zero.model.dsa.index_n_heads = -1;
  CHECK(contains(message(zero), "`model.dsa.index_n_heads` = -1 must be > 0"));

  const std::string yaml = "model: {vocab_size: 8, hidden_size: 8, num_layers: 1, dsa: {index_topk: 4, top_k: 2}}\n";
  CHECK(contains(error_message([&] { parse_config(yaml, "dsa.yaml"); }), "model.dsa.top_k"));
}

TEST_CASE("step FLOPs of a DSA layer and the gate, by hand", "[model][dsa][flops]") {
  // tiny_model_config(true): D 16, MLA H 2, q LoRA 12, kv rank r 8, qk 6 + 4, v 5; indexer 2 x 6,
  // top 3. 8 tokens in documents of 3 and 5: 6 + 15 = 21 causal pairs, of which a top 3 keeps
  // 6 + (6 + 2 * 3) = 18.
  Config dsa = tiny_model_config(true);
  Config mla = dsa;
  mla.model.layers = {"mla", "kda", "mla"};
  const StepFlops with = ModelFlops(plan_model_spec(dsa.model), dsa.lora).step(8, {0, 3, 8});
  const StepFlops without = ModelFlops(plan_model_spec(mla.model), mla.lora).step(8, {0, 3, 8});
  // The same projections as MLA; the frozen indexer runs forward only: 2 x (wq_b 2*6*12 + wk 6*16 +
  // weights_proj 2*16) per token.
  CHECK(with.frozen - without.frozen == 2.0 * (144 + 96 + 32) * 8);
  // Sparse attention 2 (2 r + d_r) H = 80 per selected pair, 3.5x with backward; the indexer's
  // scores 2 Hi di = 24 per causal pair; MLA's dense 2 (qk + v) H = 60 per pair, 3.5x.
  CHECK(with.attention - without.attention == 3.5 * 80 * 18 + 24 * 21 - 3.5 * 60 * 21);
  CHECK(with.lora == without.lora);
  // The gate's g_proj on both attention layers, a frozen matmul: 4 x D H v per token.
  Config gated = dsa;
  gated.model.attention_gate = "elementwise";
  const StepFlops gated_step = ModelFlops(plan_model_spec(gated.model), gated.lora).step(8, {0, 3, 8});
  CHECK(gated_step.frozen - with.frozen == 4.0 * 2 * (16 * 2 * 5) * 8);
}

TEST_CASE("the shipped configs with dsa layers say what their headers promise", "[model][dsa][config]") {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR) + "/configs/";
  // quickstart-dsa: KDA 3 : 1 gated DSA whose top-k is smaller than a window; it builds.
  Config quick = load_config(dir + "quickstart-dsa.yaml");
  ModelSpec spec = resolve_model_spec(quick);
  CHECK(spec.mixers == std::vector<MixerKind>{MixerKind::kKda, MixerKind::kKda, MixerKind::kKda, MixerKind::kDsa});
  CHECK(spec.config.attention_gate == "elementwise");
  CHECK(spec.config.dsa.index_topk < quick.data.seq_len);
  CHECK(quick.train.device == "auto");  // the GPU when there is one: the DSA ops have CUDA kernels
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.lora_targets = quick.lora.targets;
  Model model(spec, *backend, options);
  validate_for_world(quick, 1);

  // seed-2.8t: 69 KDA + 24 gated DSA layers, counted exactly; it fits 128 H200s with recompute.
  Config seed = load_config(dir + "seed-2.8t.yaml");
  ModelSpec seed_spec = plan_model_spec(seed.model);
  CHECK(std::count(seed_spec.mixers.begin(), seed_spec.mixers.end(), MixerKind::kDsa) == 24);
  CHECK(std::count(seed_spec.mixers.begin(), seed_spec.mixers.end(), MixerKind::kKda) == 69);
  CHECK(seed.model.dsa.index_topk == 2048);
  PlanOptions plan_options;
  plan_options.world = 128;
  MemoryPlan plan = make_memory_plan(seed, plan_options);
  CHECK(plan.params.total() > 2.7e12);
  CHECK(plan.params.total() < 2.8e12);
  CHECK(plan.fits());
}

// ---------------------------------------------------------------------------------------------
// deepseek_v32 import

namespace {

// A tiny config.json as transformers 5 saves a DeepseekV32Config (the keys it writes for the
// model's shape; 3 layers, the first dense).
const char* kDeepseekV32Config = R"({
  "architectures": ["DeepseekV32ForCausalLM"],
  "model_type": "deepseek_v32",
  "vocab_size": 37, "hidden_size": 16, "intermediate_size": 24, "moe_intermediate_size": 8,
  "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
  "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
  "head_dim": 4, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
  "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
  "mlp_layer_types": ["dense", "sparse", "sparse"],
  "layer_types": ["deepseek_sparse_attention", "deepseek_sparse_attention", "deepseek_sparse_attention"],
  "index_topk": 3, "index_head_dim": 6, "index_n_heads": 2,
  "rms_norm_eps": 1e-06, "max_position_embeddings": 32, "tie_word_embeddings": false, "hidden_act": "silu",
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}
})";

std::string with(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  REQUIRE(at != std::string::npos);
  return json.replace(at, from.size(), to);
}

std::string import_error(const std::string& json) {
  return error_message([&] { model_config_from_hf_json(json, "v32/config.json"); });
}

}  // namespace

TEST_CASE("a deepseek_v32 config.json maps onto dsa layers", "[model][dsa][import]") {
  ModelConfig m = model_config_from_hf_json(kDeepseekV32Config, "v32/config.json");
  CHECK(m.model_type == "deepseek_v32");
  CHECK(m.layers == std::vector<std::string>(3, "dsa"));
  CHECK(m.first_k_dense == 1);
  CHECK(m.mla.q_lora_rank == std::optional<int64_t>(12));
  CHECK(m.mla.use_rope);
  CHECK(m.dsa.index_n_heads == 2);
  CHECK(m.dsa.index_head_dim == 6);
  CHECK(m.dsa.index_topk == 3);
  CHECK(!m.dsa.indexer_rope_interleave);
  CHECK(m.attention_gate == "none");
  CHECK(m.moe.num_experts == 6);
  CHECK(m.moe.routed_scaling_factor == 2.5);
  CHECK(model_config_from_hf_json(with(kDeepseekV32Config, R"("index_topk": 3)",
                                       R"("index_topk": 3, "indexer_rope_interleave": true)"),
                                  "glm/config.json")
            .dsa.indexer_rope_interleave);
  // mlp_layer_types wins over first_k_dense_replace (transformers builds the layers from it).
  CHECK(model_config_from_hf_json(with(kDeepseekV32Config, R"(["dense", "sparse", "sparse"])",
                                       R"(["dense", "dense", "sparse"])"),
                                  "v32/config.json")
            .first_k_dense == 2);

  CHECK(contains(import_error(with(kDeepseekV32Config, R"("q_lora_rank": 12)", R"("q_lora_rank": null)")),
                 "q_lora_rank is null"));
  CHECK(contains(import_error(with(kDeepseekV32Config, R"("index_topk": 3, )", "")), "missing key \"index_topk\""));
}

TEST_CASE("a deepseek_v32 checkpoint (indexer weights included) loads to the model that wrote it",
          "[model][dsa][import]") {
  const fs::path dir = fs::temp_directory_path() / "moetrain_dsa_import";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << kDeepseekV32Config;
  Config config;
  config.model.hf_dir = dir.string();
  config.data.seq_len = 8;
  const ModelSpec spec = resolve_model_spec(config);
  REQUIRE(spec.mixers == std::vector<MixerKind>(3, MixerKind::kDsa));

  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora_targets = {"q_a_proj", "o_proj"};
  Model written(spec, *backend, options);
  written.init_random_weights();
  std::vector<Tensor> hold;  // the checkpoint's data, viewed by `named`: never reallocated
  hold.reserve(written.weight_slots().size());
  std::vector<NamedTensor> named;
  bool has_indexer = false;
  for (const WeightSlot& slot : written.weight_slots()) {
    has_indexer = has_indexer || slot.name == "model.layers.1.self_attn.indexer.k_norm.bias";
    if (slot.layout != WeightLayout::kPlain) continue;  // the MoE layers' SwiGLU stacks: below
    hold.emplace_back(slot.tensor->shape(), DType::kF64);
    backend->copy(hold.back(), *slot.tensor);
  }
  REQUIRE(has_indexer);
  // Checkpoint names: plain weights under their own names, SwiGLU stacks split per projection.
  size_t k = 0;
  for (const WeightSlot& slot : written.weight_slots()) {
    if (slot.layout == WeightLayout::kPlain) {
      named.push_back({slot.name, hold[k++].view()});
      continue;
    }
    Tensor& t = hold.emplace_back(slot.tensor->shape(), DType::kF64);
    backend->copy(t, *slot.tensor);
    const int64_t groups = t.size(0), rows = t.size(1), cols = t.size(2);
    for (int64_t g = 0; g < groups; ++g) {
      const std::string prefix = groups > 1 || slot.name.find(".experts") != std::string::npos
                                     ? slot.name + "." + std::to_string(g)
                                     : slot.name;
      TensorView group = t.view().slice_rows(g, g + 1).reshaped({rows, cols});
      if (slot.layout == WeightLayout::kSwigluDown) {
        named.push_back({prefix + ".down_proj.weight", group});
      } else {
        named.push_back({prefix + ".gate_proj.weight", group.slice_rows(0, rows / 2)});
        named.push_back({prefix + ".up_proj.weight", group.slice_rows(rows / 2, rows)});
      }
    }
  }
  write_hf_checkpoint(dir.string(), named, HfShardedWriteParams{});

  Model loaded(spec, *backend, options);
  loaded.load_weights(HfCheckpoint(dir.string()));
  const Batch batch = tiny_batch(spec.config.vocab_size, 7);
  check(compare_tensors(loaded.logits(batch), written.logits(batch), 0.0, 0.0, "logits"));
  fs::remove_all(dir);
}
