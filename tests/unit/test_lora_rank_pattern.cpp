// Per-module LoRA ranks and alphas (`lora.rank_pattern` / `lora.alpha_pattern`, PEFT's
// rank_pattern / alpha_pattern; core/config/lora_patterns.h):
//  - PEFT 0.21's rule (get_pattern_key: the first key k, in order, for which Python's
//    re.match(rf"(.*\.)?({k})$", name) matches) on names whose answer follows from Python's re
//    semantics, and the refusal of keys Python and ECMAScript read differently;
//  - the config keys (order kept, written back, --set, errors naming the key);
//  - the model: each module's rank and alpha (the alpha through the function it computes), a key
//    that selects nothing refused, whole-model gradients by central differences, plan's count;
//  - export: patterns that give each module its rank under PEFT's rule against PEFT's names, exact
//    reload in every form; --init-adapter's checks (the file's order, its own consistency, the
//    config's patterns); checkpoint + resume bit for bit.
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
#include "core/config/lora_patterns.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/plan/param_count.h"
#include "core/data/synthetic_data.h"
#include "adapter_testing.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "model_gradcheck.h"
#include "tiny_model.h"
#include "training_run.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

namespace {

int match(const std::vector<std::string>& keys, const std::string& name) {
  return PatternKeys(keys, "test").match(name);
}

// The tiny model (MLA/KDA/DSA, a dense layer, two MoE layers) with per-module ranks and alphas:
// o_proj everywhere rank 6 and alpha 24; layer 2's down projections (shared and routed experts)
// rank 2; the routed experts' gate_proj rank 3 (so gate and up differ), or with `gate_up_rank` a
// key for the fused gate_up instead; up_proj alpha 5.
Config pattern_config(const std::string& gate_up = "separate", const std::string& expert_a = "per_expert",
                      int64_t gate_up_rank = 0) {
  Config c = tiny_model_config(true);
  c.lora.rank = 4;
  c.lora.alpha = 8.0;
  c.lora.targets = all_lora_targets(true);
  c.lora.rank_pattern = {{"o_proj", 6}, {"layers\\.2\\..*\\.down_proj", 2}};
  if (gate_up_rank > 0) c.lora.rank_pattern.emplace_back(".*gate_up_proj", gate_up_rank);
  else c.lora.rank_pattern.emplace_back("experts\\.gate_proj", 3);
  c.lora.alpha_pattern = {{"o_proj", 24.0}, {"up_proj", 5.0}};
  c.lora.expert_gate_up = gate_up;
  c.lora.expert_a = expert_a;
  return c;
}

ModelOptions options_of(const Config& c) {  // as run_training builds them, in double
  ModelOptions options = model_options_for(c);
  options.dtype = DType::kF64;
  return options;
}

std::unique_ptr<Model> make_model(kernels::Backend& backend, const Config& c) {
  auto model = std::make_unique<Model>(resolve_model_spec(c), backend, options_of(c));
  model->init_random_weights();
  return model;
}

fs::path scratch(const std::string& name) { return scratch_dir("lora_rank_pattern", name); }

void export_adapter(Model& model, const Config& c, const fs::path& dir, AdapterLayout layout) {
  AdapterExportSettings settings = adapter_export_settings(c);
  settings.layout = layout;
  HostParameters values(model);
  write_peft_adapter(dir.string(), values.views, settings);
}

OrderedJson read_json(const fs::path& path) {
  std::ifstream in(path);
  return OrderedJson::parse(in);
}

void write_json(const fs::path& path, const OrderedJson& json) { std::ofstream(path) << json.dump(2); }

const std::string kYaml =
    "model: {vocab_size: 64, hidden_size: 32, num_layers: 2, mla: {num_heads: 2}, moe: {num_experts: 4, top_k: 2}}\n"
    "data: {seq_len: 16}\n";

}  // namespace

