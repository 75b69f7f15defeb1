// Importing FP8 block-scaled checkpoints as DeepSeek-V3 and Kimi K2 ship them (core/io/fp8_block.h):
// a tiny DeepSeek-V3 whose linears are quantized here (codes from a table built from the e4m3fn
// definition, one F32 scale per 128 x 128 block; the dense MLP is 136 x 72, so its row blocks are
// 128 + 8 and its column block partial) loads to exactly the hand-dequantized weights; row slices
// equal slices of the whole and read only their blocks; each malformed checkpoint is exit 4
// naming the tensor or the config key. With model.weight_format: fp8 (widths multiples of 128) the
// weights keep the checkpoint's own codes and scales, a BF16 checkpoint is quantized per block as
// the releases quantize, and E5M2 or malformed files are refused naming the tensor.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.h"
#include "core/io/hf_index.h"
#include "core/model/model.h"
#include "kernels/fp8_format.h"
#include "expected_error.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "op_test_helpers.h"
#include "scratch_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

const char* kConfig = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 64, "hidden_size": 72, "intermediate_size": 136, "moe_intermediate_size": 16,
  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
  "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
  "norm_topk_prob": true, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
  "rms_norm_eps": 1e-06, "max_position_embeddings": 32, "tie_word_embeddings": false, "hidden_act": "silu",
  "rope_theta": 10000.0,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}
})";

const std::string kDense = "model.layers.0.mlp.gate_proj.weight";  // [136, 72]

std::string with(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  REQUIRE(at != std::string::npos);
  return json.replace(at, from.size(), to);
}

// The finite e4m3fn values by the format's definition: code -> (-1)^S 2^(E-7) (1 + M/8), or
// 2^-6 M/8 for E = 0; S.1111.111 (NaN) has none.
std::vector<double> e4m3_values() {
  std::vector<double> values(256, NAN);
  for (int code = 0; code < 256; ++code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) continue;
    const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    values[code] = code & 0x80 ? -magnitude : magnitude;
  }
  return values;
}

// A linear's weight quantized as the releases do: per 128 x 128 block, scale = amax / 448 (F32)
// and each value the nearest code of value / scale.
struct Quantized {
  Tensor codes, scales;
};

Quantized quantize(const TensorView& w) {
  static const std::vector<double> table = e4m3_values();
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const int64_t block_rows = (rows + 127) / 128, block_cols = (cols + 127) / 128;
  Quantized q{Tensor({rows, cols}, DType::kU8), Tensor({block_rows, block_cols}, DType::kF32)};
  const double* v = w.ptr<double>();
  for (int64_t br = 0; br < block_rows; ++br) {
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      double amax = 0;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) amax = std::max(amax, std::fabs(v[r * cols + c]));
      const float scale = amax > 0 ? static_cast<float>(amax / 448.0) : 1.0f;
      q.scales.ptr<float>()[br * block_cols + bc] = scale;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          const double x = v[r * cols + c] / scale;
          int best = 0;
          for (int code = 1; code < 256; ++code)
            if (!std::isnan(table[code]) && std::fabs(table[code] - x) < std::fabs(table[best] - x)) best = code;
          static_cast<uint8_t*>(q.codes.data())[r * cols + c] = static_cast<uint8_t>(best);
        }
      }
    }
  }
  return q;
}

// Writes value = table[code] * scale into w: what a correct import must produce, exactly.
void dequantize_into(const TensorView& w, const Quantized& q) {
  static const std::vector<double> table = e4m3_values();
  const int64_t rows = w.shape[0], cols = w.shape[1], block_cols = q.scales.size(1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      w.ptr<double>()[r * cols + c] = table[static_cast<const uint8_t*>(q.codes.data())[r * cols + c]] *
                                      static_cast<double>(q.scales.ptr<float>()[(r / 128) * block_cols + c / 128]);
}

// Rewrites the dtype of `names` in a safetensors file (written as U8) to `dtype`: safetensors'
// offsets are relative to the data section, so only the header changes.
void retag(const std::string& path, const std::vector<std::string>& names, const std::string& dtype) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(header_bytes));
  for (const std::string& name : names) header[name]["dtype"] = dtype;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t new_bytes = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&new_bytes), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.write(bytes.data() + 8 + header_bytes, static_cast<std::streamsize>(bytes.size() - 8 - header_bytes));
}

