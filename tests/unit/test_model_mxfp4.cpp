// MXFP4 routed experts in the whole model (model.moe.expert_format: mxfp4): a tiny MoE model
// holding its experts packed equals the same model holding the decoded weights (loss and every
// adapter gradient, in F64), its adapter gradients match central differences, its random init is
// the BF16 init quantized, and it loads a checkpoint of packed experts under Kimi K3's names
// (block_sparse_moe.experts.<e>.w1 / w3 / w2.weight_packed and weight_scale) or of plain experts
// (quantized on load); a packed tensor of the wrong shape is a checkpoint error naming it, and a
// BF16 model given packed experts is told to set the format.
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"
#include "core/io/hf_index.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/ops.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// The tiny hybrid (MLA, KDA, MLA; MoE layers 1 and 2) at widths MXFP4 can pack: hidden 32 and
// experts of width 32.
Config mxfp4_config(const std::string& format) {
  Config c = tiny_model_config(/*q_lora=*/false);
  c.model.hidden_size = 32;
  c.model.moe.expert_intermediate_size = 32;
  c.model.moe.expert_format = format;
  return c;
}

ModelOptions options_f64() {
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{3, 6.0, false};
  options.lora_targets = {"experts", "shared_experts", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return options;
}

std::unique_ptr<Model> make_model(kernels::Backend& backend, const std::string& format) {
  auto model = std::make_unique<Model>(resolve_model_spec(mxfp4_config(format)), backend, options_f64());
  model->init_random_weights();
  // Non-zero B (and larger A) so that every adapter carries gradient to every input.
  uint64_t seed = 300;
  for (Parameter* p : model->parameters()) fill_random(p->value, seed++, 0.05, 0.3);
  return model;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The MXFP4 model's weights as an HF checkpoint: plain weights under their names, dense/shared
// SwiGLU stacks per projection, routed experts per expert under Kimi K3's names, packed
// (`packed_experts`) or decoded.
void write_checkpoint(const fs::path& dir, Model& model, bool packed_experts) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::vector<WeightSlot> slots = model.weight_slots();
  std::vector<Tensor> hold;  // the checkpoint's data, viewed by `named`: never reallocated
  hold.reserve(3 * slots.size());
  std::vector<NamedTensor> named;
  for (const WeightSlot& slot : slots) {
    if (slot.layout == WeightLayout::kPlain) {
      named.push_back({slot.name, hold.emplace_back(slot.tensor->shape(), DType::kF64).view()});
      std::memcpy(hold.back().data(), slot.tensor->data(), slot.tensor->nbytes());
      continue;
    }
    const bool routed = slot.name.find(".experts") != std::string::npos;
    const std::string moe = routed ? slot.name.substr(0, slot.name.find(".mlp.")) + ".block_sparse_moe.experts" : "";
    if (routed && packed_experts) {
      const Tensor& codes = *slot.tensor;
      const Tensor& scales = *slot.scale;
      const int64_t rows = codes.size(1);
      for (int64_t g = 0; g < codes.size(0); ++g) {
        const std::string e = moe + "." + std::to_string(g);
        const TensorView c = codes.view().slice_rows(g, g + 1).reshaped({rows, codes.size(2)});
        const TensorView s = scales.view().slice_rows(g, g + 1).reshaped({rows, scales.size(2)});
        if (slot.layout == WeightLayout::kSwigluDown) {
          named.push_back({e + ".w2.weight_packed", c});
          named.push_back({e + ".w2.weight_scale", s});
        } else {
          named.push_back({e + ".w1.weight_packed", c.slice_rows(0, rows / 2)});
          named.push_back({e + ".w3.weight_packed", c.slice_rows(rows / 2, rows)});
          named.push_back({e + ".w1.weight_scale", s.slice_rows(0, rows / 2)});
          named.push_back({e + ".w3.weight_scale", s.slice_rows(rows / 2, rows)});
        }
      }
      continue;
    }
    // Decoded routed experts, or a G = 1 SwiGLU stack.
    Shape shape = slot.tensor->shape();
    Tensor& t = hold.emplace_back(routed ? Shape{shape[0], shape[1], 2 * shape[2]} : shape, DType::kF64);
    if (routed) {
      kernels::cpu::mxfp4_dequantize(t.view(), *slot.tensor, *slot.scale);
    } else {
      std::memcpy(t.data(), slot.tensor->data(), t.nbytes());
    }
    const int64_t rows = t.size(1), cols = t.size(2);
    for (int64_t g = 0; g < t.size(0); ++g) {
      const std::string prefix = routed ? moe + "." + std::to_string(g) : slot.name;
      const TensorView group = t.view().slice_rows(g, g + 1).reshaped({rows, cols});
      if (slot.layout == WeightLayout::kSwigluDown) {
        named.push_back({prefix + (routed ? ".w2.weight" : ".down_proj.weight"), group});
      } else {
        named.push_back({prefix + (routed ? ".w1.weight" : ".gate_proj.weight"), group.slice_rows(0, rows / 2)});
        named.push_back({prefix + (routed ? ".w3.weight" : ".up_proj.weight"), group.slice_rows(rows / 2, rows)});
      }
    }
  }
  write_hf_checkpoint(dir.string(), named, HfShardedWriteParams{});
}

}  // namespace