TEST_CASE("lora patterns: PEFT's get_pattern_key rule", "[rank_pattern]") {
  const std::string q = "model.layers.0.self_attn.q_proj";
  // A key selects a whole dot-separated tail of the name, or the whole name.
  CHECK(match({"q_proj"}, q) == 0);
  CHECK(match({"q_proj"}, "q_proj") == 0);
  CHECK(match({"q_proj"}, "model.layers.0.self_attn.kv_q_proj") == -1);  // "kv_q_proj" is not ".q_proj"
  CHECK(match({"q_proj"}, "model.layers.0.self_attn.q_proj_x") == -1);  // $: to the end
  CHECK(match({"proj"}, q) == -1);
  CHECK(match({"self_attn.q_proj"}, q) == 0);
  CHECK(match({"model.layers.0.self_attn.q_proj"}, q) == 0);
  CHECK(match({"layers\\.0\\..*"}, q) == 0);
  CHECK(match({"layers\\.0\\..*"}, "model.layers.10.self_attn.q_proj") == -1);
  // ^ inside the wrapping can only hold at the start of the name.
  CHECK(match({"^model\\.layers\\.1\\..*"}, "model.layers.1.mlp.experts.down_proj") == 0);
  CHECK(match({"^layers\\.1\\..*"}, "model.layers.1.mlp.experts.down_proj") == -1);
  // The key is one group: an alternation stays inside it.
  CHECK(match({"o_proj|q_proj"}, q) == 0);
  CHECK(match({"o_proj|q"}, q) == -1);
  // Routed experts' projections, not the shared experts'.
  CHECK(match({"experts\\..*"}, "model.layers.1.mlp.experts.gate_proj") == 0);
  CHECK(match({"experts\\..*"}, "model.layers.1.mlp.shared_experts.gate_proj") == -1);
  CHECK(match({".*\\.gate_up_proj"}, "model.layers.1.mlp.experts.gate_up_proj") == 0);
  // The first matching key in order wins, not the most specific one.
  CHECK(match({".*_proj", "q_proj"}, q) == 0);
  CHECK(match({"o_proj", "q_proj", ".*_proj"}, q) == 1);
  CHECK(match({}, q) == -1);
}

TEST_CASE("lora patterns: keys Python's re and moetrain's regex read differently are refused", "[rank_pattern]") {
  for (const char* key : {"(?P<name>q)_proj", "(?i)Q_PROJ", "(?<=self_attn\\.)q_proj", "\\Aq_proj", "q_proj\\Z",
                          "[]q]_proj", "[[:alpha:]]_proj", "(?#note)q_proj", "q_proj(", "\\a", "\\01", ""}) {
    INFO(key);
    CHECK(!lora_pattern_problem(key).empty());
    CHECK(contains(error_message([&] { PatternKeys({key}, "lora.rank_pattern"); }),
                   std::string("lora.rank_pattern[\"") + key + "\"]"));
  }
  for (const char* key : {"q_proj", ".*\\.experts\\..*", "(?:q|k)_proj", "layers\\.[0-9]+\\.mlp\\..*", "\\d+\\.o_proj",
                          "q_proj(?!x)", "[^.]*_proj", "\\.?q_proj", "(q)_\\1?proj"}) {
    INFO(key);
    CHECK(lora_pattern_problem(key).empty());
  }
}

TEST_CASE("lora patterns: each module's rank and alpha, the fused gate_up's, unused keys", "[rank_pattern]") {
  LoraRanks ranks(4, 8.0, {{"o_proj", 6}, {"experts\\.gate_proj", 3}, {"never", 9}}, {{"up_proj", 5.0}});
  ModuleLora o = ranks.module("model.layers.0.self_attn.o_proj");
  CHECK(o.rank == 6);
  CHECK(o.alpha == 8.0);  // only rank_pattern selects it: lora.alpha
  CHECK(o.rank_key == 0);
  CHECK(o.alpha_key == -1);
  ModuleLora up = ranks.module("model.layers.1.mlp.experts.up_proj");
  CHECK(up.rank == 4);
  CHECK(up.alpha == 5.0);
  // PEFT's fused gate_up: twice the gate's unless a key selects gate_up_proj itself.
  ModuleLora fused = ranks.fused_gate_up("model.layers.1.mlp.experts");
  CHECK(fused.rank == 6);
  CHECK(fused.alpha == 16.0);
  LoraRanks direct(4, 8.0, {{"gate_up_proj", 5}}, {{".*\\.gate_up_proj", 3.0}});
  fused = direct.fused_gate_up("model.layers.1.mlp.experts");
  CHECK(fused.rank == 5);
  CHECK(fused.alpha == 3.0);
  CHECK(ranks.unused_keys() == std::vector<std::string>{"lora.rank_pattern[\"never\"]"});
  CHECK(direct.unused_keys().empty());
}

