// Config: the shipped configs load; every way a config can be wrong gives exit code 2 and a
// message naming the key, where it was set (file:line or --set) and the fix; --set overrides;
// the resolved YAML reads back to the same config; world-size rules.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"
#include "core/model/model_spec.h"
#include "expected_error.h"

using namespace moetrain;

namespace {

// YAML text from lines, so a test can say "line 3" and be right by construction.
std::string yaml_lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

// The smallest valid config the tests start from.
const std::vector<std::string> kTinyLines = {
    "model:",                  // 1
    "  vocab_size: 64",        // 2
    "  hidden_size: 32",       // 3
    "  num_layers: 2",         // 4
    "  mla:",                  // 5
    "    num_heads: 2",        // 6
    "  moe:",                  // 7
    "    num_experts: 4",      // 8
    "    top_k: 2",            // 9
    "data:",                   // 10
    "  seq_len: 16",           // 11
};

Config parse_tiny(const std::vector<std::string>& overrides = {}) {
  return parse_config(yaml_lines(kTinyLines), "tiny.yaml", overrides);
}

// Runs `body`, which must throw a bad-config Error; returns the message.
template <class Body>
std::string bad_config_message(Body&& body) {
  return testing::expected_error(ExitCode::kBadConfig, std::forward<Body>(body));
}

std::string parse_error(const std::vector<std::string>& lines, const std::vector<std::string>& overrides = {}) {
  return bad_config_message([&] { parse_config(yaml_lines(lines), "test.yaml", overrides); });
}

std::string override_error(const std::vector<std::string>& overrides) {
  return bad_config_message([&] { parse_tiny(overrides); });
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("every config in configs/ validates", "[config]") {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(MOETRAIN_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  }
  REQUIRE(files.size() >= 3);
  for (const auto& file : files) {
    INFO("config " << file.string());
    Config config = load_config(file.string());
    CHECK(config.source_path == file.string());
    // What a file writes out reads back to the same settings.
    CHECK(same_settings(parse_config(config_to_yaml(config), "resolved.yaml"), config));
  }
}

TEST_CASE("the shipped configs say what their headers promise", "[config]") {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR) + "/configs/";
  Config quick = load_config(dir + "quickstart.yaml");
  CHECK(quick.model.num_layers == 4);
  CHECK(quick.model.layers == std::vector<std::string>{"kda", "mla", "kda", "mla"});
  CHECK(quick.model.kda.num_heads * quick.model.kda.head_dim == quick.model.hidden_size);
  CHECK(quick.model.moe.num_experts == 8);
  CHECK(quick.model.moe.top_k == 2);
  CHECK(!quick.model.mla.q_lora_rank.has_value());
  validate_for_world(quick, 1);

  Config kimi = load_config(dir + "kimi-linear-48b.yaml");
  REQUIRE(kimi.model.layers.size() == 27);
  // MLA at config.json's full_attn_layers 4, 8, ..., 24, 27 (1-based), KDA elsewhere.
  for (size_t i = 0; i < 27; ++i) {
    bool full_attention = (i + 1) % 4 == 0 || i + 1 == 27;
    CHECK(kimi.model.layers[i] == (full_attention ? "mla" : "kda"));
  }
  CHECK(kimi.model.hidden_size == 2304);
  CHECK(!kimi.model.mla.use_rope);
  CHECK(kimi.model.moe.num_experts == 256);
  CHECK(kimi.model.kda.num_heads == 32);
  CHECK(kimi.model.kda.head_dim == 128);
  CHECK(kimi.model.kda.lower_bound == 0.0);
  validate_for_world(kimi, 1);

  Config slice = load_config(dir + "h200-kimi-linear-slice.yaml");
  CHECK(slice.model.layers == std::vector<std::string>{"kda", "kda", "kda", "mla", "kda", "kda", "kda", "kda"});
  CHECK(slice.data.seq_len == 8192);
  CHECK(slice.model.kda.head_dim == 128);
  validate_for_world(slice, 1);

  Config deepseek = load_config(dir + "deepseek-v3.2.yaml");
  CHECK(deepseek.model.num_layers == 61);
  CHECK(deepseek.model.layers == std::vector<std::string>(61, "dsa"));
  CHECK(deepseek.model.mla.rope_scaling.type == "yarn");
  CHECK(deepseek.model.mla.rope_scaling.factor == 40.0);
  CHECK(deepseek.model.moe.topk_groups == 4);
  validate_for_world(deepseek, 32);  // the job size its header names
  CHECK_THROWS_AS(validate_for_world(deepseek, 1), Error);
}

TEST_CASE("unknown keys name the full path, the line and the closest key", "[config]") {
  SECTION("a slip at the right level") {
    std::vector<std::string> lines = kTinyLines;
    lines[5] = "    num_head: 2";  // line 6
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "test.yaml:6:5"));
    CHECK(has(message, "unknown key `model.mla.num_head`"));
    CHECK(has(message, "did you mean `model.mla.num_heads`?"));
  }
  SECTION("the right name at the wrong level") {
    std::vector<std::string> lines = kTinyLines;
    lines.insert(lines.begin() + 4, "  top_k: 2");  // line 5, belongs in model.moe
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "test.yaml:5:3"));
    CHECK(has(message, "unknown key `model.top_k`"));
    CHECK(has(message, "did you mean `model.moe.top_k`?"));
  }
  SECTION("a name used in several sections: all are offered") {
    std::vector<std::string> lines = kTinyLines;
    lines.insert(lines.begin() + 4, "  seed: 3");  // line 5
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "test.yaml:5:3: unknown key `model.seed` (did you mean `data.seed` or `train.seed`?)"));
  }
  SECTION("a misspelt section") {
    std::string message = parse_error({"modle:", "  vocab_size: 64"});
    INFO(message);
    CHECK(has(message, "test.yaml:1:1: unknown key `modle`"));
    CHECK(has(message, "did you mean `model`?"));
  }
  SECTION("nothing close: the valid keys are listed") {
    std::vector<std::string> lines = kTinyLines;
    lines.push_back("parallel:");
    lines.push_back("  tensor_parallel: 2");  // line 13
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "test.yaml:13:3: unknown key `parallel.tensor_parallel`"));
    CHECK(has(message, "valid keys in `parallel`: `fsdp`, `ep`, `cp`, `cp_layout`, `prefetch`, `recompute`"));
  }
  SECTION("all problems are reported at once, in line order") {
    std::vector<std::string> lines = kTinyLines;
    lines[1] = "  vocab_sise: 64";  // line 2
    lines[8] = "    topk: 2";       // line 9
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "2 problems"));
    CHECK(message.find("test.yaml:2:") < message.find("test.yaml:9:"));
    CHECK(has(message, "did you mean `model.vocab_size`?"));
    CHECK(has(message, "did you mean `model.moe.top_k`?"));
  }
  SECTION("a key set twice") {
    std::vector<std::string> lines = kTinyLines;
    lines.insert(lines.begin() + 4, "  hidden_size: 64");  // line 5 repeats line 3
    std::string message = parse_error(lines);
    INFO(message);
    CHECK(has(message, "test.yaml:5:3: `model.hidden_size` is set more than once"));
  }
}

