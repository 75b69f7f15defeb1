// `moetrain merge` (core/checkpoint/merged_export.h) on the tiny golden models: a model with
// random non-zero adapters (per-module ranks and alphas, rsLoRA, MXFP4 experts), saved as a
// checkpoint, merged; then every tensor of the merged directory is checked against W + s B A
// computed here in double from the base file and the adapter values (with this file's own map
// from base tensor names to adapters and its own scales), every other tensor against the base's
// bytes, and the merged directory, loaded with no adapter, against the base with the adapter.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/checkpoint_group.h"
#include "core/checkpoint/checkpoint_writer.h"
#include "core/checkpoint/merged_export.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/model/model.h"
#include "golden_files.h"
#include "gradcheck.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/ops.h"
#include "scratch_dir.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

struct MergeCase {
  std::string fixture;
  std::string lora_yaml;      // the lora: section
  std::string expert_format;  // of the base ("" as config.json says)
  double logits_tolerance;    // merged (no adapter) vs base + adapter, relative to the largest logit
  std::string keep_as;        // with MOETRAIN_MERGE_EXPORT_DIR set: leave the files there under this name
};

// For scripts/check_merged_export.py (transformers loading the merged directory, on a machine
// with torch): $MOETRAIN_MERGE_EXPORT_DIR/<keep_as>/merged/ and ours.safetensors (the batch's
// input_ids and moetrain's logits with the adapter, F64 forward stored as F32).
void keep_for_transformers(const std::string& keep_as, const std::string& out, const Batch& batch,
                           const Tensor& logits) {
  const char* root = std::getenv("MOETRAIN_MERGE_EXPORT_DIR");
  if (root == nullptr || keep_as.empty()) return;
  const fs::path dir = fs::path(root) / keep_as;
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy(out, dir / "merged", fs::copy_options::recursive);
  Tensor ids({batch.batch_size, batch.seq_len}, DType::kI32);
  std::copy(batch.input_ids.begin(), batch.input_ids.end(), ids.ptr<int32_t>());
  Tensor logits32(logits.shape(), DType::kF32);
  convert_host(logits32, logits);
  SafetensorsWriter writer;
  writer.add("input_ids", ids.view());
  writer.add("logits", logits32.view().reshaped({batch.batch_size, batch.seq_len, logits.size(1)}));
  writer.write((dir / "ours.safetensors").string());
}

Config case_config(const std::string& dir, const MergeCase& c, int64_t seq_len, bool merged) {
  std::string yaml = "model: {hf_dir: " + dir;
  if (!merged && !c.expert_format.empty()) yaml += ", moe: {expert_format: " + c.expert_format + "}";
  yaml += "}\n" + c.lora_yaml + "\ndata: {seq_len: " + std::to_string(seq_len) + "}\n";
  return parse_config(yaml, "test_merged_export.yaml");
}

std::unique_ptr<Model> make_model(kernels::Backend& backend, const Config& config, bool with_adapters) {
  ModelOptions options = model_options_for(config);
  options.dtype = DType::kF64;
  if (!with_adapters) {
    options.lora_targets.clear();
    options.lora_rank_pattern = {};
    options.lora_alpha_pattern = {};
  }
  auto model = std::make_unique<Model>(resolve_model_spec(config), backend, options);
  model->load_weights(HfCheckpoint(*config.model.hf_dir));
  return model;
}