bool quantized_in_release(const std::string& name) {
  auto ends = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends("_proj.weight") || ends("_proj_with_mqa.weight");
}

ModelSpec spec_of(const fs::path& dir) {
  Config config;
  config.model.hf_dir = dir.string();
  config.data.seq_len = 8;
  return resolve_model_spec(config);
}

ModelOptions f64_options() {
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora_targets = {"o_proj"};
  return options;
}

// A random tiny DeepSeek-V3, its checkpoint pieces and what loading them must give.
struct Fp8Checkpoint {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::vector<Tensor> expected;           // per weight slot, in weight_slots() order
  std::vector<NamedTensor> pieces;        // views into `expected`, under the checkpoint's names
  std::map<std::string, Quantized> fp8;   // the quantized pieces

  // `unquantized`: a module name part whose weights stay unquantized (modules_to_not_convert).
  explicit Fp8Checkpoint(const fs::path& model_dir, const std::string& unquantized = "",
                         const std::string& config = kConfig) {
    fs::create_directories(model_dir);
    std::ofstream(model_dir / "config.json") << config;
    Model written(spec_of(model_dir), *backend, f64_options());
    written.init_random_weights();
    std::vector<WeightSlot> slots = written.weight_slots();
    expected.reserve(slots.size());
    for (const WeightSlot& slot : slots) {
      Tensor& t = expected.emplace_back(slot.tensor->shape(), DType::kF64);
      backend->copy(t, *slot.tensor);
      if (slot.layout == WeightLayout::kPlain) {
        pieces.push_back({slot.name, t.view()});
        continue;
      }
      const int64_t groups = t.size(0), rows = t.size(1), cols = t.size(2);
      for (int64_t g = 0; g < groups; ++g) {
        const std::string prefix =
            slot.name.find(".experts") != std::string::npos ? slot.name + "." + std::to_string(g) : slot.name;
        TensorView group = t.view().slice_rows(g, g + 1).reshaped({rows, cols});
        if (slot.layout == WeightLayout::kSwigluDown) {
          pieces.push_back({prefix + ".down_proj.weight", group});
        } else {
          pieces.push_back({prefix + ".gate_proj.weight", group.slice_rows(0, rows / 2)});
          pieces.push_back({prefix + ".up_proj.weight", group.slice_rows(rows / 2, rows)});
        }
      }
    }
    for (const NamedTensor& piece : pieces) {
      if (!quantized_in_release(piece.name)) continue;
      if (!unquantized.empty() && piece.name.find(unquantized) != std::string::npos) continue;
      Quantized q = quantize(piece.tensor);
      dequantize_into(piece.tensor, q);
      fp8.emplace(piece.name, std::move(q));
    }
  }

  // Writes `dir` (config.json: `config`): quantized pieces as F8_E4M3 codes + weight_scale_inv,
  // the rest F64. `edit` may rename or drop (false) each tensor about to be written.
  void write(const fs::path& dir, const std::string& config,
             const std::function<bool(std::string& name, TensorView& tensor)>& edit = nullptr) const {
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << config;
    std::vector<NamedTensor> named;
    std::vector<std::string> codes;
    auto add = [&](std::string name, TensorView tensor, bool is_codes) {
      if (edit && !edit(name, tensor)) return;
      if (is_codes && tensor.dtype == DType::kU8) codes.push_back(name);
      named.push_back({name, tensor});
    };
    for (const NamedTensor& piece : pieces) {
      auto q = fp8.find(piece.name);
      if (q == fp8.end()) {
        add(piece.name, piece.tensor, false);
        continue;
      }
      add(piece.name, q->second.codes.view(), true);
      add(piece.name + "_scale_inv", q->second.scales.view(), false);
    }
    write_hf_checkpoint(dir.string(), named, HfShardedWriteParams{});
    retag((dir / HfCheckpoint::kSingleFileName).string(), codes, "F8_E4M3");
  }

