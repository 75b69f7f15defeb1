// Importing Kimi-Linear: config.json in the released spelling and in transformers 5's, its
// errors, and the weights in both checkpoint layouts (Moonshot's released names and per-expert
// w1/w2/w3 under block_sparse_moe; transformers 5's renamed KDA modules, packed conv, reshaped
// A_log/dt_bias and fused experts): either layout loads to exactly the model that wrote it.
// And Kimi K3 (model_type kimi_k3): its text_config, K3's defaults, and a checkpoint whose text
// model lives under language_model. (NeMo AutoModel's kimi_k3 names).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/io/safetensors.h"
#include "core/io/hf_index.h"
#include "core/model/hf_names.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/io/safetensors_writer.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// A tiny Kimi-Linear config.json as Moonshot ships it (the real one's keys and layout; 4 layers,
// layers 2 and 4 full attention, 1-based).
const char* kReleasedConfig = R"({
  "architectures": ["KimiLinearForCausalLM"],
  "model_type": "kimi_linear",
  "vocab_size": 41, "hidden_size": 16, "intermediate_size": 24, "moe_intermediate_size": 8,
  "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 72,
  "kv_lora_rank": 8, "q_lora_rank": null, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
  "mla_use_nope": true, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": true,
  "moe_router_activation_func": "sigmoid", "num_expert_group": 2, "topk_group": 1, "use_grouped_topk": true,
  "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-05, "model_max_length": 64, "rope_theta": 10000.0,
  "rope_scaling": null, "tie_word_embeddings": false, "hidden_act": "silu",
  "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 4, "num_heads": 3,
                         "short_conv_kernel_size": 4}
})";

// The same model as transformers 5 describes it (flat linear_* keys, layer_types, mlp_layer_types).
const char* kTransformersConfig = R"({
  "model_type": "kimi_linear",
  "vocab_size": 41, "hidden_size": 16, "intermediate_size": 24, "moe_intermediate_size": 8,
  "num_hidden_layers": 4, "num_attention_heads": 2, "kv_lora_rank": 8, "q_lora_rank": null,
  "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
  "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": true,
  "num_expert_group": 2, "topk_group": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-05,
  "model_max_length": 64, "tie_word_embeddings": false,
  "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
  "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
  "linear_num_heads": 3, "linear_head_dim": 4, "linear_conv_kernel_dim": 4
})";

void check_tiny_kimi(const ModelConfig& m) {
  CHECK(m.model_type == "kimi_linear");
  CHECK(m.vocab_size == 41);
  CHECK(m.num_layers == 4);
  CHECK(m.layers == std::vector<std::string>{"kda", "mla", "kda", "mla"});
  CHECK(m.first_k_dense == 1);
  CHECK(m.rms_norm_eps == 1e-5);
  CHECK(m.max_position_embeddings == 64);
  CHECK(!m.mla.use_rope);  // NoPE MLA: the 4 rope dims stay, unrotated
  CHECK(m.mla.qk_rope_head_dim == 4);
  CHECK(!m.mla.q_lora_rank.has_value());
  CHECK(m.kda.num_heads == 3);
  CHECK(m.kda.head_dim == 4);
  CHECK(m.kda.conv_width == 4);
  CHECK(m.kda.lower_bound == 0.0);
  CHECK(!m.kda.fused_qkv);
  CHECK(!m.kda.full_rank_output_gate);
  CHECK(m.moe.num_experts == 6);
  CHECK(m.moe.top_k == 2);
  CHECK(m.moe.num_shared_experts == 1);
  CHECK(m.moe.num_groups == 2);
  CHECK(m.moe.normalize_topk);
  CHECK(m.moe.scoring == "sigmoid");
  CHECK(m.moe.routed_scaling_factor == 2.446);
  CHECK(m.moe.score_correction_bias);
}

std::string with(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  REQUIRE(at != std::string::npos);
  return json.replace(at, from.size(), to);
}

std::string import_error(const std::string& json) {
  try {
    model_config_from_hf_json(json, "kimi/config.json");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    return e.what();
  }
  return "no error";
}