// Which adapters change a base tensor, by this test's own reading of the names: rows
// [tensor_row, tensor_row + rows) of the tensor (viewed as [rows, in]) get rows [b_row, ...) of
// expert `expert`'s (-1: a 2-D adapter's) delta of `module`. Per-expert tensors (ours or
// Moonshot's w1 / w3 / w2, packed or not) and transformers 5's fused [E, 2F, D] gate_up_proj /
// [E, D, F] down_proj belong to `<experts>.<proj>` (or the fused gate_up_proj adapter); any other
// `<module>.weight` to the 2-D adapter of <module>; language_model. and block_sparse_moe as ours.
struct Part {
  std::string module;
  int64_t expert = -1, tensor_row = 0, b_row = 0, rows = 0;
};
std::vector<Part> parts_of(std::string name, const Shape& shape, const std::map<std::string, Tensor>& adapters) {
  if (name.rfind("language_model.", 0) == 0) name = name.substr(15);
  name = std::regex_replace(name, std::regex("\\.block_sparse_moe\\."), ".mlp.");
  auto has = [&](const std::string& module) { return adapters.count(module + ".lora_A.weight") != 0; };
  std::vector<Part> parts;
  std::smatch m;
  if (std::regex_match(name, m, std::regex("(.*\\.experts)\\.(gate_up_proj|down_proj)"))) {
    const std::string experts = m[1];
    const int64_t rows = shape[1];
    for (int64_t e = 0; e < shape[0]; ++e) {
      if (m[2] == "down_proj") {
        parts.push_back({experts + ".down_proj", e, e * rows, 0, rows});
      } else if (has(experts + ".gate_up_proj")) {
        parts.push_back({experts + ".gate_up_proj", e, e * rows, 0, rows});
      } else {
        parts.push_back({experts + ".gate_proj", e, e * rows, 0, rows / 2});
        parts.push_back({experts + ".up_proj", e, e * rows + rows / 2, 0, rows / 2});
      }
    }
  } else if (std::regex_match(name, m, std::regex("(.*\\.experts)\\.([0-9]+)\\.(\\w+)\\.weight(_packed)?"))) {
    const std::string experts = m[1];
    std::string projection = m[3];
    projection = projection == "w1" ? "gate_proj" : projection == "w3" ? "up_proj" : projection == "w2" ? "down_proj"
                                                                                                      : projection;
    const int64_t e = std::stoll(m[2]);
    if (projection != "down_proj" && has(experts + ".gate_up_proj")) {
      parts.push_back({experts + ".gate_up_proj", e, 0, projection == "up_proj" ? shape[0] : 0, shape[0]});
    } else {
      parts.push_back({experts + "." + projection, e, 0, 0, shape[0]});
    }
  } else if (std::regex_match(name, m, std::regex("(.*)\\.weight"))) {
    parts.push_back({m[1], -1, 0, 0, shape.ndim() == 2 ? shape[0] : 0});
  }
  std::vector<Part> adapted;
  for (const Part& p : parts)
    if (has(p.module)) adapted.push_back(p);
  return adapted;
}

// Random non-zero adapters of `model`, F32-valued (what a checkpoint holds), set into the model
// too; by parameter name.
std::map<std::string, Tensor> random_f32_adapters(Model& model) {
  std::map<std::string, Tensor> adapters;  // F32, by parameter name
  uint64_t seed = 4100;
  for (Parameter* p : model.parameters()) {
    testing::fill_random(p->value, seed++, 0.05, 0.3);
    Tensor f32(p->value.shape(), DType::kF32);
    convert_host(f32, p->value);
    convert_host(p->value, f32);
    adapters.emplace(p->name, std::move(f32));
  }
  return adapters;
}

// `adapters` saved as the step-1 checkpoint of `config` under `root`; returns its path.
std::string save_adapters(CheckpointGroup& group, const std::map<std::string, Tensor>& adapters, const Config& config,
                          const std::string& root) {
  RankShard shard;
  for (const auto& [name, value] : adapters)
    shard.tensors.push_back({std::string(kParamKind) + name, value.view(), TensorSlice{value.shape(), 0}});
  SaveRequest request;
  request.root = root;
  request.step = 1;
  request.config_yaml = config_to_yaml(config);
  return save_checkpoint(group, request, shard);
}

// config.json of the merged directory `out` (without quantization_config once MXFP4 is decoded),
// and its index.
void check_merged_config(const std::string& dir, const std::string& out, const MergeCase& c) {
  REQUIRE(fs::exists(out + "/model.safetensors.index.json"));
  REQUIRE_FALSE(fs::exists(out + ".tmp"));
  std::ifstream base_config_in(dir + "/config.json"), merged_config_in(out + "/config.json");
  const nlohmann::json base_config = nlohmann::json::parse(base_config_in);
  const nlohmann::json merged_config = nlohmann::json::parse(merged_config_in);
  nlohmann::json expected_config = base_config;
  if (!c.expert_format.empty()) {
    expected_config.erase("quantization_config");
    if (expected_config.contains("text_config")) expected_config["text_config"].erase("quantization_config");
  }
  CHECK(merged_config == expected_config);
}