TEST_CASE("lora patterns: the config keys, in order, written back, overridden, and their errors", "[rank_pattern][config]") {
  const std::string yaml = kYaml +
                           "lora:\n"
                           "  rank_pattern: {o_proj: 16, \".*\\\\.gate_up_proj\": 8, 'experts\\..*': 2}\n"
                           "  alpha_pattern: {o_proj: 32.5}\n";
  Config c = parse_config(yaml, "x.yaml");
  CHECK(c.lora.rank_pattern == PatternMap<int64_t>{{"o_proj", 16}, {".*\\.gate_up_proj", 8}, {"experts\\..*", 2}});
  CHECK(c.lora.alpha_pattern == PatternMap<double>{{"o_proj", 32.5}});
  CHECK(parse_config(kYaml, "x.yaml").lora.rank_pattern.empty());
  Config reread = parse_config(config_to_yaml(c), "resolved.yaml");  // what runs and checkpoints save
  CHECK(reread.lora.rank_pattern == c.lora.rank_pattern);
  CHECK(reread.lora.alpha_pattern == c.lora.alpha_pattern);
  CHECK(same_settings(c, reread));
  Config other = c;
  other.lora.rank_pattern = {{"experts\\..*", 2}, {"o_proj", 16}, {".*\\.gate_up_proj", 8}};
  CHECK(!same_settings(c, other));  // the order is a setting (the first match wins)
  Config set = parse_config(yaml, "x.yaml", {"lora.rank_pattern={q_proj: 6}"});
  CHECK(set.lora.rank_pattern == PatternMap<int64_t>{{"q_proj", 6}});

  auto problem = [&](const std::string& lora) { return error_message([&] { parse_config(kYaml + lora, "x.yaml"); }); };
  CHECK(contains(problem("lora: {rank_pattern: {\"(?P<x>o)_proj\": 4}}\n"), "x.yaml:3:"));
  // Each config's message holds its text.
  const std::pair<const char*, const char*> refused[] = {
      {"lora: {rank_pattern: {\"(?P<x>o)_proj\": 4}}\n", "`lora.rank_pattern[\"(?P<x>o)_proj\"]`: \"(?P\" (a named group"},
      {"lora: {rank_pattern: {o_proj: 0}}\n", "`lora.rank_pattern[\"o_proj\"]` = 0 must be > 0"},
      {"lora: {alpha_pattern: {o_proj: -1.0}}\n", "`lora.alpha_pattern[\"o_proj\"]` = -1.0 must be > 0"},
      {"lora: {rank_pattern: [o_proj]}\n", "`lora.rank_pattern` expects a map from module-name patterns to values"},
      {"lora: {rank_pattern: {o_proj: 2, o_proj: 3}}\n", "`lora.rank_pattern[\"o_proj\"]` is set more than once"},
      {"lora: {rank_pattern: {o_proj: sixteen}}\n", "`lora.rank_pattern[\"o_proj\"]` expects an integer"},
      {"lora: {rank_patern: {o_proj: 2}}\n", "did you mean `lora.rank_pattern`?"},
  };
  for (const auto& [lora, expected] : refused) {
    INFO(lora);
    CHECK(contains(problem(lora), expected));
  }
}