fs::path scratch(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("moetrain_kimi_import_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

Tensor host_copy(kernels::Backend& backend, const Tensor& t) {
  Tensor staged(t.shape(), t.dtype());
  backend.copy(staged, t);
  Tensor out(t.shape(), DType::kF64);
  convert_host(out, staged);
  return out;
}

// Rows [begin, end) of `t` (leading dimension), reshaped to `shape`.
Tensor rows_of(const Tensor& t, int64_t begin, int64_t end, Shape shape) {
  const int64_t row = t.numel() / t.size(0);
  Tensor out(shape, DType::kF64);
  REQUIRE(out.numel() == (end - begin) * row);
  std::copy(t.ptr<double>() + begin * row, t.ptr<double>() + end * row, out.ptr<double>());
  return out;
}

Tensor stack(const std::vector<Tensor>& parts, Shape shape) {
  Tensor out(shape, DType::kF64);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    std::copy(p.ptr<double>(), p.ptr<double>() + p.numel(), out.ptr<double>() + at);
    at += p.numel();
  }
  REQUIRE(at == out.numel());
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string replaced(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  return at == std::string::npos ? s : s.replace(at, from.size(), to);
}

enum class Layout { kReleased, kTransformers };

// The model's weights as a checkpoint of the given layout (hf_names.h lists the differences).
std::vector<std::pair<std::string, Tensor>> checkpoint_tensors(Model& model, Layout layout) {
  kernels::Backend& be = model.backend();
  const bool released = layout == Layout::kReleased;
  const KdaConfig& kda = model.spec().config.kda;
  const int64_t c = kda.num_heads * kda.head_dim;
  std::vector<std::pair<std::string, Tensor>> out;
  std::vector<Tensor> qkv_convs;  // transformers packs q, k, v's convs into one
  for (const WeightSlot& slot : model.weight_slots()) {
    Tensor t = host_copy(be, *slot.tensor);
    const std::string& name = slot.name;
    if (slot.layout != WeightLayout::kPlain) {
      const int64_t groups = t.size(0);
      const bool routed = ends_with(name, ".experts");
      const std::string module = released ? replaced(name, ".mlp.experts", ".block_sparse_moe.experts") : name;
      const std::string shared = released ? replaced(name, ".mlp.shared_experts", ".block_sparse_moe.shared_experts")
                                          : name;
      if (routed && !released) {
        out.emplace_back(name + (slot.layout == WeightLayout::kSwigluGateUp ? ".gate_up_proj" : ".down_proj"),
                         std::move(t));
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const std::string prefix = routed ? module + "." + std::to_string(g) : shared;
        const bool dense_w = routed && released;
        if (slot.layout == WeightLayout::kSwigluDown) {
          out.emplace_back(prefix + (dense_w ? ".w2.weight" : ".down_proj.weight"),
                           rows_of(t, g, g + 1, {t.size(1), t.size(2)}));
        } else {
          const int64_t f = t.size(1) / 2;
          Tensor group = rows_of(t, g, g + 1, {t.size(1), t.size(2)});
          out.emplace_back(prefix + (dense_w ? ".w1.weight" : ".gate_proj.weight"), rows_of(group, 0, f, {f, t.size(2)}));
          out.emplace_back(prefix + (dense_w ? ".w3.weight" : ".up_proj.weight"),
                           rows_of(group, f, 2 * f, {f, t.size(2)}));
        }
      }
      continue;
    }
    if (ends_with(name, ".qkv_conv1d.weight") || ends_with(name, ".qkv_proj.weight")) {
      // Fused (K3): released checkpoints keep q, k, v apart; transformers packs the convs.
      const bool conv = ends_with(name, "_conv1d.weight");
      const Shape part = conv ? Shape{c, 1, t.size(1)} : Shape{c, t.size(1)};
      if (!released) {
        out.emplace_back(conv ? replaced(name, "qkv_conv1d", "conv1d") : name,
                         rows_of(t, 0, 3 * c, conv ? Shape{3 * c, 1, t.size(1)} : t.shape()));
        continue;
      }
      for (int64_t j = 0; j < 3; ++j) {
        const std::string one = std::string(1, "qkv"[j]) + (conv ? "_conv1d" : "_proj");
        out.emplace_back(replaced(name, conv ? "qkv_conv1d" : "qkv_proj", one), rows_of(t, j * c, (j + 1) * c, part));
      }
      continue;
    }
    if (ends_with(name, "_conv1d.weight")) {
      const Shape conv{t.size(0), 1, t.size(1)};
      if (released) out.emplace_back(name, rows_of(t, 0, t.size(0), conv));
      else qkv_convs.push_back(std::move(t));
      if (!released && ends_with(name, "v_conv1d.weight")) {
        const int64_t width = qkv_convs.back().size(1);
        out.emplace_back(replaced(name, "v_conv1d", "conv1d"), stack(qkv_convs, {3 * c, 1, width}));
        qkv_convs.clear();
      }
      continue;
    }
    if (ends_with(name, ".A_log")) {
      out.emplace_back(name, rows_of(t, 0, t.size(0), released ? Shape{1, 1, t.size(0), 1} : Shape{t.size(0), 1}));
      continue;
    }
    if (ends_with(name, ".dt_bias") && !released) {
      out.emplace_back(name, rows_of(t, 0, t.size(0), {kda.num_heads, kda.head_dim}));
      continue;
    }
    if (released && name.find(".mlp.gate.") != std::string::npos) {
      out.emplace_back(replaced(name, ".mlp.gate.", ".block_sparse_moe.gate."), std::move(t));
      continue;
    }
    out.emplace_back(released ? name : transformers_module_name(name), std::move(t));
  }
  return out;
}

void write_checkpoint(const fs::path& dir, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : tensors) named.push_back({name, t.view()});  // F64: the round trip is exact
  write_hf_checkpoint(dir.string(), named, HfShardedWriteParams{});
}

// Writes `config_json` as dir's config.json; the config of a run that reads its model from dir.
Config kimi_yaml_config(const fs::path& dir, const std::string& config_json) {
  std::ofstream(dir / "config.json") << config_json;
  Config config;
  config.model.hf_dir = dir.string();
  config.data.seq_len = 16;
  return config;
}

std::unique_ptr<Model> make_model(const ModelSpec& spec, kernels::Backend& backend) {
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora_targets = {"q_proj", "f_a_proj", "o_proj"};
  return std::make_unique<Model>(spec, backend, options);
}

double max_diff(const Tensor& a, const Tensor& b) {
  double d = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.ptr<double>()[i] - b.ptr<double>()[i]));
  return d;
}