// Every weight of the merged directory `out` against the base `dir`: (a) W + s B A in double, rounded
// once; (b) the rest bit-identical; every adapter used.
void check_merged_weights(const std::string& dir, const std::string& out, const MergeCase& c,
                          const std::map<std::string, Tensor>& adapters) {
  auto scale_of = [&](const std::string& module, int64_t rank) {
    // The cases' lora sections: o_proj at rank 2, the routed experts at alpha 4, else 8; the
    // fused gate_up adapter takes twice its gate's (PEFT's 2 alpha).
    double alpha = module.find(".experts.") != std::string::npos ? 4.0 : 8.0;
    if (module.find(".experts.gate_up_proj") != std::string::npos) alpha *= 2.0;
    const bool rslora = c.lora_yaml.find("rslora: true") != std::string::npos;
    return alpha / (rslora ? std::sqrt(static_cast<double>(rank)) : static_cast<double>(rank));
  };
  SafetensorsFile base(dir + "/model.safetensors");
  HfCheckpoint merged(out);
  std::map<std::string, int> used;  // adapter module -> tensors it changed
  int64_t untouched = 0;
  for (const std::string& name : base.names()) {
    if (name.size() > 13 && name.compare(name.size() - 13, 13, ".weight_scale") == 0) continue;
    const bool packed = name.size() > 14 && name.compare(name.size() - 14, 14, ".weight_packed") == 0;
    const std::string out_name = packed ? name.substr(0, name.size() - 7) : name;
    INFO(out_name);
    REQUIRE(merged.has(out_name));
    const SafetensorsTensorInfo& info = merged.info(out_name);
    const std::vector<Part> parts = parts_of(name, info.shape, adapters);
    if (parts.empty() && !packed) {
      CHECK(info.dtype == base.info(name).dtype);
      const TensorView before = base.view(name), after = merged.file_for(name).view(name);
      REQUIRE(after.nbytes() == before.nbytes());
      CHECK(std::memcmp(after.data, before.data, before.nbytes()) == 0);
      ++untouched;
      continue;
    }
    Tensor w = packed ? Tensor(info.shape, DType::kF64) : base.read_as(name, DType::kF64);
    if (packed) {
      CHECK(info.dtype == DType::kBF16);
      const Tensor codes = base.read_as(name, DType::kU8);
      const Tensor scales = base.read_as(name.substr(0, name.size() - 7) + "_scale", DType::kU8);
      kernels::cpu::mxfp4_dequantize(w.view(), codes.view(), scales.view());
    } else {
      CHECK(info.dtype == base.info(name).dtype);
    }
    const int64_t in = info.shape[info.shape.ndim() - 1];
    for (const Part& p : parts) {
      const Tensor& a = adapters.at(p.module + ".lora_A.weight");
      const Tensor& b = adapters.at(p.module + ".lora_B.weight");
      const bool routed = b.shape().ndim() == 3;
      const int64_t rank = b.shape()[b.shape().ndim() - 1];
      REQUIRE(a.shape()[a.shape().ndim() - 1] == in);
      const float* a0 = a.ptr<float>() + (routed && a.shape().ndim() == 3 ? p.expert * rank * in : 0);
      const float* b0 = b.ptr<float>() + (routed ? p.expert * b.shape()[1] * rank : 0);
      const double s = scale_of(p.module, rank);
      for (int64_t o = 0; o < p.rows; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double delta = 0.0;
          for (int64_t k = 0; k < rank; ++k)
            delta += static_cast<double>(b0[(p.b_row + o) * rank + k]) * static_cast<double>(a0[k * in + i]);
          w.ptr<double>()[(p.tensor_row + o) * in + i] += s * delta;
        }
      ++used[p.module];
    }
    // The merged value is the expected one rounded once to the tensor's dtype (half an ulp, and
    // a little for the order of the sums).
    const double half_ulp = info.dtype == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    const Tensor got = merged.read_as(out_name, DType::kF64);
    testing::Comparison cmp = testing::compare_tensors(got, w, half_ulp * 1.01, 1e-30, out_name);
    INFO(cmp.message);
    CHECK(cmp.ok);
  }
  CHECK(untouched > 0);
  // Every adapter changed at least one tensor.
  for (const auto& [name, value] : adapters) {
    const std::string module = name.substr(0, name.rfind(".lora_"));
    INFO(module);
    CHECK(used[module] > 0);
  }
}