TEST_CASE("lora patterns: the model gives each module its rank and alpha; unmatched keys refused", "[rank_pattern]") {
  auto backend = kernels::make_cpu_backend();
  Config c = pattern_config();
  auto model = make_model(*backend, c);
  auto shape = [&](const std::string& name) {
    Parameter* p = find_parameter(*model, name);
    REQUIRE(p);
    return p->value.shape();
  };
  CHECK(shape("model.layers.0.self_attn.o_proj.lora_A.weight") == Shape({6, 10}));
  CHECK(shape("model.layers.1.self_attn.o_proj.lora_B.weight") == Shape({16, 6}));  // KDA's o_proj too
  CHECK(shape("model.layers.0.self_attn.kv_b_proj.lora_A.weight") == Shape({4, 8}));  // lora.rank
  CHECK(shape("model.layers.0.mlp.down_proj.lora_A.weight") == Shape({4, 24}));      // layer 0: not layer 2's
  CHECK(shape("model.layers.2.mlp.shared_experts.down_proj.lora_A.weight") == Shape({2, 8}));
  CHECK(shape("model.layers.2.mlp.experts.down_proj.lora_A.weight") == Shape({6, 2, 8}));
  CHECK(shape("model.layers.1.mlp.experts.down_proj.lora_A.weight") == Shape({6, 4, 8}));
  CHECK(shape("model.layers.1.mlp.experts.gate_proj.lora_A.weight") == Shape({6, 3, 16}));
  CHECK(shape("model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight") == Shape({4, 16}));
  for (auto& [name, linear] : model->linear_modules()) {
    if (!linear->lora) continue;
    INFO(name);
    const bool o = name.substr(name.rfind('.') + 1) == "o_proj";
    CHECK(linear->lora->scale == (o ? 24.0 / 6.0 : 8.0 / 4.0));
  }

  // alpha_pattern changes the function: the model with o_proj's alpha at twice lora.alpha is the
  // default one with o_proj's B doubled.
  Config plain = tiny_model_config(true);
  plain.lora.targets = all_lora_targets(true);
  Config doubled = plain;
  doubled.lora.alpha_pattern = {{"o_proj", 2.0 * plain.lora.alpha}};
  auto a = make_model(*backend, plain), b = make_model(*backend, doubled);
  randomize_adapters(*a, 50);
  randomize_adapters(*b, 50);
  for (Parameter* p : a->parameters()) {
    if (p->name.find("o_proj.lora_B") == std::string::npos) continue;
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.ptr<double>()[i] *= 2.0;
  }
  Batch batch = tiny_batch(37, 9);
  Comparison cmp = compare_tensors(b->logits(batch), a->logits(batch), 1e-12, 1e-12, "logits");
  INFO(cmp.message);
  CHECK(cmp.ok);
  Tensor unchanged = make_model(*backend, plain)->logits(batch);
  CHECK(!compare_tensors(b->logits(batch), unchanged, 1e-6, 1e-6, "logits").ok);

  // A key that selects no adapter is a config error naming it (PEFT ignores it silently).
  for (const char* key : {"experts", "proj", "q_a_proj\\.weight"}) {
    Config unused = pattern_config();
    unused.lora.rank_pattern.emplace_back(key, 5);
    std::string m = error_message([&] { make_model(*backend, unused); });
    INFO(m);
    CHECK(contains(m, std::string("lora.rank_pattern[\"") + key + "\"] selects no LoRA adapter of this model"));
    CHECK(contains(m, "model.layers.<L>.self_attn.q_a_proj"));  // the names it could have matched
    CHECK(contains(m, "model.layers.<L>.mlp.experts.down_proj"));
  }
}

// validate and plan make the model's LoRA checks from the spec alone (check_lora_modules, no
// weights): what building the model refuses they refuse with the same message, and what it
// builds they pass, in every adapter form.
TEST_CASE("lora patterns: check_lora_modules refuses what building the model refuses", "[rank_pattern][config]") {
  auto backend = kernels::make_cpu_backend();
  auto without_location = [](const std::string& m) { return m.substr(0, m.rfind(" [")); };
  for (const char* gate_up : {"separate", "fused"}) {
    for (const char* expert_a : {"per_expert", "shared"}) {
      INFO(gate_up << ", " << expert_a);
      const Config good = pattern_config(gate_up, expert_a);
      CHECK_NOTHROW(make_model(*backend, good));
      CHECK_NOTHROW(check_lora_modules(resolve_model_spec(good), good.lora));
      std::vector<Config> bad(3, good);
      bad[0].lora.rank_pattern.emplace_back("q_a_proj\\.weight", 5);
      bad[1].lora.alpha_pattern.emplace_back("proj", 3.0);
      bad[2].lora.rank_pattern.emplace_back(std::string(gate_up) == "fused" ? "experts\\.up_proj" : "gate_up_proj", 5);
      for (const Config& c : bad) {
        const std::string built = error_message([&] { make_model(*backend, c); });
        const std::string from_spec = error_message([&] { check_lora_modules(resolve_model_spec(c), c.lora); });
        INFO(built);
        CHECK(contains(built, "selects no LoRA adapter of this model"));
        CHECK(without_location(from_spec) == without_location(built));
      }
    }
  }
  // A target this model does not have.
  Config no_gate = tiny_model_config(true);
  no_gate.lora.targets = {"q_proj", "g_proj"};
  const std::string built = error_message([&] { make_model(*backend, no_gate); });
  const std::string from_spec = error_message([&] { check_lora_modules(resolve_model_spec(no_gate), no_gate.lora); });
  CHECK(contains(built, "lora.targets: \"g_proj\" matches no module of this model"));
  CHECK(without_location(from_spec) == without_location(built));
}