// Writes `model`'s weights in `layout`, loads them into a new model, and compares logits.
void check_round_trip(Model& model, const fs::path& dir, Layout layout) {
  write_checkpoint(dir, checkpoint_tensors(model, layout));
  auto backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> loaded = make_model(model.spec(), *backend);
  loaded->load_weights(HfCheckpoint(dir.string()));
  const Batch batch = tiny_batch(model.spec().config.vocab_size, 11);
  const Tensor expected = model.logits(batch);
  const Tensor got = loaded->logits(batch);
  CHECK(max_diff(expected, got) == 0.0);
  double scale = 0.0;
  for (int64_t i = 0; i < expected.numel(); ++i) scale = std::max(scale, std::fabs(expected.ptr<double>()[i]));
  CHECK(scale > 0.1);  // a real model, not zeros
}

}  // namespace

TEST_CASE("a released Kimi-Linear config.json maps onto the model section", "[import][kimi]") {
  check_tiny_kimi(model_config_from_hf_json(kReleasedConfig, "released/config.json"));
}

TEST_CASE("transformers 5's spelling of the same config.json gives the same model", "[import][kimi]") {
  check_tiny_kimi(model_config_from_hf_json(kTransformersConfig, "transformers/config.json"));
  // Without any layer list, transformers' default: every 4th layer full attention.
  std::string bare = with(kTransformersConfig,
                          R"("layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],)",
                          "");
  CHECK(model_config_from_hf_json(bare, "x").layers == std::vector<std::string>{"kda", "kda", "kda", "mla"});
  // Kimi K3's flags in linear_attn_config.
  std::string k3 = with(kReleasedConfig, R"("short_conv_kernel_size": 4)",
                        R"("short_conv_kernel_size": 4, "use_full_rank_gate": true, "gate_lower_bound": -5.0)");
  ModelConfig m = model_config_from_hf_json(k3, "k3/config.json");
  CHECK(m.kda.full_rank_output_gate);
  CHECK(m.kda.lower_bound == -5.0);
  // K3's gated MLA: g_proj [heads * v_head_dim, hidden], an elementwise gate.
  CHECK(m.attention_gate == "none");
  const std::string gated = with(k3, R"("mla_use_nope": true)", R"("mla_use_nope": true, "mla_use_output_gate": true)");
  CHECK(model_config_from_hf_json(gated, "k3/config.json").attention_gate == "elementwise");
}