void check_merge(const MergeCase& c) {
  const std::string dir = testing::golden_dir(c.fixture);
  SafetensorsFile golden(dir + "/golden.safetensors");
  const Batch batch = testing::golden_batch(golden);
  const Config config = case_config(dir, c, batch.seq_len, /*merged=*/false);
  auto backend = kernels::make_cpu_backend();
  auto model = make_model(*backend, config, /*with_adapters=*/true);

  const std::map<std::string, Tensor> adapters = random_f32_adapters(*model);
  const Tensor logits = model->logits(batch);

  testing::ScratchDir scratch("merged_export_" + c.fixture);
  auto group = make_single_process_group();
  const std::string checkpoint = save_adapters(*group, adapters, config, scratch.file("checkpoints"));
  const std::string out = scratch.file("merged");
  merge_checkpoint(*group, MergeOptions{checkpoint, out, std::nullopt, 0});
  keep_for_transformers(c.keep_as, out, batch, logits);

  check_merged_config(dir, out, c);
  check_merged_weights(dir, out, c, adapters);

  // (c) The merged directory with no adapter computes what the base computes with the adapter.
  auto merged_model = make_model(*backend, case_config(out, c, batch.seq_len, /*merged=*/true), false);
  CHECK(merged_model->parameters().empty());
  const Tensor merged_logits = merged_model->logits(batch);
  const double largest = testing::max_abs(logits);
  testing::Comparison cmp = testing::compare_tensors(merged_logits, logits, 0.0, c.logits_tolerance * largest, "logits");
  INFO(cmp.message);
  CHECK(cmp.ok);
  // ... and not what the base alone computes (the adapters matter at this tolerance).
  auto base_model = make_model(*backend, config, false);
  CHECK_FALSE(testing::compare_tensors(base_model->logits(batch), logits, 0.0, c.logits_tolerance * largest).ok);
}

const std::string kTargets =
    "targets: [q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, down_proj, shared_experts, experts]";

}  // namespace

TEST_CASE("merge folds per-expert, dense, shared and attention adapters into an F32 base", "[merge]") {
  check_merge({"noqlora",
               "lora: {rank: 4, alpha: 8.0, " + kTargets +
                   ", rank_pattern: {o_proj: 2}, alpha_pattern: {'experts\\..*': 4.0}}",
               "", 1e-5, "noqlora"});
}

TEST_CASE("merge with rsLoRA and PEFT's fused gate_up expert adapter", "[merge]") {
  check_merge({"noqlora",
               "lora: {rank: 4, alpha: 8.0, rslora: true, expert_gate_up: fused, " + kTargets +
                   ", rank_pattern: {o_proj: 2}, alpha_pattern: {'experts\\.(down|gate)_proj': 4.0}}",
               "", 1e-5, "noqlora_fused_rslora"});
}

TEST_CASE("merge of a shared expert A into transformers 5's fused expert tensors", "[merge]") {
  check_merge({"kimi_linear_t5", "lora: {rank: 4, alpha: 8.0, expert_a: shared, targets: [o_proj, experts, shared_experts], "
               "alpha_pattern: {'experts\\..*': 4.0}, rank_pattern: {o_proj: 2}}",
               "", 1e-5, "kimi_linear_t5"});
}

TEST_CASE("merge writes Kimi K3's MXFP4 experts as BF16 and drops quantization_config", "[merge]") {
  // kimi_k3_mxfp4_bf16 routes every token to every expert: BF16 rounding of the merged experts
  // cannot flip a top-k choice, so the logits differ only by that rounding.
  check_merge({"kimi_k3_mxfp4_bf16",
               "lora: {rank: 4, alpha: 8.0, targets: [o_proj, q_b_proj, shared_experts, experts], "
               "rank_pattern: {o_proj: 2}, alpha_pattern: {'experts\\..*': 4.0}}",
               "mxfp4", 2e-2, ""});  // transformers has no Kimi K3 to check it against
}

