#include "core/model/fp8_weights_load.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/base/log.h"
#include "kernels/fp8_format.h"
#include "parallel/watchdog.h"

namespace moetrain {
namespace {

using kernels::fp8_blocks;
using kernels::kFp8BlockSize;

// One matrix's codes and scales on the host.
struct Fp8Matrix {
  int64_t rows, cols;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Fp8Matrix(int64_t r, int64_t c) : rows(r), cols(c), codes(r * c), scales(fp8_blocks(r) * fp8_blocks(c)) {}
  // Block rows are independent: split over the host's cores (a routed expert is 44M weights at
  // DeepSeek-V3's width, a random slice of a layer's experts 11G).
  void quantize(const double* values) {
    const int64_t block_rows = fp8_blocks(rows);
    const int64_t threads = std::clamp<int64_t>(rows * cols / (1 << 20), 1,
                                                std::min<int64_t>(block_rows, std::max(1u, std::thread::hardware_concurrency())));
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t r0 = block_rows * t / threads * kFp8BlockSize;
      const int64_t r1 = std::min(rows, block_rows * (t + 1) / threads * kFp8BlockSize);
      workers.emplace_back([=] {
        kernels::fp8_block_quantize(codes.data() + r0 * cols, scales.data() + r0 / kFp8BlockSize * fp8_blocks(cols),
                                    values + r0 * cols, r1 - r0, cols);
      });
    }
    for (std::thread& w : workers) w.join();
  }
};

// Once per process: a BF16 checkpoint has thousands of weights to quantize.
void log_quantizing_once(const HfCheckpoint& checkpoint, const std::string& name) {
  static std::atomic<bool> logged{false};
  if (logged.exchange(true)) return;
  log::info(fmt::format("{}: \"{}\" and other weights are not FP8 in the checkpoint; quantizing them to FP8 "
                        "(E4M3, a scale per 128 x 128 block) for model.weight_format: fp8",
                        checkpoint.dir(), name));
}

// The checkpoint matrix `name` [rows, cols] into `m`: its own codes and scales when it is stored
// E4M3, else its values quantized. E5M2 codes are not E4M3's: refused rather than re-rounded.
void read_fp8_matrix(const HfCheckpoint& checkpoint, const std::string& name, Fp8Matrix& m) {
  MOETRAIN_CHECK(checkpoint.has(name), ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" is missing; the directory does not match its config.json",
                             checkpoint.dir(), name));
  const SafetensorsTensorInfo& info = checkpoint.info(name);
  MOETRAIN_CHECK(info.shape == Shape({m.rows, m.cols}), ExitCode::kBadCheckpoint,
                 fmt::format("{}: tensor \"{}\" in {} has shape {} but config.json implies [{}, {}]", checkpoint.dir(),
                             name, checkpoint.file_of(name), info.shape.str(), m.rows, m.cols));
  if (info.fp8 == Fp8Format::kNone) {
    log_quantizing_once(checkpoint, name);
    const Tensor values = checkpoint.read_as(name, DType::kF64);
    for (int64_t i = 0; i < values.numel(); ++i) {
      MOETRAIN_CHECK(std::isfinite(values.ptr<double>()[i]), ExitCode::kBadCheckpoint,
                     fmt::format("{}: tensor \"{}\" in {} holds a non-finite value at element {}: the base model is "
                                 "damaged; download or convert it again",
                                 checkpoint.dir(), name, checkpoint.file_of(name), i));
    }
    m.quantize(values.ptr<double>());
    return;
  }
  MOETRAIN_CHECK(info.fp8 == Fp8Format::kE4M3, ExitCode::kBadConfig,
                 fmt::format("{}: tensor \"{}\" in {} is {}, but model.weight_format: fp8 keeps E4M3 codes; set "
                             "model.weight_format: bf16 to train on its dequantized values",
                             checkpoint.dir(), name, checkpoint.file_of(name), fp8_dtype_name(info.fp8)));
  const HfCheckpoint::Fp8Weight stored = checkpoint.read_fp8(name);
  std::memcpy(m.codes.data(), stored.codes.data(), m.codes.size());
  std::memcpy(m.scales.data(), stored.scales.data(), m.scales.size() * sizeof(float));
  for (size_t i = 0; i < m.codes.size(); ++i) {
    MOETRAIN_CHECK((m.codes[i] & 0x7F) != 0x7F, ExitCode::kBadCheckpoint,
                   fmt::format("{}: tensor \"{}\" in {} holds the E4M3 NaN code 0x{:02X} (row {}, column {}): the base "
                               "model is damaged; download or convert it again",
                               checkpoint.dir(), name, checkpoint.file_of(name), m.codes[i], i / m.cols, i % m.cols));
  }
  for (size_t i = 0; i < m.scales.size(); ++i) {
    MOETRAIN_CHECK(std::isfinite(m.scales[i]), ExitCode::kBadCheckpoint,
                   fmt::format("{}: block scales \"{}\" in {} hold a non-finite value ({} at block {}): the base model "
                               "is damaged; download or convert it again",
                               checkpoint.dir(), fp8_scale_name(name), checkpoint.file_of(fp8_scale_name(name)),
                               m.scales[i], i));
  }
}