TEST_CASE("wrong types name the key, the expected type and the line", "[config]") {
  struct Case {
    size_t line;          // 1-based line of kTinyLines to replace (or append when past the end)
    std::string text;
    std::string expected; // in the message
  };
  const std::vector<Case> cases = {
      {3, "  hidden_size: big", "test.yaml:3:3: `model.hidden_size` expects an integer, got `big`"},
      {4, "  num_layers: 2.5", "test.yaml:4:3: `model.num_layers` expects an integer, got `2.5`"},
      {2, "  vocab_size: \"64\"", "`model.vocab_size` expects an integer, got the quoted string \"64\" (remove the quotes)"},
      {2, "  vocab_size: {a: 1}", "test.yaml:2:3: `model.vocab_size` expects an integer, got a map"},
      {2, "  vocab_size: [64]", "`model.vocab_size` expects an integer, got a list"},
      {3, "  hidden_size: null", "`model.hidden_size` expects an integer, got null (only optional keys may be null)"},
      {3, "  hidden_size: 99999999999999999999", "`model.hidden_size` = 99999999999999999999 is out of the 64-bit integer range"},
      {12, "lora: 4", "test.yaml:12:1: `lora` is a section: expected a map of keys, got `4`"},
      {6, "    num_heads: 2\n    q_lora_rank: many", "`model.mla.q_lora_rank` expects an integer or null, got `many`"},
      {12, "train: {lr: fast}", "test.yaml:12:9: `train.lr` expects a number, got `fast`"},
      {12, "train: {lr: 0x10}", "`train.lr` expects a number, got `0x10`"},
      {12, "lora: {rslora: yes}", "`lora.rslora` expects a boolean (true or false), got `yes`"},
      {12, "lora: {targets: q_proj}", "`lora.targets` expects a list of strings, like [a, b], got `q_proj`"},
      {12, "lora: {targets: [q_proj, [o_proj]]}", "test.yaml:12:26: `lora.targets[1]` expects a string, got a list"},
      {12, "data: {source: {a: b}}", "`data.source` expects a string (synthetic or a dataset path prefix) or a "
                                      "list of {path, weight}, got a map"},
      {12, "checkpoint: {dir: {a: b}}", "`checkpoint.dir` expects a string or null, got a map"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> lines = kTinyLines;
    if (c.line <= lines.size()) lines[c.line - 1] = c.text;
    else lines.push_back(c.text);
    std::string message = parse_error(lines);
    INFO("case: " << c.text << "\nmessage: " << message);
    CHECK(has(message, c.expected));
  }
}

TEST_CASE("broken YAML and unreadable files are bad configs", "[config]") {
  std::string message = parse_error({"model:", "  layers: [mla, mla", "  vocab_size: 3"});
  INFO(message);
  CHECK(has(message, "test.yaml:"));
  CHECK(has(message, "YAML syntax error"));

  message = parse_error({"- just", "- a list"});
  CHECK(has(message, "must be a map of sections"));

  message = bad_config_message([] { load_config("/nonexistent/moetrain.yaml"); });
  CHECK(has(message, "cannot read config file `/nonexistent/moetrain.yaml`"));
}

TEST_CASE("fixture files report file, line and fix", "[config]") {
  const std::string dir = std::string(MOETRAIN_FIXTURE_DIR) + "/configs/";
  std::string message = bad_config_message([&] { load_config(dir + "unknown_key.yaml"); });
  INFO(message);
  CHECK(has(message, "unknown_key.yaml:8:5: unknown key `model.mla.num_head` (did you mean `model.mla.num_heads`?)"));

  message = bad_config_message([&] { load_config(dir + "wrong_type.yaml"); });
  CHECK(has(message, "wrong_type.yaml:6:3: `model.num_layers` expects an integer, got `2.5`"));
  CHECK(has(message, "wrong_type.yaml:8:3: `train.lr` expects a number, got `fast`"));

  message = bad_config_message([&] { load_config(dir + "bad_rules.yaml"); });
  CHECK(has(message, "bad_rules.yaml:9:5: `model.moe.top_k` = 6 must be <= `model.moe.num_experts` = 4"));
  CHECK(has(message, "bad_rules.yaml:11:3: `lora.rank` = 0 must be > 0"));
}

TEST_CASE("null is allowed for optional keys only", "[config]") {
  Config config = parse_tiny({"model.mla.q_lora_rank=64"});
  REQUIRE(config.model.mla.q_lora_rank.has_value());
  CHECK(*config.model.mla.q_lora_rank == 64);
  config = parse_tiny({"model.mla.q_lora_rank=64", "model.mla.q_lora_rank=null"});
  CHECK(!config.model.mla.q_lora_rank.has_value());
  config = parse_tiny({"checkpoint.dir=~"});
  CHECK(!config.checkpoint.dir.has_value());
  // A quoted "null" is a string, not null.
  config = parse_tiny({"checkpoint.dir=\"null\""});
  REQUIRE(config.checkpoint.dir.has_value());
  CHECK(*config.checkpoint.dir == "null");
  std::string message = override_error({"train.schedule=null"});
  CHECK(has(message, "`train.schedule` expects a string, got null (only optional keys may be null)"));
  // An empty section keeps its defaults.
  config = parse_config(yaml_lines({"model:", "  vocab_size: 64", "  hidden_size: 32", "  num_layers: 2",
                                    "  mla:", "lora:"}),
                        "test.yaml");
  CHECK(config.model.mla.num_heads == MlaConfig().num_heads);
  CHECK(config.lora.rank == LoraConfig().rank);
}

TEST_CASE("required keys: the model's shape, unless it comes from hf_dir", "[config]") {
  std::string message = parse_error({"model:", "  vocab_size: 64", "  num_layers: 2"});
  INFO(message);
  CHECK(has(message, "missing required key `model.hidden_size`"));
  CHECK(has(message, "model.hf_dir"));
  CHECK(!has(message, "`model.vocab_size`"));

  message = parse_error({"train:", "  steps: 10"});
  CHECK(has(message, "missing required key `model.vocab_size`"));
  CHECK(has(message, "missing required key `model.num_layers`"));

  // With hf_dir the shape comes from config.json; rules over keys it will supply wait.
  Config config = parse_config(yaml_lines({"model:", "  hf_dir: /models/kimi", "  layers: [kda, kda, mla]"}),
                               "test.yaml");
  CHECK(config.model.hf_dir == std::string("/models/kimi"));
  CHECK(config.explicit_model_keys == std::vector<std::string>{"model.hf_dir", "model.layers"});
  // ... and validate_config after the import applies them (num_layers is still the default 4).
  message = bad_config_message([&] { validate_config(config); });
  CHECK(has(message, "`model.layers` lists 3 mixers but `model.num_layers` = 4"));
  config.model.num_layers = 3;
  validate_config(config);
}

TEST_CASE("single-field and cross-field rules name the keys and the fix", "[config]") {
  struct Case {
    std::vector<std::string> overrides;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {{"lora.rank=0"}, {"`lora.rank` = 0 must be > 0"}},
      {{"lora.alpha=-1"}, {"`lora.alpha` = -1.0 must be > 0"}},
      {{"model.hidden_size=0"}, {"`model.hidden_size` = 0 must be > 0"}},
      {{"model.moe.scoring=relu"}, {"`model.moe.scoring` = `relu` is not allowed: use one of sigmoid | softmax"}},
      {{"train.schedule=step"}, {"`train.schedule`", "cosine | linear | constant"}},
      {{"train.device=tpu"}, {"`train.device`", "auto | cpu | cuda"}},
      {{"model.layers=[mla,mamba]"}, {"`model.layers[1]` = `mamba` is not allowed: use one of mla | kda | dsa"}},
      {{"model.attention_gate=sigmoid"}, {"`model.attention_gate`", "none | headwise | elementwise"}},
      {{"model.mla.rope_scaling.type=ntk"}, {"`model.mla.rope_scaling.type`", "none | yarn"}},
      {{"logging.level=verbose"}, {"`logging.level`", "debug | info | warn | error"}},
      {{"model.moe.aux_loss_type=token"}, {"`model.moe.aux_loss_type`", "sequence | batch"}},
      {{"checkpoint.every=10", "checkpoint.keep_last=1"}, {"`checkpoint.keep_last` = 1 must be >= 2 when `checkpoint.every` > 0"}},
      {{"model.layers=[mla,mla,mla]"}, {"`model.layers` lists 3 mixers but `model.num_layers` = 2"}},
      {{"model.moe.top_k=5"}, {"`model.moe.top_k` = 5 must be <= `model.moe.num_experts` = 4"}},
      {{"model.moe.num_groups=3"}, {"`model.moe.num_experts` = 4 is not divisible by `model.moe.num_groups` = 3"}},
      {{"model.moe.num_groups=2", "model.moe.topk_groups=3"}, {"`model.moe.topk_groups` = 3 must be <= `model.moe.num_groups` = 2"}},
      {{"model.moe.num_groups=4", "model.moe.topk_groups=1", "model.moe.top_k=2"}, {"`model.moe.top_k` = 2 is more than the 1 experts", "raise topk_groups"}},
      {{"model.first_k_dense=3"}, {"`model.first_k_dense` = 3 must be <= `model.num_layers` = 2"}},
      {{"model.mla.qk_rope_head_dim=0"}, {"`model.mla.use_rope` is true but `model.mla.qk_rope_head_dim` is 0"}},
      {{"model.mla.qk_rope_head_dim=7"}, {"`model.mla.qk_rope_head_dim` = 7 must be even"}},
      {{"model.mla.use_rope=false", "model.mla.rope_scaling.type=yarn", "model.mla.rope_scaling.factor=4"},
       {"`model.mla.rope_scaling.type` is yarn but `model.mla.use_rope` is false"}},
      {{"model.mla.q_lora_rank=0"}, {"`model.mla.q_lora_rank` = 0 must be > 0"}},
      {{"model.kda.num_heads=0"}, {"`model.kda.num_heads` = 0 must be > 0"}},
      {{"model.kda.head_dim=-8"}, {"`model.kda.head_dim` = -8 must be > 0"}},
      {{"model.kda.conv_width=0"}, {"`model.kda.conv_width` = 0 must be > 0"}},
      {{"model.kda.lower_bound=2"}, {"`model.kda.lower_bound` = 2.0 must be <= 0", "Kimi K3's bounded gate"}},
      {{"train.warmup_steps=200", "train.steps=100"}, {"`train.warmup_steps` = 200 must be <= `train.steps` = 100"}},
      {{"data.seq_len=1"}, {"`data.seq_len` = 1 must be >= 2"}},
      {{"data.seq_len=8192"}, {"`data.seq_len` = 8192 is longer than `model.max_position_embeddings` = 4096"}},
      {{"lora.targets=[]"}, {"`lora.targets` is empty", "q_a_proj | q_b_proj | q_proj"}},
      {{"lora.targets=[q_proj,attention]"}, {"`lora.targets[1]` = `attention` is not allowed", "shared_experts | experts"}},
      {{"lora.targets=[q_proj,q_proj]"}, {"`lora.targets[1]` = `q_proj` is listed twice"}},
      {{"parallel.ep=8"}, {"`parallel.ep` = 8 must be <= `model.moe.num_experts` = 4"}},
      {{"parallel.fsdp=0"}, {"`parallel.fsdp` = 0 must be > 0"}},
      {{"parallel.cp=0"}, {"`parallel.cp` = 0 must be > 0"}},
      {{"parallel.cp=3"},
       {"`parallel.cp` = 3 must divide a micro-batch's tokens, `data.seq_len` x `data.micro_batch` =",
        "make data.seq_len a multiple of 3"}},
      {{"parallel.cp=3", "parallel.cp_layout=balanced"},
       {"`parallel.cp_layout` = `balanced` cuts each window of `data.seq_len` =",
        "into 2 x `parallel.cp` = 6 equal chunks: make data.seq_len a multiple of 6, or set parallel.cp_layout: "
        "contiguous"}},
      {{"parallel.cp_layout=zigzag"},
       {"`parallel.cp_layout` = `zigzag` is not allowed: use one of balanced | contiguous"}},
      {{"parallel.recompute=false", "parallel.recompute_layers=1"},
       {"`parallel.recompute_layers` = 1 needs `parallel.recompute: true`"}},
      {{"parallel.recompute_layers=3"},
       {"`parallel.recompute_layers` = 3 must be -1 (every layer) or 0 .. `model.num_layers` = 2"}},
      {{"parallel.recompute_layers=-2"}, {"`parallel.recompute_layers` = -2 must be -1 (every layer)"}},
      {{"parallel.ffn_chunk_tokens=-1"}, {"`parallel.ffn_chunk_tokens` = -1 must be >= 0"}},
      {{"parallel.cp_key_chunk=-3"}, {"`parallel.cp_key_chunk` = -3 must be >= 0"}},
      {{"parallel.ffn_chunk_tokens=4096", "model.moe.aux_loss_coef=0.01"},
       {"`parallel.ffn_chunk_tokens` = 4096 cannot run with `model.moe.aux_loss_coef` = 0.01", "set one of them to 0"}},
      {{"parallel.mixer_segment_tokens=-64"}, {"`parallel.mixer_segment_tokens` = -64 must be >= 0"}},
      {{"parallel.mixer_segment_tokens=100"},
       {"`parallel.mixer_segment_tokens` = 100 must be a multiple of 64", "try 128"}},
      {{"parallel.mixer_segment_tokens=4096", "parallel.cp=2"},
       {"`parallel.mixer_segment_tokens` = 4096 cannot run with `parallel.cp` = 2"}},
      {{"train.beta2=1.0"}, {"`train.beta2` = 1.0 must be in [0.0, 1.0)"}},
      {{"train.expert_window=-1"}, {"`train.expert_window` = -1 must be >= 0"}},
      {{"data.grad_accum=2", "train.expert_window=3"},
       {"`train.expert_window` = 3 is more than the step's `data.grad_accum` = 2", "lower the window"}},
      {{"data.grad_accum=2", "train.expert_window=2", "parallel.cp=2"},
       {"`train.expert_window` = 2 cannot run with `parallel.cp` = 2", "set one of them to 1"}},
  };
  for (const Case& c : cases) {
    std::string message = override_error(c.overrides);
    INFO("overrides: " << c.overrides.front() << "\nmessage: " << message);
    // A rule broken by an override is located at that --set.
    CHECK(has(message, "--set "));
    for (const std::string& part : c.expected) CHECK(has(message, part));
  }
}

TEST_CASE("rule messages point at the line that set the key", "[config]") {
  std::vector<std::string> lines = kTinyLines;
  lines[8] = "    top_k: 9";  // line 9
  std::string message = parse_error(lines);
  INFO(message);
  CHECK(has(message, "test.yaml:9:5: `model.moe.top_k` = 9 must be <= `model.moe.num_experts` = 4"));
}

TEST_CASE("NoPE MLA may keep rope dimensions it does not rotate", "[config]") {
  Config config = parse_tiny({"model.mla.use_rope=false", "model.mla.qk_rope_head_dim=64"});
  CHECK(!config.model.mla.use_rope);
  CHECK(config.model.mla.qk_rope_head_dim == 64);
  config = parse_tiny({"model.mla.use_rope=false", "model.mla.qk_rope_head_dim=0"});
  CHECK(config.model.mla.qk_rope_head_dim == 0);
}

TEST_CASE("--set overrides file values with the same strictness", "[config]") {
  Config config = parse_tiny({"model.layers=[mla, kda]", "train.lr=1e-4", "lora.rslora=true",
                              "data.source=/data/tokens", "model.mla.num_heads=8", "model.mla.num_heads=16"});
  CHECK(config.model.layers == std::vector<std::string>{"mla", "kda"});
  CHECK(config.train.lr == 1e-4);
  CHECK(config.lora.rslora);
  CHECK(config.data.source == "/data/tokens");
  CHECK(config.model.mla.num_heads == 16);  // the last override wins
  CHECK(config.model.vocab_size == 64);     // from the file

  // A map value merges into a section.
  config = parse_tiny({"model.moe={num_experts: 16, top_k: 4}"});
  CHECK(config.model.moe.num_experts == 16);
  CHECK(config.model.moe.top_k == 4);
  CHECK(config.model.moe.num_shared_experts == MoeConfig().num_shared_experts);

  std::string message = override_error({"model.mla.num_head=8"});
  CHECK(has(message, "--set model.mla.num_head=8: unknown key `model.mla.num_head` (did you mean `model.mla.num_heads`?)"));
  message = override_error({"trian.lr=1"});
  CHECK(has(message, "--set trian.lr=1: unknown key `trian` (did you mean `train`?)"));
  message = override_error({"model.hidden_size=wide"});
  CHECK(has(message, "--set model.hidden_size=wide: `model.hidden_size` expects an integer, got `wide`"));
  message = override_error({"train.lr"});
  CHECK(has(message, "--set train.lr: expected key.path=value"));
  message = override_error({"model..hidden_size=3"});
  CHECK(has(message, "`model..hidden_size` is not a key path"));
  message = override_error({"model.layers[1]=kda"});
  CHECK(has(message, "a list is set whole"));
  message = override_error({"model.layers=[mla, kda"});
  CHECK(has(message, "--set model.layers=[mla, kda: the value is not valid YAML"));
  message = override_error({"model.hidden_size.x=3"});
  CHECK(has(message, "`model.hidden_size` expects an integer, got a map"));
}

TEST_CASE("explicit_model_keys lists the model keys the file and overrides set", "[config]") {
  Config config = parse_tiny({"model.mla.q_lora_rank=null", "train.steps=50"});
  const std::vector<std::string> expected = {"model.hidden_size", "model.mla.num_heads", "model.mla.q_lora_rank",
                                             "model.moe.num_experts", "model.moe.top_k", "model.num_layers",
                                             "model.vocab_size"};
  CHECK(config.explicit_model_keys == expected);
}

TEST_CASE("config_to_yaml writes every key and reads back to the same config", "[config]") {
  // Every key set away from its default, and strings that YAML would misread unquoted.
  const std::string all_keys = yaml_lines({
      "model:",
      "  hf_dir: \"/models/my model: v2\"",
      "  model_type: kimi_linear",
      "  vocab_size: 1000",
      "  hidden_size: 96",
      "  num_layers: 3",
      "  layers: [kda, mla, dsa]",
      "  intermediate_size: 200",
      "  first_k_dense: 2",
      "  rms_norm_eps: 1.0e-5",
      "  tie_word_embeddings: true",
      "  max_position_embeddings: 8192",
      "  attention_gate: headwise",
      "  hidden_act: situ",
      "  situ_beta: 3.5",
      "  situ_linear_beta: 25.0",
      "  weight_format: fp8",
      "  mla:",
      "    num_heads: 6",
      "    q_lora_rank: 48",
      "    kv_lora_rank: 24",
      "    qk_nope_head_dim: 12",
      "    qk_rope_head_dim: 6",
      "    v_head_dim: 10",
      "    use_rope: true",
      "    rope_theta: 50000.5",
      "    rope_scaling: {type: yarn, factor: 4.0, original_max_position_embeddings: 2048,",
      "                   beta_fast: 16.0, beta_slow: 2.0, mscale: 0.707, mscale_all_dim: 0.1}",
      "  kda: {num_heads: 3, head_dim: 8, conv_width: 3, lower_bound: -5.0, fused_qkv: true,",
      "        full_rank_output_gate: true}",
      "  dsa: {index_n_heads: 3, index_head_dim: 10, index_topk: 99, indexer_rope_interleave: true}",
      "  moe: {num_experts: 12, top_k: 3, num_shared_experts: 2, expert_intermediate_size: 40,",
      "        scoring: softmax, num_groups: 3, topk_groups: 2, normalize_topk: false,",
      "        routed_scaling_factor: 2.446, score_correction_bias: true, aux_loss_coef: 0.001,",
      "        aux_loss_type: batch, router_noise: 0.01, bias_update_rate: 0.0003, latent_size: 48,",
      "        use_latent_norm: true}",
      "lora: {rank: 4, alpha: 8.5, rslora: true, targets: [kv_a_proj_with_mqa, down_proj, experts]}",
      "parallel: {fsdp: 2, ep: 3, prefetch: 0, recompute: false}",
      "data: {source: \"yes\", seq_len: 64, micro_batch: 3, grad_accum: 5, seed: 7}",
      "train: {steps: 77, lr: 3.3e-4, warmup_steps: 7, schedule: linear, min_lr_ratio: 0.05,",
      "        weight_decay: 0.01, beta1: 0.8, beta2: 0.95, eps: 1.0e-10, grad_clip: 0.5, seed: 9,",
      "        device: cpu}",
      "checkpoint: {dir: \"ckpt dir\", every: 10, keep_last: 4, resume: none}",
      "logging: {run_dir: \"runs/a\\\"b\", every: 5, level: debug}",
  });
  Config original = parse_config(all_keys, "all.yaml");
  std::string written = config_to_yaml(original);
  INFO(written);
  Config reread = parse_config(written, "written.yaml");
  CHECK(same_settings(original, reread));
  // Spot checks against the literal above, independent of same_settings.
  CHECK(reread.model.hf_dir == std::string("/models/my model: v2"));
  CHECK(reread.model.layers == std::vector<std::string>{"kda", "mla", "dsa"});
  CHECK(reread.model.mla.q_lora_rank == std::optional<int64_t>(48));
  CHECK(reread.model.mla.rope_scaling.mscale == 0.707);
  CHECK(reread.model.dsa.index_topk == 99);
  CHECK(reread.model.dsa.indexer_rope_interleave);
  CHECK(reread.model.moe.bias_update_rate == 0.0003);
  CHECK(reread.model.moe.routed_scaling_factor == 2.446);
  CHECK(reread.model.rms_norm_eps == 1.0e-5);
  CHECK(reread.train.lr == 3.3e-4);
  CHECK(reread.data.source == "yes");
  CHECK(reread.checkpoint.dir == std::string("ckpt dir"));
  CHECK(reread.logging.run_dir == "runs/a\"b");
  CHECK(!reread.parallel.recompute);
  CHECK(reread.train.eps == 1.0e-10);
  CHECK(reread.model.kda.lower_bound == -5.0);
  CHECK(reread.model.kda.full_rank_output_gate);
  CHECK(reread.model.situ_linear_beta == 25.0);
  CHECK(reread.model.moe.latent_size == 48);
  // Every key was written, so every model key reads back as explicit.
  CHECK(reread.model.weight_format == "fp8");
  // model, mla, rope_scaling, kda, dsa, moe, vision
  CHECK(reread.explicit_model_keys.size() == 17 + 8 + 7 + 6 + 4 + 17 + 15);
  // same_settings is not always true: one changed value is seen.
  reread.train.beta2 = 0.96;
  CHECK(!same_settings(original, reread));
  // Defaults round-trip too, with null optionals.
  Config tiny = parse_tiny();
  CHECK(same_settings(parse_config(config_to_yaml(tiny), "written.yaml"), tiny));
  // recompute_layers, which the literal above leaves at its default (it needs recompute on).
  Config partial = parse_tiny({"parallel.recompute_layers=1"});
  CHECK(parse_config(config_to_yaml(partial), "written.yaml").parallel.recompute_layers == 1);
  CHECK(has(config_to_yaml(tiny), "q_lora_rank: null"));
}

TEST_CASE("validate_for_world names the keys, the world size and the fix", "[config]") {
  Config config = parse_tiny({"parallel.fsdp=4", "parallel.ep=2"});
  validate_for_world(config, 4);
  validate_for_world(config, 8);

  std::string message = bad_config_message([&] { validate_for_world(config, 6); });
  INFO(message);
  CHECK(has(message, "tiny.yaml with world size 6"));
  CHECK(has(message, "`parallel.fsdp` = 4 does not divide the world size 6"));
  CHECK(has(message, "set parallel.fsdp to one of 1, 2, 3, 6"));

  config = parse_tiny({"parallel.cp=2"});
  validate_for_world(config, 4);
  message = bad_config_message([&] { validate_for_world(config, 3); });
  CHECK(has(message, "`parallel.cp` = 2 does not divide the world size 3"));
  CHECK(has(message, "set parallel.cp to one of 1, 3"));

  config = parse_tiny({"parallel.ep=3"});
  message = bad_config_message([&] { validate_for_world(config, 4); });
  CHECK(has(message, "`model.moe.num_experts` = 4 is not divisible by `parallel.ep` = 3"));
  CHECK(has(message, "`parallel.ep` = 3 does not divide the world size 4"));
  CHECK(has(message, "set parallel.ep to one of 1, 2, 4"));

  config = parse_tiny({"parallel.ep=4"});
  message = bad_config_message([&] { validate_for_world(config, 2); });
  CHECK(has(message, "`parallel.ep` = 4 does not divide the world size 2"));
  CHECK(!has(message, "is not divisible by `parallel.ep`"));
}

TEST_CASE("validate_config checks a config built in code", "[config]") {
  Config config = parse_tiny();
  validate_config(config);
  config.model.moe.top_k = 7;
  std::string message = bad_config_message([&] { validate_config(config); });
  CHECK(has(message, "`model.moe.top_k` = 7 must be <= `model.moe.num_experts` = 4"));
}

// Every model key a YAML file can set next to model.hf_dir overrides config.json's value
// (core/model/model_spec.cpp's field copiers): none may be missing from that list, or a user who
// sets it stops with an internal error.
TEST_CASE("every model key can override an imported config.json", "[config]") {
  Config all = parse_config(config_to_yaml(Config{}), "every_key.yaml");  // every key explicit
  all.model.hf_dir = std::string(MOETRAIN_FIXTURE_DIR) + "/golden/kimi_linear";
  REQUIRE(all.explicit_model_keys.size() > 50);
  try {
    resolve_model_spec(all);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() != ExitCode::kInternal);  // a config disagreement is fine, a missing copier is not
  }
}

