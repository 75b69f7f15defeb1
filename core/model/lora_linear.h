// A frozen linear layer y = x W^T (W [out, in], the Hugging Face layout) with an optional
// LoRA adapter: y += scale * (x A^T) B^T, A [rank, in], B [out, rank], scale = alpha / rank
// (alpha / sqrt(rank) with rsLoRA). PEFT initialisation: A ~ U(-1/sqrt(in), 1/sqrt(in))
// (kaiming-uniform with a = sqrt(5)), B = 0, so training starts from the base model.
//
// The layer keeps no activations: its owner passes the saved input to backward, and the small
// x A^T product is recomputed there (rank columns: far cheaper than storing it per layer).
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/layer.h"
#include "core/model/layer_context.h"
#include "core/model/parameter.h"

namespace moetrain {

struct LoraSettings {
  int64_t rank = 8;
  double alpha = 16.0;
  bool rslora = false;
  double scale() const;
};

struct LoraAdapter {
  Parameter a;  // [rank, in]
  Parameter b;  // [out, rank]
  double scale = 1.0;
};

// Makes an adapter named `<prefix>.lora_A.weight` / `<prefix>.lora_B.weight`, initialised as
// PEFT does, drawing A from `rng`.
std::unique_ptr<LoraAdapter> make_lora_adapter(const std::string& prefix, int64_t in, int64_t out,
                                               const LoraSettings& settings, DType dtype, Allocator& allocator,
                                               kernels::Backend& backend, std::mt19937_64& rng);

class LoraLinear {
 public:
  LoraLinear() = default;
  LoraLinear(std::string name, int64_t in, int64_t out) : name_(std::move(name)), in_(in), out_(out) {}

  const std::string& name() const { return name_; }  // the HF module name, e.g. model.layers.0.self_attn.o_proj
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

  // [out, in], frozen: the working dtype, or FP8 codes (U8) with weight_scale beside them
  // (model.weight_format: fp8, core/model/fp8_storage.h).
  Tensor weight;
  Tensor weight_scale;                  // FP8 only: F32 [ceil(out / 128), ceil(in / 128)]
  std::unique_ptr<LoraAdapter> lora;    // null: no adapter on this module

  // Allocates the frozen weight, in FP8 when the config keeps this module so.
  void alloc_weight(const LayerContext& ctx, const ModelConfig& config);
  // The weight's slot for loading and sharding (its scale travels with it).
  WeightSlot weight_slot();

  // y = x W^T (+ LoRA); y [rows, out], x [rows, in].
  void forward(const LayerContext& ctx, const TensorView& y, const TensorView& x) const;
  // dx (=, or += with accumulate_dx) dy W (+ LoRA), and the adapter's gradients += .
  // dx may be empty when the input needs no gradient.
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dy, const TensorView& x,
                bool accumulate_dx) const;

  void collect_parameters(std::vector<Parameter*>& out);

 private:
  std::string name_;
  int64_t in_ = 0;
  int64_t out_ = 0;
};

}  // namespace moetrain