// Copies `codes` and `scales` (a whole slot, or its group g of `groups`) where they belong.
void upload(kernels::Backend& backend, const WeightSlot& slot, const Fp8Destination& dst,
            const std::vector<uint8_t>& codes, const std::vector<float>& scales, int64_t g = -1) {
  auto host = [](const void* data, DType dtype, int64_t n) {
    TensorView v;
    v.data = const_cast<void*>(data);
    v.dtype = dtype;
    v.shape = Shape{n};
    return v;
  };
  if (g >= 0) {
    backend.copy(slot.tensor->view().slice_rows(g, g + 1), host(codes.data(), DType::kU8, codes.size())
                                                            .reshaped(slot.tensor->view().slice_rows(g, g + 1).shape));
    backend.copy(slot.scale->view().slice_rows(g, g + 1), host(scales.data(), DType::kF32, scales.size())
                                                           .reshaped(slot.scale->view().slice_rows(g, g + 1).shape));
    return;
  }
  if (dst.codes != nullptr) {
    const auto& c = *dst.codes;
    const auto& s = *dst.scales;
    if (c.end > c.begin) backend.copy(c.dst, host(codes.data() + c.begin, DType::kU8, c.end - c.begin));
    if (s.end > s.begin) backend.copy(s.dst, host(scales.data() + s.begin, DType::kF32, s.end - s.begin));
    return;
  }
  backend.copy(slot.tensor->view(), host(codes.data(), DType::kU8, codes.size()).reshaped(slot.tensor->shape()));
  backend.copy(slot.scale->view(), host(scales.data(), DType::kF32, scales.size()).reshaped(slot.scale->shape()));
}

// The slot's matrices: [G, rows, cols] (SwiGLU and routed weights) or [rows, cols].
int64_t rows_of(const WeightSlot& slot) { return slot.tensor->size(-2); }
int64_t cols_of(const WeightSlot& slot) { return slot.tensor->size(-1); }

}  // namespace

void load_fp8_slot(const HfCheckpoint& checkpoint, const WeightSlot& slot, const HfLayout& layout,
                   const Fp8Destination& dst, kernels::Backend& backend) {
  const int64_t cols = cols_of(slot);
  std::vector<uint8_t> codes(static_cast<size_t>(slot.tensor->numel()));
  std::vector<float> scales(static_cast<size_t>(slot.scale->numel()));
  for (const HfPiece& piece : layout) {
    const int64_t first_row = piece.offset / cols, rows = piece.numel / cols;
    MOETRAIN_ASSERT(!piece.any_layout && piece.first_row == 0 && piece.rows < 0 && first_row % kFp8BlockSize == 0,
                    slot.name + ": FP8 weights are read from whole tensors that start 128-row blocks");
    Fp8Matrix m(rows, cols);
    read_fp8_matrix(checkpoint, piece.name, m);
    std::memcpy(codes.data() + piece.offset, m.codes.data(), m.codes.size());
    std::memcpy(scales.data() + first_row / kFp8BlockSize * fp8_blocks(cols), m.scales.data(),
                m.scales.size() * sizeof(float));
  }
  upload(backend, slot, dst, codes, scales);
}

void load_fp8_experts(const HfCheckpoint& checkpoint, const WeightSlot& slot, kernels::Backend& backend) {
  const bool gate_up = slot.layout == WeightLayout::kSwigluGateUp;
  const int64_t rows = rows_of(slot), cols = cols_of(slot);
  const std::vector<std::string> first = hf_expert_names(slot.name, slot.first_group, gate_up ? "gate_proj" : "down_proj");
  size_t naming = 0;
  while (naming + 1 < first.size() && !checkpoint.has(first[naming])) ++naming;
  for (int64_t g = 0; g < slot.tensor->size(0); ++g) {
    watchdog_progress("loading FP8 experts: " + slot.name);
    auto name = [&](const char* projection) { return hf_expert_names(slot.name, slot.first_group + g, projection)[naming]; };
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    for (const char* projection : gate_up ? std::vector<const char*>{"gate_proj", "up_proj"}
                                          : std::vector<const char*>{"down_proj"}) {
      Fp8Matrix m(gate_up ? rows / 2 : rows, cols);
      read_fp8_matrix(checkpoint, name(projection), m);
      codes.insert(codes.end(), m.codes.begin(), m.codes.end());
      scales.insert(scales.end(), m.scales.begin(), m.scales.end());
    }
    upload(backend, slot, {}, codes, scales, g);
  }
}

void quantize_fp8_slot(const WeightSlot& slot, bool routed, const Fp8Values& fill, const Fp8Destination& dst,
                       kernels::Backend& backend) {
  const int64_t rows = rows_of(slot), cols = cols_of(slot);
  const int64_t matrices = slot.tensor->numel() / (rows * cols);
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<double> values(static_cast<size_t>(rows * cols));
  for (int64_t g = 0; g < matrices; ++g) {
    fill(values.data(), g * rows * cols, rows * cols);
    Fp8Matrix m(rows, cols);
    m.quantize(values.data());
    if (routed) {
      upload(backend, slot, {}, m.codes, m.scales, g);
      continue;
    }
    codes.insert(codes.end(), m.codes.begin(), m.codes.end());
    scales.insert(scales.end(), m.scales.begin(), m.scales.end());
  }
  if (!routed) upload(backend, slot, dst, codes, scales);
}

}  // namespace moetrain