// Issue 28 item 7: a value from model.hf_dir's config.json that breaks a rule is blamed on
// config.json (its path and key), not on the YAML; a key the YAML sets is still the YAML's.
TEST_CASE("a config.json value that breaks a rule names config.json and its key", "[config][import]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "moetrain_test_config_hf_negative_experts";
  fs::create_directories(dir);
  std::ifstream golden(std::string(MOETRAIN_FIXTURE_DIR) + "/golden/qlora/config.json");
  std::stringstream text;
  text << golden.rdbuf();
  std::string json = text.str();
  const std::string experts = "\"n_routed_experts\": 8";
  REQUIRE(json.find(experts) != std::string::npos);
  json.replace(json.find(experts), experts.size(), "\"n_routed_experts\": -8");
  std::ofstream((dir / "config.json").string()) << json;
  const Config config = parse_config("model: {hf_dir: " + dir.string() + "}\ndata: {seq_len: 16}\n", "hf.yaml");
  std::string message = bad_config_message([&] { resolve_model_spec(config); });
  CHECK(has(message, (dir / "config.json").string() + " (\"n_routed_experts\"): `model.moe.num_experts` = -8 must be > 0"));
  CHECK(!has(message, "hf.yaml"));  // the one problem (no "parallel.ep must be <= -8" after it)
  // A rule over a config.json value and the YAML's own: placed at the YAML's key.
  const Config overridden =
      parse_config("model: {hf_dir: " + dir.string() + ", moe: {num_experts: 4}}\ndata: {seq_len: 64}\n", "hf.yaml");
  message = bad_config_message([&] { resolve_model_spec(overridden); });
  CHECK(has(message, "hf.yaml: `data.seq_len` = 64 is longer than `model.max_position_embeddings` = 32"));
  // The merged values: the qlora model's own dimensions, not the built-in defaults.
  const Config good =
      parse_config("model: {hf_dir: " + std::string(MOETRAIN_FIXTURE_DIR) + "/golden/qlora}\ndata: {seq_len: 16}\n", "hf.yaml");
  const ModelSpec spec = resolve_model_spec(good);
  CHECK(spec.config.vocab_size == 64);
  CHECK(spec.config.hidden_size == 32);
  CHECK(spec.config.num_layers == 3);
  fs::remove_all(dir);
}