  // Loads `dir` into a fresh model and checks every weight equals `expected` exactly.
  void check_load(const fs::path& dir) const {
    Model loaded(spec_of(dir), *backend, f64_options());
    loaded.load_weights(HfCheckpoint(dir.string()));
    std::vector<WeightSlot> slots = loaded.weight_slots();
    REQUIRE(slots.size() == expected.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      Tensor got(slots[i].tensor->shape(), DType::kF64);
      backend->copy(got, *slots[i].tensor);
      check(compare_tensors(got.view(), expected[i].view(), 0.0, 0.0, slots[i].name));
    }
  }
};

Error load_error(const fs::path& dir, const std::string& weight_format = "bf16") {
  try {
    auto backend = kernels::make_cpu_backend();
    ModelSpec spec = spec_of(dir);
    spec.config.weight_format = weight_format;
    Model model(spec, *backend, f64_options());
    model.load_weights(HfCheckpoint(dir.string()));
  } catch (const Error& e) {
    return e;
  }
  return Error(ExitCode::kOk, "");
}

}  // namespace

TEST_CASE("an FP8 block-scaled DeepSeek-V3 checkpoint loads to its dequantized weights", "[import][fp8]") {
  ScratchDir scratch("fp8_import");
  Fp8Checkpoint checkpoint(scratch.path / "written");
  REQUIRE(checkpoint.fp8.count(kDense) == 1);
  REQUIRE(checkpoint.fp8.at(kDense).scales.shape() == Shape{2, 1});  // rows 128 + 8, columns 72 of 128
  REQUIRE(checkpoint.fp8.count("model.layers.1.mlp.experts.3.down_proj.weight") == 1);
  const fs::path dir = scratch.path / "fp8";
  checkpoint.write(dir, kConfig);
  checkpoint.check_load(dir);

  SECTION("kimi_k2 is DeepSeek-V3's architecture under Moonshot's model_type") {
    const fs::path kimi = scratch.path / "kimi_k2";
    checkpoint.write(kimi, with(kConfig, R"("model_type": "deepseek_v3")", R"("model_type": "kimi_k2")"));
    CHECK(spec_of(kimi).config.model_type == "kimi_k2");
    checkpoint.check_load(kimi);
  }
}

TEST_CASE("modules_to_not_convert: the modules it lists load unquantized, the others dequantized", "[import][fp8]") {
  ScratchDir scratch("fp8_skip");
  Fp8Checkpoint checkpoint(scratch.path / "written", ".self_attn.o_proj.");
  CHECK(checkpoint.fp8.count("model.layers.0.self_attn.o_proj.weight") == 0);
  CHECK(checkpoint.fp8.count(kDense) == 1);
  const fs::path dir = scratch.path / "skip";
  checkpoint.write(dir, with(kConfig, R"("activation_scheme")",
                             R"("modules_to_not_convert": ["lm_head", "self_attn.o_proj"], "activation_scheme")"));
  checkpoint.check_load(dir);
}