TEST_CASE("lora patterns: whole-model gradients with mixed ranks; plan's count in every form", "[rank_pattern][gradcheck]") {
  auto backend = kernels::make_cpu_backend();
  auto model = make_model(*backend, pattern_config());
  randomize_adapters(*model, 70);
  Batch batch = tiny_batch(37, 4);
  const double scale = 1.0 / static_cast<double>(batch.num_targets());
  const std::vector<Tensor> grads = lora_gradients(*model, *backend, batch, scale);
  GradCheckOptions options = whole_model_gradcheck_options();
  options.max_elements = 4;
  const auto objective = [&] { return model->forward_backward(batch, scale).loss_sum * scale; };
  // The modules whose rank or alpha a pattern set.
  const auto patterned = [](const std::string& name) {
    return name.find("o_proj") != std::string::npos || name.find("layers.2.mlp") != std::string::npos ||
           name.find("experts.gate_proj") != std::string::npos || name.find("up_proj") != std::string::npos;
  };
  CHECK(check_selected_gradients(*model, grads, objective, options, patterned).size() >= 20);

  for (const char* gate_up : {"separate", "fused"})
    for (const char* expert_a : {"per_expert", "shared"}) {
      INFO(gate_up << ", " << expert_a);
      Config c = pattern_config(gate_up, expert_a);
      if (std::string(gate_up) == "fused") c.lora.rank_pattern.emplace_back("layers\\.1\\..*gate_up_proj", 5);
      auto m = make_model(*backend, c);
      int64_t trainable = 0;
      for (Parameter* p : m->parameters()) trainable += p->value.numel();
      CHECK(count_lora_parameters(resolve_model_spec(c), c.lora).total() == trainable);
      if (std::string(gate_up) == "fused") {
        // layer 1's gate_up by its own key; layer 2's twice the gate's 3.
        CHECK(find_parameter(*m, "model.layers.1.mlp.experts.gate_up_proj.lora_B.weight")->value.size(-1) == 5);
        CHECK(find_parameter(*m, "model.layers.2.mlp.experts.gate_up_proj.lora_B.weight")->value.size(-1) == 6);
      }
    }
}