TEST_CASE("mxfp4 experts: the model equals the one holding the decoded weights (loss, adapter gradients)",
          "[model][mxfp4]") {
  auto backend = kernels::make_cpu_backend();
  auto packed = make_model(*backend, "mxfp4");
  auto decoded = make_model(*backend, "bf16");
  // The same non-expert weights and adapters (same seeds); the routed experts replaced by the
  // packed model's, decoded.
  const std::vector<WeightSlot> packed_weights = packed->weight_slots(), decoded_weights = decoded->weight_slots();
  REQUIRE(packed_weights.size() == decoded_weights.size());
  int routed = 0;
  for (size_t i = 0; i < packed_weights.size(); ++i) {
    const WeightSlot& p = packed_weights[i];
    const WeightSlot& d = decoded_weights[i];
    REQUIRE(p.name == d.name);
    if (p.scale == nullptr) {
      CHECK(same_bytes(*p.tensor, *d.tensor));
      continue;
    }
    ++routed;
    CHECK(p.tensor->dtype() == DType::kU8);
    CHECK(p.tensor->shape() == Shape{d.tensor->size(0), d.tensor->size(1), d.tensor->size(2) / 2});
    CHECK(p.scale->shape() == Shape{d.tensor->size(0), d.tensor->size(1), d.tensor->size(2) / 32});
    kernels::cpu::mxfp4_dequantize(*d.tensor, *p.tensor, *p.scale);
  }
  CHECK(routed == 4);  // gate_up and down of MoE layers 1 and 2

  const Batch batch = tiny_batch(mxfp4_config("mxfp4").model.vocab_size, 5);
  const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  const StepResult a = packed->forward_backward(batch, grad_scale);
  const StepResult b = decoded->forward_backward(batch, grad_scale);
  CHECK(a.loss_sum == Approx(b.loss_sum).epsilon(1e-13));
  const std::vector<Parameter*> pa = packed->parameters(), pb = decoded->parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    const Comparison c = compare_tensors(pa[i]->grad, pb[i]->grad, 1e-11, 1e-14, pa[i]->name);
    INFO(c.message);
    CHECK(c.ok);
  }
}

TEST_CASE("mxfp4 experts: adapter gradients match central differences", "[model][mxfp4][gradcheck]") {
  auto backend = kernels::make_cpu_backend();
  auto model = make_model(*backend, "mxfp4");
  const Batch batch = tiny_batch(mxfp4_config("mxfp4").model.vocab_size, 5);
  const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  for (Parameter* p : model->parameters()) backend->fill(p->grad, 0.0);
  model->forward_backward(batch, grad_scale);
  // Every gradient copied before the differences run forward_backward again (it adds to them).
  std::vector<std::pair<Parameter*, Tensor>> analytic;
  for (Parameter* p : model->parameters()) {
    if (p->name.find(".experts.") == std::string::npos) continue;  // the routed experts' adapters
    Tensor g(p->grad.shape(), DType::kF64);
    backend->copy(g, p->grad);
    analytic.emplace_back(p, std::move(g));
  }
  REQUIRE(analytic.size() == 12);  // A and B of gate, up and down in MoE layers 1 and 2
  GradCheckOptions options;
  options.eps = 1e-6;
  options.rtol = 1e-5;
  options.atol = 1e-9;
  options.max_elements = 4;
  for (const auto& [p, grad] : analytic) {
    const Comparison c = check_gradient([&] { return model->forward_backward(batch, grad_scale).loss_sum * grad_scale; },
                                        p->value, grad, p->name, options);
    INFO(c.message);
    CHECK(c.ok);
  }
}

TEST_CASE("mxfp4 experts: the random init is the BF16 model's init, quantized", "[model][mxfp4]") {
  auto backend = kernels::make_cpu_backend();
  auto packed = make_model(*backend, "mxfp4");
  auto plain = make_model(*backend, "bf16");  // F64 weights: the generator's values unrounded
  const std::vector<WeightSlot> ps = packed->weight_slots(), ds = plain->weight_slots();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].scale == nullptr) continue;
    const Tensor& values = *ds[i].tensor;
    Tensor codes(ps[i].tensor->shape(), DType::kU8), scales(ps[i].scale->shape(), DType::kU8);
    kernels::cpu::mxfp4_quantize(static_cast<uint8_t*>(codes.data()), static_cast<uint8_t*>(scales.data()),
                                 values.ptr<double>(), values.size(0) * values.size(1), values.size(2));
    INFO(ps[i].name);
    CHECK(same_bytes(codes, *ps[i].tensor));
    CHECK(same_bytes(scales, *ps[i].scale));
  }
}