TEST_CASE("model_type, vocab_size and the sizes' limits are config rules", "[config]") {
  CHECK(has(override_error({"model.model_type=llama"}),
            "`model.model_type` = `llama` is not allowed: use one of deepseek_v3 | deepseek_v32 | kimi_k2 | kimi_linear | kimi_k3"));
  CHECK(has(override_error({"model.vocab_size=1"}), "`model.vocab_size` = 1 must be >= 2"));
  CHECK(has(override_error({"model.vocab_size=16777217"}), "`model.vocab_size` = 16777217 must be <= 16777216"));
  CHECK(has(override_error({"model.num_layers=5000", "model.layers=[]"}), "`model.num_layers` = 5000 must be <= 4096"));
  CHECK(has(override_error({"model.moe.expert_intermediate_size=100000000000"}),
            "`model.moe.expert_intermediate_size` = 100000000000 must be <= 1048576"));
  CHECK(has(override_error({"model.hidden_size=2097152"}), "`model.hidden_size` = 2097152 must be <= 1048576"));
  CHECK_NOTHROW(parse_tiny({"model.vocab_size=2", "model.model_type=kimi_k3"}));
}

// Item 10: one rule for booleans. YAML 1.2's true/false spellings are booleans; the words YAML 1.1
// also reads as booleans, and 0 / 1, are refused with "write true or false".
TEST_CASE("booleans: YAML 1.2's spellings; yes/no/on/off/y/n/0/1 refused as ambiguous", "[config]") {
  for (const char* word : {"true", "True", "TRUE"}) {
    CHECK(parse_tiny({std::string("lora.rslora=") + word}).lora.rslora);
  }
  for (const char* word : {"false", "False", "FALSE"}) {
    CHECK(!parse_tiny({std::string("parallel.recompute=") + word}).parallel.recompute);
  }
  for (const char* word : {"yes", "No", "ON", "off", "y", "N", "0", "1"}) {
    const std::string message = override_error({std::string("parallel.recompute=") + word});
    INFO(message);
    CHECK(has(message, std::string("`parallel.recompute` expects a boolean (true or false), got `") + word + "`"));
    CHECK(has(message, "write true or false"));
  }
}