TEST_CASE("lora patterns: export gives each module its rank under PEFT's rule, and reloads exactly", "[rank_pattern][export]") {
  auto backend = kernels::make_cpu_backend();
  Batch batch = tiny_batch(37, 5);
  for (const char* gate_up : {"separate", "fused"}) {
    Config c = pattern_config(gate_up);
    auto model = make_model(*backend, c);
    randomize_adapters(*model, 400);
    Tensor logits = model->logits(batch);
    for (AdapterLayout layout : {AdapterLayout::kTransformers5, AdapterLayout::kPerExpert}) {
      const bool t5 = layout == AdapterLayout::kTransformers5;
      if (!t5 && std::string(gate_up) == "fused") continue;  // no per-expert key for gate_up
      INFO(gate_up << (t5 ? ", transformers5" : ", per_expert"));
      fs::path dir = scratch(std::string(gate_up) + (t5 ? "_t5" : "_per_expert")) / "adapter";
      export_adapter(*model, c, dir, layout);
      const OrderedJson config = read_json(dir / "adapter_config.json");
      CHECK(config["rank_pattern"][".*\\.o_proj"] == 6);  // every o_proj at 6: one key
      CHECK(config["alpha_pattern"][".*\\.o_proj"] == 24.0);
      if (t5) {
        // Layer 2's routed down_proj differs from layer 1's: a key for it alone, in PEFT's name.
        CHECK(config["rank_pattern"]["model\\.layers\\.2\\.mlp\\.experts\\.down_proj"] == 2);
        CHECK(config["rank_pattern"]["model\\.layers\\.2\\.mlp\\.shared_experts\\.down_proj\\.weight"] == 2);
        // gate 3 + up 4 side by side (alpha 8 + 5), or the fused adapter at twice the gate's.
        CHECK(config["rank_pattern"][".*\\.gate_up_proj"] == (std::string(gate_up) == "fused" ? 6 : 7));
        CHECK(config["alpha_pattern"][".*\\.gate_up_proj"] == (std::string(gate_up) == "fused" ? 16.0 : 13.0));
      } else {
        CHECK(config["rank_pattern"]["model\\.layers\\.2\\.mlp\\.experts\\.[0-9]+\\.down_proj"] == 2);
      }

      // What PEFT builds: every adapter tensor's rank is what the written patterns give the
      // module PEFT names (its key, `<module>.weight` for target_parameters) under PEFT's rule.
      PatternMap<int64_t> written;
      for (const auto& [key, value] : config["rank_pattern"].items()) written.emplace_back(key, value.get<int64_t>());
      LoraRanks peft(config["r"].get<int64_t>(), config["lora_alpha"].get<double>(), written, {});
      const auto targets = config["target_parameters"].get<std::vector<std::string>>();
      SafetensorsFile file((dir / "adapter_model.safetensors").string());
      int checked = 0;
      for (const std::string& key : file.names()) {
        if (key.find("lora_A") == std::string::npos) continue;
        std::string module = key.substr(std::strlen("base_model.model."));
        module = module.substr(0, module.rfind(".lora_A"));
        int64_t rank = file.info(key).shape[0];
        if (module.size() > 8 && module.compare(module.size() - 8, 8, ".experts") == 0) {
          rank /= 6;  // PEFT's 3-D adapter: A [E r, in] on experts.down_proj
          module += ".down_proj";
        } else if (module.find(".experts.base_layer") != std::string::npos) {
          rank /= 6;
          module = module.substr(0, module.find(".base_layer")) + ".gate_up_proj";
        } else {
          const std::string tail = module.substr(module.rfind('.') + 1);
          for (const std::string& t : targets)
            if (t == tail + ".weight" && module.find(".mlp.") != std::string::npos) module += ".weight";
        }
        INFO(module);
        CHECK(peft.module(module).rank == rank);
        ++checked;
      }
      CHECK(checked > 20);

      for (const char* into : {"separate", "fused"}) {
        if (std::string(into) == "separate" && std::string(gate_up) == "fused") continue;  // a full B (test_fused_gate_up)
        // Separate gate 3 + up 4 into the fused form: a key gives its gate_up rank 7.
        const bool convert = std::string(into) == "fused" && std::string(gate_up) == "separate";
        Config target = pattern_config(into, "per_expert", convert ? 7 : 0);
        auto reloaded = make_model(*backend, target);
        load_peft_adapter(*reloaded, dir.string());
        // Gate and up at different scales (alpha 8 / rank 3, alpha 5 / rank 4) share PEFT's one
        // gate_up scale: the up block's B is written times the ratio, rounded to F32.
        const double rtol = t5 && std::string(gate_up) == "separate" ? 1e-6 : 1e-12;
        Comparison cmp = compare_tensors(reloaded->logits(batch), logits, rtol, rtol, "logits");
        INFO(cmp.message << " into " << into);
        CHECK(cmp.ok);
        if (std::string(into) != gate_up) continue;
        std::vector<Parameter*> r = reloaded->parameters(), s = model->parameters();
        for (size_t i = 0; i < r.size(); ++i) {
          Comparison v = compare_tensors(r[i]->value, s[i]->value, rtol > 1e-12 ? rtol : 0.0, 0.0, r[i]->name);
          INFO(v.message);
          CHECK(v.ok);
        }
      }
    }
  }
}

