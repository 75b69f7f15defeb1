// Base weights for Model: loading a Hugging Face directory by tensor name, or a seeded random
// initialisation for runs without a checkpoint.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <thread>
#include <vector>

#include "core/base/bf16.h"
#include "core/base/random.h"

#include "core/base/host_convert.h"
#include "core/base/log.h"
#include "core/io/hf_index.h"
#include "core/model/fp8_weights_load.h"
#include "core/model/fsdp_bucket.h"
#include "kernels/mxfp4_format.h"
#include "core/model/hf_names.h"
#include "core/model/model.h"
#include "parallel/watchdog.h"

namespace moetrain {
namespace {

// Norms, the vision tower's norm0 / norm1 among them (names that do not end in "norm").
bool is_norm_weight(const std::string& name) {
  return name.find("norm.weight") != std::string::npos || name.find(".norm0.weight") != std::string::npos ||
         name.find(".norm1.weight") != std::string::npos;
}
bool is_bias(const std::string& name) { return name.find("e_score_correction_bias") != std::string::npos; }
// Zero at random initialisation: the router's score bias and LayerNorm biases (DSA's k_norm).
bool is_zero_init(const std::string& name) { return is_bias(name) || name.find("norm.bias") != std::string::npos; }
bool is_routed_experts(const WeightSlot& slot) {
  const std::string& n = slot.name;
  return slot.layout != WeightLayout::kPlain && n.size() >= 8 && n.compare(n.size() - 8, 8, ".experts") == 0;
}

uint64_t name_hash(const std::string& name) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return hash;
}

// A constant, or uniform values with the given standard deviation (uniform rather than normal:
// cheap enough to fill a hundred-gigabyte model on the host in seconds).
struct RandomFill {
  double constant = 0.0;
  double stddev = 0.0;  // > 0: random
  uint64_t seed = 0;
  uint64_t first_element = 0;  // the tensor is a slice starting here (a rank's experts)
};

// The uniform distribution's half width for a standard deviation.
double uniform_half_width(double stddev) { return stddev * std::sqrt(3.0); }

void fill_random(const Tensor& host, const RandomFill& fill) {
  const int64_t n = host.numel();
  const double half_width = uniform_half_width(fill.stddev);
  auto fill_range = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double v = fill.constant;
      if (fill.stddev > 0) v = uniform_weight(fill.seed + fill.first_element + static_cast<uint64_t>(i), half_width);
      switch (host.dtype()) {
        case DType::kF64: host.ptr<double>()[i] = v; break;
        case DType::kF32: host.ptr<float>()[i] = static_cast<float>(v); break;
        case DType::kBF16: host.view().ptr_u16()[i] = float_to_bf16(static_cast<float>(v)); break;
        default: MOETRAIN_ASSERT(false, std::string("random weights of dtype ") + dtype_name(host.dtype()));
      }
    }
  };
  const int64_t threads = std::clamp<int64_t>(n / (1 << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> workers;
  for (int64_t t = 0; t < threads; ++t) workers.emplace_back(fill_range, n * t / threads, n * (t + 1) / threads);
  for (std::thread& w : workers) w.join();
}

void upload_weight(kernels::Backend& backend, Tensor& dst, const TensorView& host_f64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged, host_f64);
  backend.copy(dst, staged);
}

// Our own layout of a weight, in checkpoint tensors: the tensor itself, or for a SwiGLU block
// (G = 1: the dense MLP, the shared experts) gate_proj over up_proj (gate_up [1, 2F, D]) or down_proj.
HfLayout our_layout(const WeightSlot& slot) {
  const Shape& shape = slot.tensor->shape();
  if (slot.layout == WeightLayout::kPlain) return {hf_piece(slot.name, shape)};
  MOETRAIN_ASSERT(shape[0] == 1, slot.name + ": only single-group SwiGLU weights are read as plain pieces");
  if (slot.layout == WeightLayout::kSwigluDown) return {hf_piece(slot.name + ".down_proj.weight", {shape[1], shape[2]})};
  const int64_t half = shape[1] / 2;
  return {hf_piece(slot.name + ".gate_proj.weight", {half, shape[2]}),
          hf_piece(slot.name + ".up_proj.weight", {half, shape[2]}, half * shape[2])};
}