TEST_CASE("Kimi-Linear config.json errors name the key and the problem", "[import][kimi]") {
  CHECK(contains(import_error(with(kReleasedConfig, R"("kda_layers": [1, 3])", R"("kda_layers": [1, 5])")),
                 "linear_attn_config.kda_layers lists layer 5, outside 1..4 (the lists are 1-based)"));
  CHECK(contains(import_error(with(kReleasedConfig, R"("kda_layers": [1, 3])", R"("kda_layers": [1, 2])")),
                 "layer 2 is listed twice"));
  CHECK(contains(import_error(with(kReleasedConfig, R"("kda_layers": [1, 3])", R"("kda_layers": [1])")),
                 "name 3 of the 4 layers"));
  CHECK(contains(import_error(with(kTransformersConfig, R"(["dense", "sparse", "sparse", "sparse"])",
                                   R"(["dense", "sparse", "dense", "sparse"])")),
                 "mlp_layer_types[2] is \"dense\""));
  CHECK(contains(import_error(with(kTransformersConfig, R"("linear_head_dim": 4)",
                                   R"("linear_head_dim": 4, "linear_key_head_dim": 8)")),
                 "linear_key_head_dim = 8 differs"));
  CHECK(contains(import_error(with(kReleasedConfig, R"("moe_layer_freq": 1)", R"("moe_layer_freq": 2)")),
                 "moe_layer_freq 2 is not supported"));
  CHECK(contains(import_error(with(kReleasedConfig, R"("num_experts": 6,)", "")), "missing key \"num_experts\""));
  CHECK(contains(import_error(with(kReleasedConfig, "kimi_linear", "kimi_k9")),
                 "supported: deepseek_v3, deepseek_v32, kimi_k2, kimi_linear, kimi_k3"));
}

TEST_CASE("Kimi-Linear weights in the released and in transformers 5's layout load alike", "[import][kimi]") {
  for (bool k3 : {false, true}) {
    INFO((k3 ? "K3 flags" : "Kimi-Linear"));
    fs::path dir = scratch(k3 ? "k3" : "linear");
    Config config = kimi_yaml_config(dir, kReleasedConfig);
    if (k3) {
      config = parse_config("model: {hf_dir: " + dir.string() +
                                ", kda: {fused_qkv: true, full_rank_output_gate: true, lower_bound: -5.0}}\n"
                                "data: {seq_len: 16}\n",
                            "k3.yaml");
    }
    ModelSpec spec = resolve_model_spec(config);
    REQUIRE(spec.mixers == std::vector<MixerKind>{MixerKind::kKda, MixerKind::kMla, MixerKind::kKda, MixerKind::kMla});
    auto backend = kernels::make_cpu_backend();
    std::unique_ptr<Model> model = make_model(spec, *backend);
    model->init_random_weights();
    for (Layout layout : {Layout::kReleased, Layout::kTransformers}) {
      fs::path weights = scratch(std::string(k3 ? "k3_" : "linear_") + (layout == Layout::kReleased ? "r" : "t"));
      std::ofstream(weights / "config.json") << kReleasedConfig;
      check_round_trip(*model, weights, layout);
    }
  }
}

TEST_CASE("a Kimi-Linear checkpoint missing a KDA tensor names it", "[import][kimi]") {
  fs::path dir = scratch("missing");
  ModelSpec spec = resolve_model_spec(kimi_yaml_config(dir, kReleasedConfig));
  auto backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model = make_model(spec, *backend);
  model->init_random_weights();
  std::vector<std::pair<std::string, Tensor>> tensors = checkpoint_tensors(*model, Layout::kReleased);
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const auto& t) { return t.first == "model.layers.2.self_attn.f_b_proj.weight"; }),
                tensors.end());
  write_checkpoint(dir, tensors);
  std::string message = error_message([&] { model->load_weights(HfCheckpoint(dir.string())); });
  CHECK(contains(message, "model.layers.2.self_attn.f_b_proj.weight"));
  CHECK(contains(message, "is missing"));
}