TEST_CASE("lora patterns: --init-adapter checks the file's patterns in its order against the config", "[rank_pattern][export]") {
  auto backend = kernels::make_cpu_backend();
  Config c = pattern_config();
  auto model = make_model(*backend, c);
  randomize_adapters(*model, 500);
  fs::path dir = scratch("init") / "adapter";
  export_adapter(*model, c, dir, AdapterLayout::kTransformers5);
  const OrderedJson original = read_json(dir / "adapter_config.json");

  SECTION("a model without the patterns: refused, naming both sides and the key to set") {
    Config plain = c;
    plain.lora.rank_pattern.clear();
    plain.lora.alpha_pattern.clear();
    auto other = make_model(*backend, plain);
    check_load_refused(*other, dir, ExitCode::kBadConfig,
                       {"the adapter gives model.layers.0.self_attn.o_proj rank 6 (rank_pattern \".*\\.o_proj\") "
                        "but the config gives model.layers.0.self_attn.o_proj rank 4 (lora.rank)",
                        "set lora.rank_pattern"});
  }

  SECTION("an alpha that differs: refused, naming alpha_pattern") {
    Config other_alpha = c;
    other_alpha.lora.alpha_pattern = {{"o_proj", 12.0}, {"up_proj", 5.0}};
    auto other = make_model(*backend, other_alpha);
    check_load_refused(*other, dir, ExitCode::kBadConfig,
                       {"lora_alpha 24 (alpha_pattern \".*\\.o_proj\")",
                        "alpha 12 (lora.alpha_pattern[\"o_proj\"])"});
  }

  SECTION("the first matching key in the file's order decides, as in PEFT") {
    // Layer 0's o_proj by its own key, then a key that gives every other o_proj rank 2 ahead of
    // the one that gives them 6: in this order the file contradicts its tensors (rank 6).
    OrderedJson config = original;
    config["rank_pattern"] = OrderedJson::object();
    config["rank_pattern"]["model\\.layers\\.0\\.self_attn\\.o_proj"] = 6;
    config["rank_pattern"][".*o_proj"] = 2;
    config["rank_pattern"][".*\\.o_proj"] = 6;
    for (const auto& [key, value] : original["rank_pattern"].items())
      if (key != ".*\\.o_proj") config["rank_pattern"][key] = value;
    write_json(dir / "adapter_config.json", config);
    auto again = make_model(*backend, c);
    check_load_refused(*again, dir, ExitCode::kBadCheckpoint,
                       {"model.layers.1.self_attn.o_proj.lora_A.weight\" has rank 6, but adapter_config.json "
                        "gives model.layers.1.self_attn.o_proj rank 2 (rank_pattern \".*o_proj\")"});
    // The other order (".*\\.o_proj" first; a sorted map would read it so) loads.
    OrderedJson swapped = original;
    swapped["rank_pattern"] = OrderedJson::object();
    swapped["rank_pattern"][".*\\.o_proj"] = 6;
    swapped["rank_pattern"][".*o_proj"] = 2;
    for (const auto& [key, value] : original["rank_pattern"].items())
      if (key != ".*\\.o_proj") swapped["rank_pattern"][key] = value;
    write_json(dir / "adapter_config.json", swapped);
    auto [swapped_code, swapped_message] = load_error(*again, dir);
    INFO(swapped_message);
    CHECK(swapped_code == ExitCode::kOk);
    std::vector<Parameter*> loaded = again->parameters(), saved = model->parameters();
    for (size_t i = 0; i < loaded.size(); ++i) {  // gate and up at different scales: F32-rounded (above)
      Comparison v = compare_tensors(loaded[i]->value, saved[i]->value, 1e-6, 0.0, loaded[i]->name);
      INFO(v.message);
      CHECK(v.ok);
    }
  }

  SECTION("a pattern key PEFT reads differently from moetrain: refused naming it") {
    OrderedJson config = original;
    config["rank_pattern"]["(?i)O_PROJ"] = 6;
    write_json(dir / "adapter_config.json", config);
    auto again = make_model(*backend, c);
    check_load_refused(*again, dir, ExitCode::kBadCheckpoint, {"rank_pattern key \"(?i)O_PROJ\""});
  }
}

TEST_CASE("lora patterns: training checkpoints and resumes bit for bit, and exports the ranks", "[rank_pattern][checkpoint]") {
  auto make_config = [](const std::string& name) {
    Config c = testing::four_step_run_config(scratch(name).string());
    c.lora.targets = {"o_proj", "kv_b_proj", "experts"};
    c.lora.rank_pattern = {{"o_proj", 6}, {"layers\\.2\\..*", 2}};
    c.lora.alpha_pattern = {{"experts\\.down_proj", 3.0}};
    return c;
  };
  using Run = testing::TrainingRun;

  Run straight(make_config("straight"));
  const std::vector<double> expected = testing::four_step_losses(straight);
  REQUIRE(find_parameter(*straight.model, "model.layers.2.self_attn.o_proj.lora_A.weight")->value.size(0) == 6);
  REQUIRE(find_parameter(*straight.model, "model.layers.2.mlp.experts.up_proj.lora_A.weight")->value.size(1) == 2);

  Config split = make_config("split");
  std::unique_ptr<Run> resumed = check_resume_matches(split, straight, expected);
  Run& second = *resumed;

  // `moetrain export` takes the patterns from the checkpoint's config; --init-adapter reads them.
  const fs::path adapter = testing::export_run_adapter(split);
  OrderedJson config = read_json(adapter / "adapter_config.json");
  CHECK(config["alpha_pattern"][".*\\.down_proj"] == 3.0);
  Run fresh(make_config("fresh"));
  load_peft_adapter(*fresh.model, adapter.string());
  CHECK(same_adapter_bytes(*fresh.model, *second.model));
}