// The first of the weight's possible layouts (hf_names.h) whose tensors the checkpoint has; when
// none is complete, our own, so that reading it names the missing tensor.
HfLayout find_layout(const HfCheckpoint& checkpoint, const WeightSlot& slot) {
  const std::vector<HfLayout> layouts = hf_layouts(our_layout(slot));
  for (const HfLayout& layout : layouts) {
    bool present = true;
    for (const HfPiece& piece : layout) present = present && checkpoint.has(piece.name);
    if (present) return layout;
  }
  return layouts.front();
}

// The checkpoint tensor's element count per leading-dimension row, after checking that the piece
// fits it.
int64_t checked_row_size(const HfCheckpoint& checkpoint, const HfPiece& piece) {
  MOETRAIN_CHECK(checkpoint.has(piece.name), ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" is missing; the directory does not match its config.json (or the "
                             "model type is not the one it was saved as)",
                             checkpoint.dir(), piece.name));
  const Shape& stored = checkpoint.info(piece.name).shape;
  const int64_t dim0 = stored.ndim() > 0 ? stored[0] : 1;
  const int64_t row = dim0 > 0 ? stored.numel() / dim0 : 0;
  const int64_t rows = piece.rows < 0 ? dim0 : piece.rows;
  bool fits = piece.any_layout ? piece.first_row + rows <= dim0 && row * rows == piece.numel : stored == piece.shape;
  if (!fits && piece.zero_padded && piece.rows < 0 && stored.numel() > piece.numel &&
      (dim0 == stored.numel() || row == stored.numel())) {
    const Tensor all = checkpoint.read_rows_as(piece.name, 0, dim0, DType::kF64);
    int64_t nonzero = 0;
    for (int64_t i = piece.numel; i < all.numel(); ++i) nonzero += all.ptr<double>()[i] != 0.0;
    MOETRAIN_CHECK(nonzero == 0, ExitCode::kBadCheckpoint,
                   fmt::format("{}: tensor \"{}\" in {} has {} elements where config.json implies {}, and {} of the "
                               "ones past {} are not zero (a zero-padded copy, as Kimi K3 stores A_log, would be "
                               "read): the config's head count does not match the checkpoint",
                               checkpoint.dir(), piece.name, checkpoint.file_of(piece.name), stored.numel(),
                               piece.numel, nonzero, piece.numel));
    fits = true;
  }
  if (!fits) {
    std::string expected = piece.any_layout ? fmt::format("{} elements", piece.numel) : piece.shape.str();
    if (piece.rows >= 0) expected += fmt::format(" in rows [{}, {})", piece.first_row, piece.first_row + rows);
    throw Error(ExitCode::kBadCheckpoint,
                fmt::format("{}: tensor \"{}\" in {} has shape {} but config.json implies {}", checkpoint.dir(),
                            piece.name, checkpoint.file_of(piece.name), stored.str(), expected));
  }
  return row;
}

// Rows [row_begin, row_end) of a base-model tensor as F64, refused when any is NaN or Inf: a
// model with such a weight trains nothing (every step's loss is non-finite and skipped), so it is
// a bad checkpoint, named, before any step.
Tensor read_finite_rows(const HfCheckpoint& checkpoint, const std::string& name, int64_t row_begin, int64_t row_end) {
  Tensor rows = checkpoint.read_rows_as(name, row_begin, row_end, DType::kF64);
  const double* v = rows.ptr<double>();
  const int64_t n = rows.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(v[i])) continue;
    const int64_t row = row_end > row_begin ? n / (row_end - row_begin) : n;
    throw Error(ExitCode::kBadCheckpoint,
                fmt::format("{}: tensor \"{}\" in {} holds a non-finite value ({} at row {}, element {}): the base "
                            "model is damaged; download or convert it again",
                            checkpoint.dir(), name, checkpoint.file_of(name), v[i], row_begin + i / row, i % row));
  }
  return rows;
}