TEST_CASE("a PEFT adapter keyed by transformers 5's KDA module names loads", "[import][kimi]") {
  fs::path dir = scratch("adapter_model");
  ModelSpec spec = resolve_model_spec(kimi_yaml_config(dir, kReleasedConfig));
  auto backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> source = make_model(spec, *backend);
  std::unique_ptr<Model> target = make_model(spec, *backend);
  uint64_t seed = 5;
  std::vector<std::pair<std::string, Tensor>> keys;
  for (Parameter* p : source->parameters()) {
    fill_random(p->value, seed++);
    keys.emplace_back(peft_key(transformers_module_name(p->name)), host_copy(*backend, p->value));
  }
  fs::path adapter = scratch("adapter");
  std::ofstream(adapter / "adapter_config.json") << R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16.0})";
  SafetensorsWriter writer;
  for (auto& [name, t] : keys) writer.add(name, t);
  writer.write((adapter / "adapter_model.safetensors").string());
  load_peft_adapter(*target, adapter.string());
  bool saw_renamed = false;
  for (size_t i = 0; i < source->parameters().size(); ++i) {
    Parameter* p = target->parameters()[i];
    saw_renamed |= transformers_module_name(p->name) != p->name;
    CHECK(max_diff(host_copy(*backend, p->value), keys[i].second) == 0.0);
  }
  CHECK(saw_renamed);
}

namespace {

// A tiny Kimi K3 config.json as NeMo AutoModel's KimiK3Config writes it: the language model's
// settings (Kimi-Linear's keys and K3's) in text_config, and a vision tower config.
std::string k3_config_json(const std::string& text_extra) {
  std::string text = with(kReleasedConfig, R"("hidden_act": "silu")", R"("hidden_act": "situ")");
  text = with(text, R"("q_lora_rank": null)", R"("q_lora_rank": 12)");
  text = with(text, R"("num_hidden_layers": 4)", R"("num_hidden_layers": 4)" + text_extra);
  return R"({"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
  "vision_config": {"model_type": "kimi_k3_vision", "vt_num_hidden_layers": 2, "vt_hidden_size": 32, "patch_size": 14},
  "text_config": )" + text + "}";
}

const char* kK3Keys = R"(, "activation_situ_beta": 3.0, "activation_situ_linear_beta": 20.0,
  "routed_expert_hidden_size": 6, "latent_moe_use_norm": true, "attn_res_block_size": 2,
  "mla_use_output_gate": true)";

// The values of a K3 config's SiTU, latent MoE, attention residual and shared expert keys.
struct K3Values {
  double situ_beta;
  double situ_linear_beta;
  int64_t latent_size;
  int64_t attn_res_block_size;
  int64_t num_shared_experts;
  double routed_scaling_factor;
};

// `m` is Kimi K3's feed-forward and attention form (SiTU, the latent MoE with its norm, attention
// residuals, the per-channel attention gate) with the values `want`.
void check_k3_form(const ModelConfig& m, const K3Values& want) {
  CHECK(m.hidden_act == "situ");
  CHECK(m.situ_beta == want.situ_beta);
  CHECK(m.situ_linear_beta == want.situ_linear_beta);
  CHECK(m.moe.latent_size == want.latent_size);
  CHECK(m.moe.use_latent_norm);
  CHECK(m.attn_res_block_size == want.attn_res_block_size);
  CHECK(m.attention_gate == "elementwise");
  CHECK(m.moe.num_shared_experts == want.num_shared_experts);
  CHECK(m.moe.routed_scaling_factor == want.routed_scaling_factor);
}

}  // namespace

