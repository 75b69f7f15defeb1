// Kimi K3's vision side (model.vision; docs/HF_SEMANTICS.md §11): the MoonViT3d tower, its
// temporal-pool patch merger and the patchmergerv2 projector, which turn a micro-batch's images
// into text-side tokens:
//   patches -> patch embedding + position embedding -> L x [x + attn(norm0 x); x + mlp(norm1 x)]
//   -> final norm -> merge (mean over frames, merge x merge neighbours side by side)
//   -> projector: post_norm(proj.2(gelu(proj.0(x))))
// The tower is frozen and runs forward only, keeping nothing; the projector trains (full or
// LoRA, model.vision.projector_train) and keeps its inputs for its backward. The tower's weights
// are whole on every rank (not FSDP-sharded: the tower is small beside the language model).
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/layer.h"
#include "core/model/layer_context.h"
#include "core/model/lora_linear.h"
#include "core/model/parameter.h"

namespace moetrain {

// One image (or video) in patches: frames x height x width, in raster order.
struct ImageGrid {
  int64_t frames = 1;
  int64_t height = 0;
  int64_t width = 0;
  int64_t patches() const { return frames * height * width; }
};

// The text-side tokens an image becomes: (height / merge) x (width / merge), whatever its frames.
int64_t vision_tokens_of(const ImageGrid& grid, int64_t merge_size);

// The grids of a batch (Batch::image_grids, (t, h, w) triples), checked against the tower's limits
// (Error kBadData naming the image and the limit).
std::vector<ImageGrid> image_grids_of(const std::vector<int32_t>& triples, const VisionConfig& config);

// The fixed sin-cos time rows [frames, dim]: time[f] = [sin(f w_i), cos(f w_i)], w_i = 10000^(-i / (dim/2)),
// each value rounded to bf16: the reference's table is a buffer that NeMo casts with the tower to the
// model's dtype (text_config.torch_dtype, bf16 unless set; K3 ships bf16), so even its float32 runs
// add the bf16 values.
std::vector<double> vision_time_table(int64_t frames, int64_t dim);

// The 2-D RoPE angles of every patch [patches, head_dim / 2], images in order: pair 2i turns by
// column * f_i, pair 2i + 1 by row * f_i, f_i = 10000^(-4 i / head_dim), in float32 as the reference.
std::vector<double> vision_rope_angles(const std::vector<ImageGrid>& grids, int64_t head_dim);

class VisionTower {
 public:
  VisionTower(const VisionConfig& config, int64_t text_hidden, const LayerContext& ctx);

  const VisionConfig& config() const { return config_; }
  // Every frozen weight by its released name (vision_tower.*, mm_projector.*); with
  // projector_train: full, the projector's slots are its parameters' values.
  std::vector<WeightSlot> weight_slots();
  // The projector's trainable parameters, as model.vision.projector_train says: full makes its two
  // Linears and its norm parameters (dtype `parameter_dtype`), lora gives the two Linears adapters.
  // `rng_for` gives each adapter's generator from its module name.
  void make_trainable(const LoraSettings& lora, DType parameter_dtype,
                      const std::function<std::mt19937_64(const std::string&)>& rng_for, kernels::Backend& backend);
  void collect_parameters(std::vector<Parameter*>& out);

  // The image tokens [sum of vision_tokens_of, text hidden] of `patches` [sum of patches, 3 p^2]
  // (each patch channel-major, [c][y][x]). With keep, the projector keeps what its backward reads.
  Tensor forward(const LayerContext& ctx, const TensorView& patches, const std::vector<ImageGrid>& grids, bool keep);
  // The projector's parameter gradients (+=) from dtokens, the image tokens' gradient; then
  // releases what forward kept. Nothing flows into the frozen tower.
  void backward(const LayerContext& ctx, const TensorView& dtokens);
  void release() { saved_ = Saved{}; }
  // The tower's merged output [tokens, merge^2 hidden] (the projector's input), forward only.
  Tensor tower(const LayerContext& ctx, const TensorView& patches, const std::vector<ImageGrid>& grids);

 private:
  struct Block {
    Tensor norm0, norm1;         // [hidden]
    LoraLinear wqkv, wo, fc0, fc1;
  };
  // What the projector's backward reads.
  struct Saved {
    Tensor features;  // [tokens, merge^2 hidden] the merger's output
    Tensor h1;        // [tokens, merge^2 hidden] proj.0's output, before the GELU
    Tensor g;         // gelu(h1)
    Tensor h2;        // [tokens, text hidden] proj.2's output
    Tensor rstd;      // [tokens]
  };
  void block_forward(const LayerContext& ctx, const Block& block, const TensorView& x, const TensorView& cu_seqlens,
                     const TensorView& positions, const TensorView& cos, const TensorView& sin);
  // y = x W^T of projector Linear i (0: proj.0, 1: proj.2), with its adapter or trainable weight.
  void projector_linear(const LayerContext& ctx, int i, const TensorView& y, const TensorView& x) const;
  void projector_linear_backward(const LayerContext& ctx, int i, const TensorView& dx, const TensorView& dy,
                                 const TensorView& x);
  const TensorView& post_norm_weight() const { return full_ ? post_norm_param_.value.view() : post_norm_.view(); }

  VisionConfig config_;
  int64_t text_hidden_ = 0;
  int64_t merged_width_ = 0;  // merge^2 hidden
  Tensor patch_embed_;        // [hidden, 3, p, p]
  Tensor pos_emb_;            // [H0, W0, hidden]
  Tensor time_;               // [pos_emb_time, hidden]
  std::vector<Block> blocks_;
  Tensor final_norm_;         // [hidden]
  std::array<LoraLinear, 2> projector_;  // proj.0, proj.2 (frozen base, adapters with lora)
  Tensor post_norm_;          // [text hidden]
  bool full_ = false;         // projector_train: full
  std::array<Parameter, 2> projector_params_;
  Parameter post_norm_param_;
  Saved saved_;
};

}  // namespace moetrain