// Elements [begin, end) of the weight's flattened values, as F64 into dst: only the rows of each
// checkpoint tensor that hold them are read.
void read_flat_range(const HfCheckpoint& checkpoint, const HfLayout& layout, int64_t begin, int64_t end, double* dst) {
  for (const HfPiece& piece : layout) {
    const int64_t row = checked_row_size(checkpoint, piece);
    const int64_t lo = std::max(begin, piece.offset) - piece.offset;
    const int64_t hi = std::min(end, piece.offset + piece.numel) - piece.offset;
    if (lo >= hi) continue;
    const int64_t first_row = lo / row;
    const int64_t last_row = (hi + row - 1) / row;
    Tensor rows = read_finite_rows(checkpoint, piece.name, piece.first_row + first_row, piece.first_row + last_row);
    std::memcpy(dst + (piece.offset + lo - begin), rows.ptr<double>() + (lo - first_row * row),
                static_cast<size_t>(hi - lo) * sizeof(double));
  }
}

// Reads `name`, which must have shape `expected`, as F64 into `dst`.
void read_into(const HfCheckpoint& checkpoint, const std::string& name, const Shape& expected, double* dst) {
  read_flat_range(checkpoint, {hf_piece(name, expected)}, 0, expected.numel(), dst);
}

// Routed experts: gate_up [G, 2F, D] and down [G, D, F] of this rank's experts, from the fused
// 3-D `gate_up_proj` / `down_proj` of transformers 5, or per-expert tensors (ours, or Moonshot's
// block_sparse_moe.experts.<e>.w1 / w3 / w2).
// `shape` is the experts' [G, out, in] (slot.tensor's own shape, except for MXFP4 slots).
void read_routed_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot, const Shape& shape, double* dst) {
  const int64_t groups = shape[0];
  const bool gate_up = slot.layout == WeightLayout::kSwigluGateUp;
  const std::string fused = slot.name + (gate_up ? ".gate_up_proj" : ".down_proj");
  if (checkpoint.has(fused)) {
    // This rank's experts only: a slice along the expert dimension, the rest is never read.
    const SafetensorsTensorInfo& info = checkpoint.info(fused);
    Shape expected = shape;
    expected[0] = info.shape[0];
    MOETRAIN_CHECK(info.shape == expected && slot.first_group + groups <= info.shape[0], ExitCode::kBadCheckpoint,
                   fmt::format("{}: tensor \"{}\" in {} has shape {} but config.json implies [{}, {}, {}]",
                               checkpoint.dir(), fused, checkpoint.file_of(fused), info.shape.str(),
                               slot.first_group + groups, shape[1], shape[2]));
    Tensor values = read_finite_rows(checkpoint, fused, slot.first_group, slot.first_group + groups);
    std::memcpy(dst, values.data(), values.nbytes());
    return;
  }
  // The naming the checkpoint uses for its per-expert tensors: the first whose first tensor exists.
  const std::vector<std::string> first = hf_expert_names(slot.name, slot.first_group, gate_up ? "gate_proj" : "down_proj");
  size_t naming = 0;
  while (naming + 1 < first.size() && !checkpoint.has(first[naming])) ++naming;
  auto tensor_name = [&](int64_t e, const char* projection) {
    return hf_expert_names(slot.name, slot.first_group + e, projection)[naming];
  };
  const int64_t per_group = shape.numel() / groups;
  for (int64_t g = 0; g < groups; ++g) {
    double* group = dst + g * per_group;
    if (gate_up) {
      const int64_t half = shape[1] / 2;
      read_into(checkpoint, tensor_name(g, "gate_proj"), Shape{half, shape[2]}, group);
      read_into(checkpoint, tensor_name(g, "up_proj"), Shape{half, shape[2]}, group + half * shape[2]);
    } else {
      read_into(checkpoint, tensor_name(g, "down_proj"), Shape{shape[1], shape[2]}, group);
    }
  }
}