TEST_CASE("a Kimi K3 config.json maps its text_config onto the model section", "[import][k3]") {
  const ModelConfig m = model_config_from_hf_json(k3_config_json(kK3Keys), "k3/config.json");
  CHECK(m.model_type == "kimi_k3");
  CHECK(m.layers == std::vector<std::string>{"kda", "mla", "kda", "mla"});
  check_k3_form(m, {3.0, 20.0, 6, 2, /*num_shared_experts (given)=*/1, /*routed_scaling_factor (given)=*/2.446});
  CHECK(m.mla.q_lora_rank == 12);
  CHECK(!m.mla.use_rope);

  // Absent keys take KimiK3TextConfig's defaults, null ones switch the feature off.
  std::string bare = with(k3_config_json(""), R"("num_shared_experts": 1,)", "");
  bare = with(bare, R"("routed_scaling_factor": 2.446,)", "");
  bare = with(bare, R"("hidden_act": "situ",)", "");
  check_k3_form(model_config_from_hf_json(bare, "k3/config.json"), {4.0, 25.0, 3584, 12, 2, 1.0});
  const ModelConfig off = model_config_from_hf_json(
      k3_config_json(R"(, "activation_situ_linear_beta": null, "routed_expert_hidden_size": null,
                       "attn_res_block_size": null, "mla_use_output_gate": false)"),
      "k3/config.json");
  CHECK(off.situ_linear_beta == 0.0);
  CHECK(off.moe.latent_size == 0);
  CHECK(!off.moe.use_latent_norm);
  CHECK(off.attn_res_block_size == 0);
  CHECK(off.attention_gate == "none");
  CHECK(off.moe.expert_format == "bf16");

  // The released experts' compressed-tensors MXFP4 makes the experts packed; another scheme stops.
  const std::string mxfp4 = R"(, "quantization_config": {"quant_method": "compressed-tensors",
                                 "format": "mxfp4-pack-quantized", "quantization_status": "compressed"})";
  CHECK(model_config_from_hf_json(k3_config_json(mxfp4), "k3/config.json").moe.expert_format == "mxfp4");
  CHECK(contains(import_error(k3_config_json(R"(, "quantization_config": {"quant_method": "fp8"})")),
                 "is not supported (moetrain reads Kimi K3's compressed-tensors mxfp4-pack-quantized experts)"));
}

TEST_CASE("Kimi K3 config.json errors name the key and the problem", "[import][k3]") {
  CHECK(contains(import_error(R"({"model_type": "kimi_k3", "vocab_size": 10})"), "\"text_config\" object"));
  CHECK(contains(import_error(with(k3_config_json(""), R"("mla_use_nope": true)", R"("mla_use_nope": false)")),
                 "mla_use_nope is false"));
  CHECK(contains(import_error(k3_config_json(R"(, "num_nextn_predict_layers": 1)")), "num_nextn_predict_layers 1"));
  CHECK(contains(import_error(with(k3_config_json(""), R"("num_experts": 6,)", "")),
                 "(text_config): missing key \"num_experts\""));
}

TEST_CASE("Kimi K3 weights under language_model. (the released names) load to the model that wrote them",
          "[import][k3]") {
  fs::path dir = scratch("k3_config");
  ModelSpec spec = resolve_model_spec(kimi_yaml_config(dir, k3_config_json(kK3Keys)));
  auto backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model = make_model(spec, *backend);
  model->init_random_weights();
  // The released layout, the MoE's own modules under block_sparse_moe, and the text model under
  // language_model. (a vision tensor beside it is ignored).
  std::vector<std::pair<std::string, Tensor>> tensors;
  bool latent = false, mixes = false;
  bool padded = false;
  for (auto& [name, t] : checkpoint_tensors(*model, Layout::kReleased)) {
    std::string n = replaced(name, ".mlp.routed_expert_", ".block_sparse_moe.routed_expert_");
    latent = latent || n != name;
    mixes = mixes || contains(n, "_res_proj.weight");
    if (ends_with(n, ".self_attn.A_log")) {  // K3 pads A_log with zeros to a multiple of 128 heads
      Tensor a_log = Tensor::zeros({128}, DType::kF64);
      std::copy(t.ptr<double>(), t.ptr<double>() + t.numel(), a_log.ptr<double>());
      t = std::move(a_log);
      padded = true;
    }
    tensors.emplace_back("language_model." + n, std::move(t));
  }
  CHECK(latent);
  CHECK(mixes);
  CHECK(padded);
  tensors.emplace_back("vision_tower.patch_embed.proj.weight", Tensor::zeros({2, 2}, DType::kF64));
  fs::path weights = scratch("k3_weights");
  std::ofstream(weights / "config.json") << k3_config_json(kK3Keys);
  write_checkpoint(weights, tensors);
  auto other = kernels::make_cpu_backend();
  std::unique_ptr<Model> loaded = make_model(spec, *other);
  loaded->load_weights(HfCheckpoint(weights.string()));
  const Batch batch = tiny_batch(spec.config.vocab_size, 11);
  CHECK(max_diff(model->logits(batch), loaded->logits(batch)) == 0.0);

  // Padding that is not zero means the config's head count is not the checkpoint's.
  for (auto& [name, t] : tensors)
    if (ends_with(name, ".self_attn.A_log")) t.ptr<double>()[100] = 0.5;
  fs::path bad = scratch("k3_bad_a_log");
  std::ofstream(bad / "config.json") << k3_config_json(kK3Keys);
  write_checkpoint(bad, tensors);
  const std::string message = error_message([&] { loaded->load_weights(HfCheckpoint(bad.string())); });
  CHECK(contains(message, "self_attn.A_log"));
  CHECK(contains(message, "are not zero"));
}