TEST_CASE("a row slice of an FP8 weight equals the rows of the whole and reads only its blocks", "[import][fp8]") {
  ScratchDir scratch("fp8_slices");
  Fp8Checkpoint checkpoint(scratch.path / "written");
  const fs::path dir = scratch.path / "fp8";
  checkpoint.write(dir, kConfig);
  const HfCheckpoint hf(dir.string());
  const Tensor whole = hf.read_as(kDense, DType::kF64);
  REQUIRE(whole.shape() == Shape{136, 72});
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 136}, {0, 5}, {120, 130}, {127, 128}, {128, 136}, {68, 68}}) {
    const HfCheckpoint fresh(dir.string());
    const Tensor rows = fresh.read_rows_as(kDense, begin, end, DType::kF64);
    INFO("rows [" << begin << ", " << end << ")");
    check(compare_tensors(rows.view(), whole.view().slice_rows(begin, end), 0.0, 0.0, kDense));
    const int64_t blocks = end > begin ? (end - 1) / 128 - begin / 128 + 1 : 0;
    CHECK(fresh.bytes_read() == static_cast<uint64_t>((end - begin) * 72 + blocks * 4));
  }
  // F32 storage: the exact product rounded once.
  const Tensor f32 = hf.read_rows_as(kDense, 130, 131, DType::kF32);
  for (int64_t c = 0; c < 72; ++c) CHECK(f32.ptr<float>()[c] == static_cast<float>(whole.ptr<double>()[130 * 72 + c]));
  CHECK(contains(expected_error(ExitCode::kBadCheckpoint, [&] { hf.read_rows_as(kDense, 100, 137, DType::kF64); }),
                 "cannot read rows [100, 137) of tensor '" + kDense + "'"));
}

TEST_CASE("malformed FP8 checkpoints are exit 4 naming the tensor or the config key", "[import][fp8]") {
  ScratchDir scratch("fp8_errors");
  Fp8Checkpoint checkpoint(scratch.path / "written");
  const std::string scale = kDense + "_scale_inv";
  auto error_of = [&](const std::string& tag, const std::string& config,
                      const std::function<bool(std::string&, TensorView&)>& edit) {
    const fs::path dir = scratch.path / tag;
    checkpoint.write(dir, config, edit);
    Error e = load_error(dir);
    INFO(e.what());
    CHECK(e.code() == ExitCode::kBadCheckpoint);
    return std::string(e.what());
  };
  auto keep = [](std::string&, TensorView&) { return true; };

  std::string message = error_of("no_scale", kConfig, [&](std::string& name, TensorView&) { return name != scale; });
  CHECK(contains(message, "tensor '" + kDense + "'"));
  CHECK(contains(message, "no block scales '" + scale + "'"));

  message = error_of("scale_shape", kConfig, [&](std::string& name, TensorView& t) {
    if (name == scale) t = t.slice_rows(0, 1);
    return true;
  });
  CHECK(contains(message, "block scales '" + scale + "'"));
  CHECK(contains(message, "F32 [1, 1]"));
  CHECK(contains(message, "needs F32 [2, 1]"));

  message = error_of("block_size", with(kConfig, "[128, 128]", "[64, 64]"), keep);
  CHECK(contains(message, "quantization_config.weight_block_size is [64,64]"));
  CHECK(contains(message, "[128, 128]"));

  message = error_of("fmt", with(kConfig, R"("fmt": "e4m3")", R"("fmt": "e3m4")"), keep);
  CHECK(contains(message, "quantization_config.fmt is \"e3m4\""));
  CHECK(contains(message, "\"e4m3\" or \"e5m2\""));

  message = error_of("fmt_mismatch", with(kConfig, R"("fmt": "e4m3")", R"("fmt": "e5m2")"), keep);
  CHECK(contains(message, "(F8_E4M3)"));
  CHECK(contains(message, "quantization_config.fmt is \"e5m2\""));

  message = error_of("method", with(kConfig, R"("quant_method": "fp8")", R"("quant_method": "awq")"), keep);
  CHECK(contains(message, "quantization_config.quant_method is \"awq\""));

  message = error_of("no_method", with(kConfig, R"("quant_method": "fp8", )", ""), keep);
  CHECK(contains(message, "quantization_config.quant_method is missing"));

  nlohmann::json undeclared = nlohmann::json::parse(kConfig);
  undeclared.erase("quantization_config");
  message = error_of("undeclared", undeclared.dump(), keep);
  CHECK(contains(message, "tensor '"));
  CHECK(contains(message, "has no quantization_config with quant_method \"fp8\""));

  message = error_of("not_converted", with(kConfig, R"("activation_scheme")",
                                           R"("modules_to_not_convert": ["self_attn.o_proj"], "activation_scheme")"),
                     keep);
  CHECK(contains(message, "tensor 'model.layers.0.self_attn.o_proj.weight'"));
  CHECK(contains(message, "modules_to_not_convert"));

  // A weight stored unquantized with a scale beside it: half converted.
  const Tensor plain = Tensor({136, 72}, DType::kF32);
  std::memset(plain.data(), 0, plain.nbytes());
  message = error_of("plain_with_scale", kConfig, [&](std::string& name, TensorView& t) {
    if (name == kDense) t = plain.view();
    return true;
  });
  CHECK(contains(message, "tensor '" + kDense + "'"));
  CHECK(contains(message, "is F32 but has FP8 block scales '" + scale + "'"));
}