// MXFP4 routed experts (slot.scale set; model.moe.expert_format: mxfp4), one expert at a time so
// the host never holds more than one expert's weights. The packed slot is [G, out, in / 2].
struct Mxfp4Expert {
  int64_t out, in;
  Tensor packed, scales;  // one expert's codes [out, in / 2] and scales [out, in / 32], host
  Mxfp4Expert(int64_t out_features, int64_t in_features)
      : out(out_features), in(in_features), packed({out_features, in_features / 2}, DType::kU8),
        scales({out_features, in_features / kernels::kMxfp4GroupSize}, DType::kU8) {}
  // Rows are independent: split over the host's cores (a K3 layer's experts are 33B weights).
  void quantize(const double* values) {
    auto* codes = static_cast<uint8_t*>(packed.data());
    auto* exponents = static_cast<uint8_t*>(scales.data());
    const int64_t threads =
        std::clamp<int64_t>(out * in / (1 << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t begin = out * t / threads, end = out * (t + 1) / threads;
      workers.emplace_back([=] {
        kernels::mxfp4_quantize(codes + begin * (in / 2), exponents + begin * (in / kernels::kMxfp4GroupSize),
                                     values + begin * in, end - begin, in);
      });
    }
    for (std::thread& w : workers) w.join();
  }
  void upload(kernels::Backend& backend, const WeightSlot& slot, int64_t g) const {
    backend.copy(slot.tensor->view().slice_rows(g, g + 1), packed);
    backend.copy(slot.scale->view().slice_rows(g, g + 1), scales);
  }
};

Mxfp4Expert mxfp4_expert_of(const WeightSlot& slot) {
  const Shape& shape = slot.tensor->shape();
  return Mxfp4Expert(shape[1], 2 * shape[2]);
}

// Reads `name` (U8, exactly `shape`) into dst.
void read_u8(const HfCheckpoint& checkpoint, const std::string& name, const Shape& shape, void* dst) {
  const SafetensorsTensorInfo& info = checkpoint.info(name);
  MOETRAIN_CHECK(info.dtype == DType::kU8 && info.shape == shape, ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" in {} is {} {} but an MXFP4 expert weight of this config is U8 {} "
                             "(compressed-tensors mxfp4-pack-quantized: [out, in / 2] codes, [out, in / 32] scales)",
                             checkpoint.dir(), name, checkpoint.file_of(name), dtype_name(info.dtype), info.shape.str(),
                             shape.str()));
  checkpoint.read_rows(dst, name, 0, shape[0]);
}

// MXFP4 scales (E8M0 exponents): 0xFF is E8M0's NaN, which would poison its 32 weights.
void read_mxfp4_scales(const HfCheckpoint& checkpoint, const std::string& name, const Shape& shape, uint8_t* dst) {
  read_u8(checkpoint, name, shape, dst);
  const int64_t n = shape.numel();
  for (int64_t i = 0; i < n; ++i) {
    MOETRAIN_CHECK(dst[i] != 0xFF, ExitCode::kBadCheckpoint,
                   fmt::format("{}: tensor \"{}\" in {} holds the NaN scale 0xFF (row {}, group {}): the base model "
                               "is damaged; download or convert it again",
                               checkpoint.dir(), name, checkpoint.file_of(name), i / shape[1], i % shape[1]));
  }
}