TEST_CASE("mxfp4 experts: checkpoints of packed (K3 names) or plain experts load", "[model][mxfp4][import]") {
  auto backend = kernels::make_cpu_backend();
  auto written = make_model(*backend, "mxfp4");
  const Batch batch = tiny_batch(mxfp4_config("mxfp4").model.vocab_size, 7);
  const Tensor expected = written->logits(batch);
  const fs::path dir = fs::temp_directory_path() / "moetrain_mxfp4_import";
  for (bool packed_experts : {true, false}) {
    INFO((packed_experts ? "packed experts" : "plain experts, quantized on load"));
    write_checkpoint(dir, *written, packed_experts);
    const HfCheckpoint checkpoint(dir.string());
    CHECK(checkpoint.has("model.layers.1.block_sparse_moe.experts.5.w3.weight_packed") == packed_experts);
    Model loaded(resolve_model_spec(mxfp4_config("mxfp4")), *backend, options_f64());
    loaded.load_weights(checkpoint);
    for (size_t i = 0; i < loaded.parameters().size(); ++i)  // the adapters too (B is not zero)
      backend->copy(loaded.parameters()[i]->value, written->parameters()[i]->value);
    if (packed_experts) {  // the bytes as stored
      const std::vector<WeightSlot> a = written->weight_slots(), b = loaded.weight_slots();
      for (size_t i = 0; i < a.size(); ++i) {
        if (a[i].scale == nullptr) continue;
        CHECK(same_bytes(*a[i].tensor, *b[i].tensor));
        CHECK(same_bytes(*a[i].scale, *b[i].scale));
      }
    }
    // Decoded values quantize back to the same values (the scales may differ): the same logits.
    const Comparison logits = compare_tensors(loaded.logits(batch), expected, 0.0, 0.0, "logits");
    INFO(logits.message);
    CHECK(logits.ok);
  }
  // A packed tensor of the wrong shape names itself.
  write_checkpoint(dir, *written, true);
  {
    const std::string bad = "model.layers.2.block_sparse_moe.experts.3.w2.weight_scale";
    std::vector<NamedTensor> named;
    const HfCheckpoint good(dir.string());
    std::vector<Tensor> hold;
    hold.reserve(good.names().size());
    for (const std::string& name : good.names()) {
      const SafetensorsTensorInfo& info = good.info(name);
      Shape shape = info.shape;
      if (name == bad) shape[1] += 1;
      Tensor& t = hold.emplace_back(shape, info.dtype);
      std::memset(t.data(), 0, t.nbytes());
      if (name != bad) good.read_rows(t.data(), name, 0, shape[0]);
      named.push_back({name, t.view()});
    }
    fs::remove_all(dir);
    write_hf_checkpoint(dir.string(), named, HfShardedWriteParams{});
  }
  Model loaded(resolve_model_spec(mxfp4_config("mxfp4")), *backend, options_f64());
  const std::string message = error_message([&] { loaded.load_weights(HfCheckpoint(dir.string())); });
  INFO(message);
  CHECK(message.find("experts.3.w2.weight_scale") != std::string::npos);
  CHECK(message.find("U8 [32, 1]") != std::string::npos);
  // A BF16 model pointed at packed experts is told to set the format.
  write_checkpoint(dir, *written, true);
  Model plain(resolve_model_spec(mxfp4_config("bf16")), *backend, options_f64());
  const std::string format_message = error_message([&] { plain.load_weights(HfCheckpoint(dir.string())); });
  INFO(format_message);
  CHECK(format_message.find("model.moe.expert_format: mxfp4") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("mxfp4 experts: config errors name the key", "[model][mxfp4][config]") {
  Config c = mxfp4_config("mxfp4");
  c.model.moe.expert_format = "fp4";
  CHECK(error_message([&] { resolve_model_spec(c); }).find("model.moe.expert_format") != std::string::npos);
  c = mxfp4_config("mxfp4");
  c.model.moe.expert_intermediate_size = 24;
  const std::string message = error_message([&] { resolve_model_spec(c); });
  INFO(message);
  CHECK(message.find("model.moe.expert_intermediate_size") != std::string::npos);
  CHECK(message.find("multiple of 32") != std::string::npos);
}