TEST_CASE("a Kimi K3 adapter exported under the released names loads back exactly", "[import][k3]") {
  fs::path dir = scratch("k3_export_model");
  Config config = kimi_yaml_config(dir, k3_config_json(kK3Keys));
  config.checkpoint.export_layout = "released";
  config.lora.targets = {"q_proj", "o_proj", "routed_expert_down_proj", "shared_experts", "experts"};
  ModelSpec spec = resolve_model_spec(config);
  auto backend = kernels::make_cpu_backend();
  auto make = [&] {
    ModelOptions options;
    options.dtype = DType::kF64;
    options.lora_targets = config.lora.targets;
    return std::make_unique<Model>(spec, *backend, options);
  };
  std::unique_ptr<Model> source = make(), target = make();
  uint64_t seed = 40;
  std::vector<Tensor> values;
  std::vector<std::pair<std::string, TensorView>> params;
  for (Parameter* p : source->parameters()) {
    fill_random(p->value, seed++);
    values.push_back(host_copy(*backend, p->value));
  }
  size_t i = 0;
  for (Parameter* p : source->parameters()) params.emplace_back(p->name, values[i++].view());
  const AdapterExportSettings settings = adapter_export_settings(config);
  REQUIRE(settings.layout == AdapterLayout::kReleased);
  REQUIRE(settings.text_under_language_model);  // the directory's config.json says kimi_k3
  fs::path adapter = scratch("k3_export_adapter");
  fs::remove_all(adapter);
  write_peft_adapter(adapter.string(), params, settings);

  // The released names: the text model under language_model., the MoE's modules under
  // block_sparse_moe, the experts' projections w1 / w3 / w2.
  const SafetensorsFile file((adapter / "adapter_model.safetensors").string());
  const std::string layer = "base_model.model.language_model.model.layers.1.";
  CHECK(file.has(layer + "self_attn.o_proj.lora_A.weight"));
  CHECK(file.has(layer + "block_sparse_moe.experts.3.w1.lora_A.weight"));
  CHECK(file.has(layer + "block_sparse_moe.experts.3.w3.lora_B.weight"));
  CHECK(file.has(layer + "block_sparse_moe.experts.3.w2.lora_A.weight"));
  CHECK(file.has(layer + "block_sparse_moe.shared_experts.gate_proj.lora_A.weight"));
  CHECK(file.has(layer + "block_sparse_moe.routed_expert_down_proj.lora_B.weight"));
  for (const std::string& key : file.names()) {
    INFO(key);
    CHECK(key.find(".mlp.experts.") == std::string::npos);
    CHECK(key.rfind("base_model.model.language_model.", 0) == 0);
  }
  std::ifstream in(adapter / "adapter_config.json");
  const nlohmann::json adapter_config = nlohmann::json::parse(in);
  const auto targets = adapter_config.at("target_modules").get<std::vector<std::string>>();
  for (const char* w : {"w1", "w2", "w3", "gate_proj", "routed_expert_down_proj", "o_proj"})
    CHECK(std::find(targets.begin(), targets.end(), w) != targets.end());

  load_peft_adapter(*target, adapter.string());
  std::vector<Parameter*> loaded = target->parameters();
  REQUIRE(loaded.size() == values.size());
  for (size_t k = 0; k < loaded.size(); ++k) {
    INFO(loaded[k]->name);
    CHECK(max_diff(host_copy(*backend, loaded[k]->value), values[k]) == 0.0);
  }
}
