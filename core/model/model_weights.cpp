// Base weights for Model: loading a Hugging Face directory by tensor name, or a seeded random
// initialisation for runs without a checkpoint.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/base/host_convert.h"
#include "core/io/hf_index.h"
#include "core/model/model.h"

namespace moetrain {
namespace {

bool is_norm_weight(const std::string& name) { return name.find("norm.weight") != std::string::npos; }
bool is_bias(const std::string& name) { return name.find("e_score_correction_bias") != std::string::npos; }

void upload_weight(kernels::Backend& backend, Tensor& dst, const TensorView& host_f64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged, host_f64);
  backend.copy(dst, staged);
}

// Reads `name` (shape must be `expected`) as F64 into `dst` starting at element `offset`.
void read_into(const HfCheckpoint& checkpoint, const std::string& name, const Shape& expected, double* dst) {
  MOETRAIN_CHECK(checkpoint.has(name), ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" is missing; the directory does not match its config.json (or the "
                             "model type is not the one it was saved as)",
                             checkpoint.dir(), name));
  const SafetensorsTensorInfo& info = checkpoint.info(name);
  MOETRAIN_CHECK(info.shape == expected, ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" in {} has shape {} but config.json implies {}", checkpoint.dir(), name,
                             checkpoint.file_of(name), info.shape.str(), expected.str()));
  Tensor values = checkpoint.read_as(name, DType::kF64);
  std::memcpy(dst, values.data(), values.nbytes());
}

// gate_up [G, 2F, D] from per-module gate_proj/up_proj, per-expert modules, or the fused
// 3-D `gate_up_proj` of transformers 5; down [G, D, F] likewise.
void read_swiglu(const HfCheckpoint& checkpoint, const WeightSlot& slot, double* dst) {
  const Shape& shape = slot.tensor->shape();
  const int64_t groups = shape[0];
  const bool gate_up = slot.layout == WeightLayout::kSwigluGateUp;
  const bool routed = slot.name.size() >= 8 && slot.name.compare(slot.name.size() - 8, 8, ".experts") == 0;
  const std::string fused = slot.name + (gate_up ? ".gate_up_proj" : ".down_proj");
  if (routed && checkpoint.has(fused)) {
    read_into(checkpoint, fused, shape, dst);
    return;
  }
  const int64_t per_group = shape.numel() / groups;
  for (int64_t g = 0; g < groups; ++g) {
    std::string module = routed ? slot.name + "." + std::to_string(g) : slot.name;
    double* group = dst + g * per_group;
    if (gate_up) {
      const int64_t half = shape[1] / 2;
      read_into(checkpoint, module + ".gate_proj.weight", Shape{half, shape[2]}, group);
      read_into(checkpoint, module + ".up_proj.weight", Shape{half, shape[2]}, group + half * shape[2]);
    } else {
      read_into(checkpoint, module + ".down_proj.weight", Shape{shape[1], shape[2]}, group);
    }
  }
}

}  // namespace

void Model::load_weights(const HfCheckpoint& checkpoint) {
  for (const WeightSlot& slot : weight_slots()) {
    Tensor host(slot.tensor->shape(), DType::kF64);
    if (slot.layout == WeightLayout::kPlain) {
      read_into(checkpoint, slot.name, slot.tensor->shape(), host.ptr<double>());
    } else {
      read_swiglu(checkpoint, slot, host.ptr<double>());
    }
    upload_weight(backend_, *slot.tensor, host);
  }
}

void Model::init_random_weights() {
  for (const WeightSlot& slot : weight_slots()) {
    Tensor host(slot.tensor->shape(), DType::kF64);
    double* values = host.ptr<double>();
    const int64_t n = host.numel();
    if (is_norm_weight(slot.name)) {
      for (int64_t i = 0; i < n; ++i) values[i] = 1.0;
    } else if (is_bias(slot.name)) {
      for (int64_t i = 0; i < n; ++i) values[i] = 0.0;
    } else {
      // N(0, 1/fan_in) (embeddings N(0, 1)), so every projection keeps activations at unit
      // scale and the frozen head can express confident predictions once the adapters learn;
      // 0.02 (a pretraining init) leaves logits too small for LoRA to ever reach a low loss.
      // Box-Muller on a generator seeded per tensor name: a tensor's values do not depend on
      // which other tensors exist or on the standard library.
      uint64_t hash = 1469598103934665603ull;
      for (char c : slot.name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
      std::mt19937_64 rng(options_.seed ^ hash ^ static_cast<uint64_t>(slot.layout));
      auto unit = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
      const bool embedding = slot.name == "model.embed_tokens.weight";
      const Shape& shape = slot.tensor->shape();
      const double stddev = embedding ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape[shape.ndim() - 1]));
      for (int64_t i = 0; i < n; i += 2) {
        double radius = stddev * std::sqrt(-2.0 * std::log(unit()));
        double angle = 6.283185307179586 * unit();
        values[i] = radius * std::cos(angle);
        if (i + 1 < n) values[i + 1] = radius * std::sin(angle);
      }
    }
    upload_weight(backend_, *slot.tensor, host);
  }
}

}  // namespace moetrain