// The checkpoint's packed experts, as compressed-tensors writes them: per expert and projection
// `<weight name>_packed` and `<weight name>_scale` beside where the plain `.weight` would be (Kimi
// K3: block_sparse_moe.experts.<e>.w1 / w3 / w2.weight_packed). Returns false when the checkpoint
// has none for this slot (it holds plain weights, quantized on load instead).
bool load_packed_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot, kernels::Backend& backend) {
  const bool gate_up = slot.layout == WeightLayout::kSwigluGateUp;
  const std::vector<std::string> first = hf_expert_names(slot.name, slot.first_group, gate_up ? "gate_proj" : "down_proj");
  size_t naming = 0;
  while (naming < first.size() && !checkpoint.has(first[naming] + "_packed")) ++naming;
  if (naming == first.size()) return false;
  Mxfp4Expert expert = mxfp4_expert_of(slot);
  const int64_t groups = expert.in / kernels::kMxfp4GroupSize;
  for (int64_t g = 0; g < slot.tensor->size(0); ++g) {
    watchdog_progress("loading MXFP4 experts: " + slot.name);
    auto base = [&](const char* projection) {
      return hf_expert_names(slot.name, slot.first_group + g, projection)[naming];
    };
    auto* packed = static_cast<uint8_t*>(expert.packed.data());
    auto* scales = static_cast<uint8_t*>(expert.scales.data());
    if (gate_up) {  // gate rows over up rows
      const int64_t half = expert.out / 2;
      read_u8(checkpoint, base("gate_proj") + "_packed", {half, expert.in / 2}, packed);
      read_u8(checkpoint, base("up_proj") + "_packed", {half, expert.in / 2}, packed + half * expert.in / 2);
      read_mxfp4_scales(checkpoint, base("gate_proj") + "_scale", {half, groups}, scales);
      read_mxfp4_scales(checkpoint, base("up_proj") + "_scale", {half, groups}, scales + half * groups);
    } else {
      read_u8(checkpoint, base("down_proj") + "_packed", {expert.out, expert.in / 2}, packed);
      read_mxfp4_scales(checkpoint, base("down_proj") + "_scale", {expert.out, groups}, scales);
    }
    expert.upload(backend, slot, g);
  }
  return true;
}

// BF16 expert slots need plain weights: a checkpoint of packed experts (and no plain ones) asks
// for model.moe.expert_format: mxfp4.
void expect_plain_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot) {
  const bool gate_up = slot.layout == WeightLayout::kSwigluGateUp;
  if (checkpoint.has(slot.name + (gate_up ? ".gate_up_proj" : ".down_proj"))) return;
  for (const std::string& name : hf_expert_names(slot.name, slot.first_group, gate_up ? "gate_proj" : "down_proj")) {
    MOETRAIN_CHECK(checkpoint.has(name) || !checkpoint.has(name + "_packed"), ExitCode::kBadConfig,
                   fmt::format("{}: the routed experts are stored in MXFP4 (\"{}_packed\", compressed-tensors "
                               "mxfp4-pack-quantized); set model.moe.expert_format: mxfp4 to train on them packed",
                               checkpoint.dir(), name));
  }
}

// A checkpoint of plain expert weights into an MXFP4 slot: each expert's weights quantized.
void load_quantized_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot, kernels::Backend& backend) {
  Mxfp4Expert expert = mxfp4_expert_of(slot);
  Tensor values({expert.out, expert.in}, DType::kF64);
  for (int64_t g = 0; g < slot.tensor->size(0); ++g) {
    watchdog_progress("quantizing experts to MXFP4: " + slot.name);
    WeightSlot one = slot;
    one.first_group = slot.first_group + g;
    read_routed_experts(checkpoint, one, Shape{1, expert.out, expert.in}, values.ptr<double>());
    expert.quantize(values.ptr<double>());
    expert.upload(backend, slot, g);
  }
}

}  // namespace