TEST_CASE("merge refuses an existing non-empty --out and leaves it alone", "[merge]") {
  testing::ScratchDir scratch("merged_export_out");
  fs::create_directories(scratch.file("out"));
  std::ofstream(scratch.file("out/keep.txt")) << "mine\n";
  auto group = make_single_process_group();
  try {
    merge_checkpoint(*group, MergeOptions{scratch.file("no_checkpoint"), scratch.file("out"), std::nullopt, 0});
    FAIL("merge into a non-empty directory did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    CHECK(std::string(e.what()).find("never overwrites") != std::string::npos);
  }
  CHECK(fs::exists(scratch.file("out/keep.txt")));
  CHECK(parse_byte_size("5GB", "x") == 5000000000ull);
  CHECK(parse_byte_size("64KiB", "x") == 65536ull);
  CHECK_THROWS_AS(parse_byte_size("lots", "x"), Error);
}

TEST_CASE("merge writes the trained selection biases of aux-loss-free balancing; a bias the base lacks is refused",
          "[merge]") {
  const std::string dir = testing::golden_dir("noqlora");
  const Batch batch = testing::golden_batch(SafetensorsFile(dir + "/golden.safetensors"));
  const Config config = case_config(dir, {"noqlora", "lora: {rank: 4, alpha: 8.0, " + kTargets + "}", "", 1e-5, "noqlora"},
                                    batch.seq_len, /*merged=*/false);
  auto backend = kernels::make_cpu_backend();
  auto model = make_model(*backend, config, /*with_adapters=*/true);
  const std::map<std::string, Tensor> adapters = random_f32_adapters(*model);
  const std::string name = "model.layers.1.mlp.gate.e_score_correction_bias";
  HfCheckpoint base(dir);
  Tensor bias = base.read_as(name, DType::kF32);
  for (int64_t e = 0; e < bias.numel(); ++e) bias.ptr<float>()[e] += 0.125f * static_cast<float>(e % 3 - 1);

  for (const bool known : {true, false}) {
    testing::ScratchDir scratch(known ? "merged_export_bias" : "merged_export_bias_unknown");
    auto group = make_single_process_group();
    RankShard shard;
    for (const auto& [param, value] : adapters)
      shard.tensors.push_back({std::string(kParamKind) + param, value.view(), TensorSlice{value.shape(), 0}});
    const std::string key = std::string(kBufferKind) + (known ? name : "model.layers.9.mlp.gate.e_score_correction_bias");
    shard.tensors.push_back({key, bias.view(), TensorSlice{bias.shape(), 0}});
    SaveRequest request;
    request.root = scratch.file("checkpoints");
    request.step = 1;
    request.config_yaml = config_to_yaml(config);
    const std::string checkpoint = save_checkpoint(*group, request, shard);
    const std::string out = scratch.file("merged");
    if (!known) {
      try {
        merge_checkpoint(*group, MergeOptions{checkpoint, out, std::nullopt, 0});
        FAIL("a bias the base lacks was merged");
      } catch (const Error& e) {
        CHECK(e.code() == ExitCode::kBadCheckpoint);
        CHECK(std::string(e.what()).find("model.layers.9.mlp.gate.e_score_correction_bias") != std::string::npos);
      }
      continue;
    }
    merge_checkpoint(*group, MergeOptions{checkpoint, out, std::nullopt, 0});
    HfCheckpoint merged(out);
    const Tensor written = merged.read_as(name, DType::kF32);
    REQUIRE(written.numel() == bias.numel());
    CHECK(std::memcmp(written.data(), bias.data(), bias.nbytes()) == 0);
    const std::string other = "model.layers.2.mlp.gate.e_score_correction_bias";  // untrained: the base's
    const Tensor kept = merged.read_as(other, DType::kF32), original = base.read_as(other, DType::kF32);
    CHECK(std::memcmp(kept.data(), original.data(), original.nbytes()) == 0);
  }
}
