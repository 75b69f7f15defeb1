// Bad model directories and bad LoRA settings: each a clear error with the right exit code,
// naming the tensor or key. The good directory is the golden "noqlora" fixture, copied to a
// scratch directory and broken one way at a time.
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>

#include "catch.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(MOETRAIN_FIXTURE_DIR) / "golden" / "noqlora";

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

// A fresh copy of the fixture's config.json and weights in a scratch directory.
fs::path scratch_model(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("moetrain_import_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kFixture / "config.json", dir / "config.json");
  fs::copy_file(kFixture / "model.safetensors", dir / "model.safetensors");
  return dir;
}

// Rewrites the directory's weights, each passed through `edit` first (false: left out).
void rewrite_weights(const fs::path& dir, const std::function<bool(const std::string&, Tensor&)>& edit) {
  SafetensorsFile original((kFixture / "model.safetensors").string());
  std::vector<Tensor> keep;
  std::vector<NamedTensor> tensors;
  for (const std::string& name : original.names()) {
    Tensor t = original.read_as(name, DType::kF32);
    if (!edit(name, t)) continue;
    tensors.push_back({name, t.view()});
    keep.push_back(std::move(t));
  }
  fs::remove(dir / "model.safetensors");
  write_hf_checkpoint(dir.string(), tensors, HfShardedWriteParams{});
}

// Rewrites the directory's weights without `drop` and with `reshape` given a wrong shape.
void rewrite_weights(const fs::path& dir, const std::string& drop, const std::string& reshape) {
  rewrite_weights(dir, [&](const std::string& name, Tensor& t) {
    if (name == reshape) t = Tensor({t.numel()}, DType::kF32);  // flattened: wrong shape, same bytes
    return name != drop;
  });
}

// Rewrites the directory's weights with one element of `name` set to NaN.
void poison_weight(const fs::path& dir, const std::string& name, int64_t element) {
  rewrite_weights(dir, [&](const std::string& n, Tensor& t) {
    if (n == name) t.ptr<float>()[element] = std::numeric_limits<float>::quiet_NaN();
    return true;
  });
}

Error load_error(const fs::path& dir, std::vector<std::string> targets = {"o_proj"}) {
  try {
    Config config;
    config.model.hf_dir = dir.string();
    config.data.seq_len = 16;
    ModelSpec spec = resolve_model_spec(config);
    auto backend = kernels::make_cpu_backend();
    ModelOptions options;
    options.lora_targets = targets;
    Model model(spec, *backend, options);
    model.load_weights(HfCheckpoint(dir.string()));
  } catch (const Error& e) {
    return e;
  }
  return Error(ExitCode::kOk, "");
}

// The error of loading the fixture with `from` in its config.json replaced by `to` (in scratch
// directory `scratch`): a config error.
Error config_json_error(const std::string& scratch, const std::string& from, const std::string& to) {
  fs::path dir = scratch_model(scratch);
  std::string json = read_text(dir / "config.json");
  json.replace(json.find(from), from.size(), to);
  write_text(dir / "config.json", json);
  Error e = load_error(dir);
  CHECK(e.code() == ExitCode::kBadConfig);
  return e;
}

// The error of loading the fixture rewritten without `drop` and with `reshape` misshapen (in
// scratch directory `scratch`): a checkpoint error naming the tensor.
Error checkpoint_error(const std::string& scratch, const std::string& drop, const std::string& reshape) {
  fs::path dir = scratch_model(scratch);
  rewrite_weights(dir, drop, reshape);
  Error e = load_error(dir);
  CHECK(e.code() == ExitCode::kBadCheckpoint);
  CHECK(contains(e.what(), drop.empty() ? reshape : drop));
  return e;
}

}  // namespace

TEST_CASE("the unmodified fixture loads", "[import]") {
  Error e = load_error(scratch_model("good"));
  INFO(e.what());
  CHECK(e.code() == ExitCode::kOk);
}

TEST_CASE("an unknown model_type is a config error naming it", "[import]") {
  Error e = config_json_error("model_type", "\"deepseek_v3\"", "\"llama\"");
  CHECK(contains(e.what(), "model_type \"llama\""));
  CHECK(contains(e.what(), "supported: deepseek_v3"));
}

TEST_CASE("a missing tensor is a checkpoint error naming it", "[import]") {
  Error e = checkpoint_error("missing", "model.layers.1.self_attn.kv_b_proj.weight", "");
  CHECK(contains(e.what(), "missing"));
}

TEST_CASE("a missing routed expert tensor is named with its expert", "[import]") {
  checkpoint_error("missing_expert", "model.layers.2.mlp.experts.5.up_proj.weight", "");
}

TEST_CASE("a tensor whose shape does not match config.json is named with both shapes", "[import]") {
  Error e = checkpoint_error("shape", "", "model.layers.0.mlp.down_proj.weight");
  CHECK(contains(e.what(), "[1536]"));
  CHECK(contains(e.what(), "[32, 48]"));
}

TEST_CASE("config.json with a wrong-typed or missing key is named", "[import]") {
  Error e = config_json_error("json", "\"n_routed_experts\"", "\"n_routed_experts_renamed\"");
  CHECK(contains(e.what(), "n_routed_experts"));
}

TEST_CASE("a LoRA target that matches no module is a config error naming it", "[import]") {
  // The fixture has no q LoRA, so q_a_proj exists nowhere.
  Error e = load_error(scratch_model("target"), {"o_proj", "q_a_proj"});
  CHECK(e.code() == ExitCode::kBadConfig);
  CHECK(contains(e.what(), "\"q_a_proj\" matches no module"));
  CHECK(contains(e.what(), "its targets are: down_proj, experts, gate_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, "
                           "q_proj, shared_experts, up_proj"));
}

TEST_CASE("a token id outside the vocabulary is a data error naming its position", "[import]") {
  Config config = tiny_model_config(false);
  ModelSpec spec = resolve_model_spec(config);
  auto backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.lora_targets = {"o_proj"};
  Model model(spec, *backend, options);
  model.init_random_weights();
  Batch batch = tiny_batch(config.model.vocab_size, 5);
  batch.input_ids[7] = static_cast<int32_t>(config.model.vocab_size);
  std::string message = error_message([&] { model.forward_backward(batch, 1.0); });
  CHECK(contains(message, "token id 37 at batch position 7"));
  try {
    model.forward_backward(batch, 1.0);
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadData);
  }
}

TEST_CASE("a NaN in a base weight is a bad checkpoint naming the tensor, before any step", "[import]") {
  for (const std::string name : {"model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
                                 "lm_head.weight"}) {
    fs::path dir = scratch_model("nan");
    poison_weight(dir, name, 5);
    Error e = load_error(dir);
    INFO(e.what());
    CHECK(e.code() == ExitCode::kBadCheckpoint);
    CHECK(std::string(e.what()).find("tensor \"" + name + "\"") != std::string::npos);
    CHECK(std::string(e.what()).find("holds a non-finite value (nan at row 0, element 5)") != std::string::npos);
  }
}