void Model::load_weights(const HfCheckpoint& checkpoint) {
  fsdp_.release_all();  // the shards change: no gathered copy may outlive them
  for (const WeightSlot& slot : weight_slots()) {
    watchdog_progress("loading base weights: " + slot.name);
    if (slot.fp8()) {
      const std::string fused = slot.name + (slot.layout == WeightLayout::kSwigluGateUp ? ".gate_up_proj" : ".down_proj");
      if (is_routed_experts(slot) && checkpoint.has(fused)) {
        // transformers 5's fused experts are never FP8: each expert's values, quantized.
        const int64_t per_expert = slot.tensor->numel() / slot.tensor->size(0);
        auto expert = [&](double* dst, int64_t first_element, int64_t) {
          WeightSlot one = slot;
          one.first_group = slot.first_group + first_element / per_expert;
          read_routed_experts(checkpoint, one, Shape{1, slot.tensor->size(1), slot.tensor->size(2)}, dst);
        };
        quantize_fp8_slot(slot, true, expert, {}, backend_);
      } else if (is_routed_experts(slot)) {
        load_fp8_experts(checkpoint, slot, backend_);
      } else {
        const Fp8Destination dst{fsdp_.owned_part(slot.tensor), fsdp_.owned_part(slot.scale)};
        load_fp8_slot(checkpoint, slot, find_layout(checkpoint, slot), dst, backend_);
      }
      continue;
    }
    if (const FsdpBucket::OwnedPart* part = fsdp_.owned_part(slot.tensor)) {
      // FSDP: this rank's range of the weight only.
      Tensor host({part->end - part->begin}, DType::kF64);
      read_flat_range(checkpoint, find_layout(checkpoint, slot), part->begin, part->end, host.ptr<double>());
      Tensor staged(host.shape(), slot.tensor->dtype());
      convert_host(staged, host);
      backend_.copy(part->dst, staged);
      continue;
    }
    if (slot.mxfp4()) {
      if (!load_packed_experts(checkpoint, slot, backend_)) {
        log::info(fmt::format("{} ({}): no MXFP4 tensors (weight_packed / weight_scale) in the checkpoint; quantizing "
                              "its weights to MXFP4 (model.moe.expert_format: mxfp4)",
                              slot.name, slot.layout == WeightLayout::kSwigluGateUp ? "gate/up" : "down"));
        load_quantized_experts(checkpoint, slot, backend_);
      }
      continue;
    }
    Tensor host(slot.tensor->shape(), DType::kF64);
    if (is_routed_experts(slot)) {
      expect_plain_experts(checkpoint, slot);
      read_routed_experts(checkpoint, slot, slot.tensor->shape(), host.ptr<double>());
    } else {
      read_flat_range(checkpoint, find_layout(checkpoint, slot), 0, host.numel(), host.ptr<double>());
    }
    upload_weight(backend_, *slot.tensor, host);
  }
  backend_.synchronize();
}

void Model::init_random_weights() {
  fsdp_.release_all();  // the shards change: no gathered copy may outlive them
  for (const WeightSlot& slot : weight_slots()) {
    watchdog_progress("initialising base weights: " + slot.name);
    if (slot.fp8()) {
      // The values the BF16 weights would get (the same generator over the same elements),
      // quantized per block on the host.
      const Shape& shape = slot.tensor->shape();
      const bool routed = is_routed_experts(slot);
      RandomFill fill;
      fill.stddev = 1.0 / std::sqrt(static_cast<double>(shape[shape.ndim() - 1]));
      fill.seed = options_.seed ^ name_hash(slot.name) ^ static_cast<uint64_t>(slot.layout);
      const uint64_t first = static_cast<uint64_t>(slot.first_group * (shape.numel() / shape[0]));
      auto values = [&](double* dst, int64_t first_element, int64_t count) {
        TensorView view;
        view.data = dst;
        view.dtype = DType::kF64;
        view.shape = Shape{count};
        fill.first_element = first + static_cast<uint64_t>(first_element);
        fill_random(Tensor::borrowed(view), fill);
      };
      quantize_fp8_slot(slot, routed, values, {fsdp_.owned_part(slot.tensor), fsdp_.owned_part(slot.scale)}, backend_);
      continue;
    }
    if (slot.mxfp4()) {
      // MXFP4 experts: the values the BF16 experts would get (the same generator over the same
      // logical elements), quantized; made by the backend where they live.
      const int64_t out = slot.tensor->size(1), in = 2 * slot.tensor->size(2);
      log::info(
          fmt::format("initialising {} ({} experts of {} x {}) in MXFP4", slot.name, slot.tensor->size(0), out, in));
      kernels::RandomMxfp4Args args;
      args.codes = slot.tensor->view();
      args.scales = slot.scale->view();
      args.seed = options_.seed ^ name_hash(slot.name) ^ static_cast<uint64_t>(slot.layout);
      args.first_element = static_cast<uint64_t>(slot.first_group * out * in);
      args.half_width = uniform_half_width(1.0 / std::sqrt(static_cast<double>(in)));
      backend_.random_mxfp4(args);
      continue;
    }
    const FsdpBucket::OwnedPart* part = fsdp_.owned_part(slot.tensor);
    // FSDP: this rank's range only; element i's value depends only on i, so the shards hold
    // exactly what the whole tensor would.
    Tensor host = part ? Tensor({part->end - part->begin}, slot.tensor->dtype())
                       : Tensor(slot.tensor->shape(), slot.tensor->dtype());
    const Shape& shape = slot.tensor->shape();
    RandomFill fill;
    if (is_norm_weight(slot.name)) {
      fill.constant = 1.0;
    } else if (is_zero_init(slot.name)) {
      fill.constant = 0.0;
    } else {
      // Variance 1/fan_in (embeddings 1), so every projection keeps activations at unit scale
      // and the frozen head can express confident predictions once the adapters learn; 0.02 (a
      // pretraining init) leaves logits too small for LoRA to ever reach a low loss.
      const bool embedding = slot.name == "model.embed_tokens.weight";
      fill.stddev = embedding ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape[shape.ndim() - 1]));
      fill.seed = options_.seed ^ name_hash(slot.name) ^ static_cast<uint64_t>(slot.layout);
      fill.first_element = static_cast<uint64_t>(slot.first_group * (shape.numel() / shape[0]));
      if (part) fill.first_element += static_cast<uint64_t>(part->begin);
    }
    fill_random(host, fill);
    backend_.copy(part ? part->dst : slot.tensor->view(), host);
  }
  backend_.synchronize();
}