namespace {

// kConfig with the MLP widths FP8 storage stacks in whole 128-row blocks (hidden 72 keeps the
// column blocks partial).
std::string storage_config() {
  return with(with(kConfig, R"("intermediate_size": 136)", R"("intermediate_size": 256)"),
              R"("moe_intermediate_size": 16)", R"("moe_intermediate_size": 128)");
}

// The model of `dir` with weight_format fp8, loaded.
std::unique_ptr<Model> load_fp8_model(const fs::path& dir, kernels::Backend& backend) {
  ModelSpec spec = spec_of(dir);
  spec.config.weight_format = "fp8";
  auto model = std::make_unique<Model>(spec, backend, f64_options());
  model->load_weights(HfCheckpoint(dir.string()));
  return model;
}

// The host bytes of a (host) tensor.
std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

}  // namespace

TEST_CASE("weight_format fp8 keeps an FP8 checkpoint's codes and scales", "[import][fp8]") {
  ScratchDir scratch("fp8_storage");
  Fp8Checkpoint checkpoint(scratch.path / "written", "", storage_config());
  const fs::path dir = scratch.path / "fp8";
  checkpoint.write(dir, storage_config());
  auto model = load_fp8_model(dir, *checkpoint.backend);
  std::vector<WeightSlot> slots = model->weight_slots();
  REQUIRE(slots.size() == checkpoint.expected.size());
  int64_t fp8_slots = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const WeightSlot& slot = slots[i];
    INFO(slot.name);
    // Quantized in the release <=> FP8 in the model: projections and every SwiGLU weight.
    const bool swiglu = slot.layout != WeightLayout::kPlain;
    CHECK(slot.fp8() == (swiglu || quantized_in_release(slot.name)));
    if (!slot.fp8()) continue;
    ++fp8_slots;
    const int64_t rows = slot.tensor->size(-2), cols = slot.tensor->size(-1);
    const int64_t matrices = slot.tensor->numel() / (rows * cols);
    const int64_t per_scale = slot.scale->numel() / matrices;
    std::vector<double> values(static_cast<size_t>(slot.tensor->numel()));
    for (int64_t g = 0; g < matrices; ++g) {
      kernels::fp8_block_dequantize(values.data() + g * rows * cols,
                                    static_cast<const uint8_t*>(slot.tensor->data()) + g * rows * cols,
                                    slot.scale->ptr<float>() + g * per_scale, rows, cols);
    }
    const Tensor& expected = checkpoint.expected[i];
    int64_t differ = 0;
    for (int64_t e = 0; e < expected.numel(); ++e) differ += values[e] != expected.ptr<double>()[e];
    CHECK(differ == 0);
  }
  CHECK(fp8_slots > 0);
  // The dense MLP's gate rows are the checkpoint's own codes, its first scale rows its own scales.
  const auto dense = std::find_if(slots.begin(), slots.end(), [](const WeightSlot& s) {
    return s.name == "model.layers.0.mlp" && s.layout == WeightLayout::kSwigluGateUp;
  });
  REQUIRE(dense != slots.end());
  const Quantized& gate = checkpoint.fp8.at(kDense);
  std::vector<uint8_t> codes = bytes_of(*dense->tensor);
  codes.resize(gate.codes.nbytes());
  CHECK(codes == bytes_of(gate.codes));
  CHECK(dense->scale->ptr<float>()[0] == gate.scales.ptr<float>()[0]);
  CHECK(dense->scale->ptr<float>()[1] == gate.scales.ptr<float>()[1]);
}