// FSDP buckets (docs/ARCHITECTURE.md §5). Per decoder layer: its norms, attention projections and latent
// norms, router weight, dense MLP or shared experts -- every frozen weight in the compute dtype
// (or FP8 codes with their scales) except the routed experts (expert parallelism slices those) and the F32 router score bias
// (E floats, kept whole). One more bucket holds embed_tokens, the final norm and lm_head: the
// embedding is the largest non-expert tensor, and it is needed only at the two ends of a step.
// Buckets are made as the layers are constructed, so the full weights of at most one layer
// exist at a time (allocated, never filled), and loading writes each rank's shard directly.
namespace {
// FP8 weights join with their block scales (the bucket holds members of any dtype).
bool shardable(const WeightSlot& slot, DType weight_dtype) {
  return !is_routed_experts(slot) && !is_bias(slot.name) && (slot.tensor->dtype() == weight_dtype || slot.fp8());
}
}  // namespace

void Model::shard_layer_weights(size_t index) {
  if (!fsdp_.sharded()) return;
  std::vector<Tensor*> members;
  for (const WeightSlot& slot : layer_weight_slots(index)) {
    if (!shardable(slot, options_.dtype)) continue;
    members.push_back(slot.tensor);
    if (slot.fp8()) members.push_back(slot.scale);
  }
  fsdp_.add_layer(index, members);
}

void Model::shard_outer_weights() {
  if (!fsdp_.sharded()) return;
  std::vector<Tensor*> outer = {&embed_, &final_norm_};
  if (!spec_.config.tie_word_embeddings) outer.push_back(&lm_head_);
  for (Tensor* mix : attn_res_.output_tensors()) outer.push_back(mix);
  fsdp_.set_outer(outer);
  FrozenWeightBytes bytes = frozen_non_expert_bytes();
  log::info(fmt::format("FSDP over {} ranks: frozen non-expert weights {:.3f} MiB per rank of {:.3f} MiB "
                        "({} layer buckets + embed/norm/head; gathered per layer, prefetch {}, {})",
                        fsdp_.ranks(), bytes.resident / 1048576.0, bytes.full / 1048576.0, fsdp_.layer_buckets(),
                        options_.fsdp_prefetch,
                        options_.fsdp_reshard_after_forward ? "re-gathered for backward" : "kept until backward"));
}

FrozenWeightBytes Model::frozen_non_expert_bytes() {
  FrozenWeightBytes bytes;
  for (const WeightSlot& slot : weight_slots()) {
    if (is_routed_experts(slot)) continue;
    for (const Tensor* t : {slot.tensor, slot.fp8() ? slot.scale : nullptr}) {
      if (t == nullptr) continue;
      bytes.full += t->nbytes();
      if (t->owns_memory()) bytes.kept_whole += t->nbytes();
    }
  }
  bytes.resident = bytes.kept_whole + fsdp_.resident_bytes();
  return bytes;
}

}  // namespace moetrain