TEST_CASE("weight_format fp8 quantizes a BF16 checkpoint per 128 x 128 block as the releases do", "[import][fp8]") {
  ScratchDir scratch("fp8_quantize");
  Fp8Checkpoint checkpoint(scratch.path / "written", "_proj", storage_config());  // nothing quantized
  REQUIRE(checkpoint.fp8.empty());
  const fs::path dir = scratch.path / "plain";
  checkpoint.write(dir, storage_config());
  auto model = load_fp8_model(dir, *checkpoint.backend);
  const std::string q_b = "model.layers.1.self_attn.q_b_proj.weight";
  for (const WeightSlot& slot : model->weight_slots()) {
    if (slot.name != q_b) continue;
    REQUIRE(slot.fp8());
    const auto piece = std::find_if(checkpoint.pieces.begin(), checkpoint.pieces.end(),
                                    [&](const NamedTensor& p) { return p.name == q_b; });
    REQUIRE(piece != checkpoint.pieces.end());
    const Quantized reference = quantize(piece->tensor);  // the brute-force nearest code above
    CHECK(bytes_of(*slot.tensor) == bytes_of(reference.codes));
    CHECK(slot.scale->ptr<float>()[0] == reference.scales.ptr<float>()[0]);
    return;
  }
  FAIL("no slot " << q_b);
}

TEST_CASE("weight_format fp8 refuses E5M2 codes and malformed FP8 tensors, naming them", "[import][fp8]") {
  ScratchDir scratch("fp8_storage_errors");
  Fp8Checkpoint checkpoint(scratch.path / "written", "", storage_config());
  const std::string scale = kDense + "_scale_inv";
  const fs::path no_scale = scratch.path / "no_scale";
  checkpoint.write(no_scale, storage_config(), [&](std::string& name, TensorView&) { return name != scale; });
  Error e = load_error(no_scale, "fp8");
  CHECK(e.code() == ExitCode::kBadCheckpoint);
  CHECK(contains(e.what(), "no block scales '" + scale + "'"));

  const fs::path scale_shape = scratch.path / "scale_shape";
  checkpoint.write(scale_shape, storage_config(), [&](std::string& name, TensorView& t) {
    if (name == scale) t = t.slice_rows(0, 1);
    return true;
  });
  e = load_error(scale_shape, "fp8");
  CHECK(e.code() == ExitCode::kBadCheckpoint);
  CHECK(contains(e.what(), "block scales '" + scale + "'"));

  const fs::path nan_code = scratch.path / "nan_code";
  const Tensor& gate_codes = checkpoint.fp8.at(kDense).codes;
  Tensor poisoned(gate_codes.shape(), DType::kU8);
  std::memcpy(poisoned.data(), gate_codes.data(), gate_codes.nbytes());
  static_cast<uint8_t*>(poisoned.data())[5] = 0x7F;
  checkpoint.write(nan_code, storage_config(), [&](std::string& name, TensorView& t) {
    if (name == kDense) t = poisoned.view();
    return true;
  });
  e = load_error(nan_code, "fp8");
  CHECK(e.code() == ExitCode::kBadCheckpoint);
  CHECK(contains(e.what(), "\"" + kDense + "\""));
  CHECK(contains(e.what(), "NaN code"));

  const fs::path e5m2 = scratch.path / "e5m2";
  checkpoint.write(e5m2, with(storage_config(), R"("fmt": "e4m3")", R"("fmt": "e5m2")"));
  std::vector<std::string> codes;
  for (const auto& [name, q] : checkpoint.fp8) codes.push_back(name);
  retag((e5m2 / HfCheckpoint::kSingleFileName).string(), codes, "F8_E5M2");
  e = load_error(e5m2, "fp8");
  CHECK(e.code() == ExitCode::kBadConfig);
  CHECK(contains(e.what(), "F8_E5M2"));
  CHECK(contains(e.what(), "model.weight_format: bf16"));
}
