#include "core/model/vision_tower.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "core/base/bf16.h"
#include "core/base/error.h"
#include "core/base/host_convert.h"

namespace moetrain {

using kernels::AttentionArgs;
using kernels::CopyColumnsArgs;
using kernels::GeluApproximation;
using kernels::GeluArgs;
using kernels::GeluBackwardArgs;
using kernels::GemmArgs;
using kernels::PatchMergeArgs;
using kernels::RmsNormArgs;
using kernels::RmsNormBackwardArgs;
using kernels::RopeArgs;
using kernels::RopeLayout;
using kernels::VisionPosEmbedArgs;

namespace {

// A host F64 vector as a device tensor of `dtype`.
Tensor upload_values(const LayerContext& ctx, const std::vector<double>& values, Shape shape, DType dtype) {
  Tensor host(shape, DType::kF64);
  std::copy(values.begin(), values.end(), host.ptr<double>());
  Tensor staged(shape, dtype);
  convert_host(staged, host);
  Tensor device = ctx.alloc(shape, dtype);
  ctx.backend.copy(device, staged);
  return device;
}

Tensor upload_i32(const LayerContext& ctx, const std::vector<int32_t>& values) {
  Tensor host({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), host.ptr<int32_t>());
  Tensor device = ctx.alloc(host.shape(), DType::kI32);
  ctx.backend.copy(device, host);
  return device;
}

const char* kProjectorNames[2] = {"mm_projector.proj.0", "mm_projector.proj.2"};

}  // namespace

int64_t vision_tokens_of(const ImageGrid& grid, int64_t merge_size) {
  return (grid.height / merge_size) * (grid.width / merge_size);
}

std::vector<ImageGrid> image_grids_of(const std::vector<int32_t>& triples, const VisionConfig& config) {
  MOETRAIN_CHECK(triples.size() % 3 == 0, ExitCode::kBadData,
                 fmt::format("image grids: {} values, expected (t, h, w) triples", triples.size()));
  std::vector<ImageGrid> grids;
  for (size_t i = 0; i < triples.size(); i += 3) {
    const ImageGrid g{triples[i], triples[i + 1], triples[i + 2]};
    const size_t image = i / 3;
    MOETRAIN_CHECK(g.frames >= 1 && g.frames <= config.pos_emb_time, ExitCode::kBadData,
                   fmt::format("image {}: {} frames; the tower takes 1 to {} (model.vision.pos_emb_time)", image,
                               g.frames, config.pos_emb_time));
    // The 2-D RoPE's table covers 512 x 512 patches (NeMo's Rope2DPosEmbRepeated).
    MOETRAIN_CHECK(g.height >= config.merge_size && g.width >= config.merge_size && g.height <= 512 &&
                       g.width <= 512 && g.height % config.merge_size == 0 && g.width % config.merge_size == 0,
                   ExitCode::kBadData,
                   fmt::format("image {}: a grid of {} x {} patches; each side must be a multiple of {} "
                               "(model.vision.merge_size) and at most 512",
                               image, g.height, g.width, config.merge_size));
    grids.push_back(g);
  }
  return grids;
}

std::vector<double> vision_time_table(int64_t frames, int64_t dim) {
  const int64_t half = dim / 2;
  std::vector<double> table(static_cast<size_t>(frames * dim));
  for (int64_t f = 0; f < frames; ++f) {
    for (int64_t i = 0; i < half; ++i) {
      // float32 throughout, as the reference's numpy table, then bf16 as the cast tower holds it.
      const float omega = 1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(half));
      const float angle = static_cast<float>(f) * omega;
      table[f * dim + i] = bf16_to_float(float_to_bf16(std::sin(angle)));
      table[f * dim + half + i] = bf16_to_float(float_to_bf16(std::cos(angle)));
    }
  }
  return table;
}

std::vector<double> vision_rope_angles(const std::vector<ImageGrid>& grids, int64_t head_dim) {
  const int64_t half = head_dim / 2, quarter = head_dim / 4;
  std::vector<float> freq(static_cast<size_t>(quarter));
  for (int64_t i = 0; i < quarter; ++i)
    freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(4 * i) / static_cast<float>(head_dim));
  std::vector<double> angles;
  for (const ImageGrid& g : grids) {
    for (int64_t f = 0; f < g.frames; ++f) {
      for (int64_t r = 0; r < g.height; ++r) {
        for (int64_t c = 0; c < g.width; ++c) {
          for (int64_t i = 0; i < quarter; ++i) {
            angles.push_back(static_cast<double>(static_cast<float>(c) * freq[i]));
            angles.push_back(static_cast<double>(static_cast<float>(r) * freq[i]));
          }
        }
      }
    }
  }
  MOETRAIN_ASSERT(static_cast<int64_t>(angles.size()) % half == 0, "vision_rope_angles: ragged table");
  return angles;
}

VisionTower::VisionTower(const VisionConfig& config, int64_t text_hidden, const LayerContext& ctx)
    : config_(config), text_hidden_(text_hidden), merged_width_(config.merge_size * config.merge_size * config.hidden_size) {
  const int64_t hidden = config.hidden_size, p = config.patch_size;
  patch_embed_ = ctx.alloc({hidden, 3, p, p});
  pos_emb_ = ctx.alloc({config.pos_emb_height, config.pos_emb_width, hidden});
  time_ = upload_values(ctx, vision_time_table(config.pos_emb_time, hidden), {config.pos_emb_time, hidden}, ctx.dtype);
  blocks_.resize(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    Block& b = blocks_[static_cast<size_t>(i)];
    const std::string prefix = "vision_tower.encoder.blocks." + std::to_string(i);
    b.norm0 = ctx.alloc({hidden});
    b.norm1 = ctx.alloc({hidden});
    b.wqkv = LoraLinear(prefix + ".wqkv", hidden, 3 * config.qkv_hidden_size);
    b.wo = LoraLinear(prefix + ".wo", config.qkv_hidden_size, hidden);
    b.fc0 = LoraLinear(prefix + ".mlp.fc0", hidden, config.intermediate_size);
    b.fc1 = LoraLinear(prefix + ".mlp.fc1", config.intermediate_size, hidden);
    for (LoraLinear* l : {&b.wqkv, &b.wo, &b.fc0, &b.fc1}) l->weight = ctx.alloc({l->out_features(), l->in_features()});
  }
  final_norm_ = ctx.alloc({hidden});
  projector_[0] = LoraLinear(kProjectorNames[0], merged_width_, merged_width_);
  projector_[1] = LoraLinear(kProjectorNames[1], merged_width_, text_hidden);
  for (LoraLinear& l : projector_) l.weight = ctx.alloc({l.out_features(), l.in_features()});
  post_norm_ = ctx.alloc({text_hidden});
}

std::vector<WeightSlot> VisionTower::weight_slots() {
  std::vector<WeightSlot> slots = {{"vision_tower.patch_embed.proj.weight", &patch_embed_},
                                   {"vision_tower.patch_embed.pos_emb.weight", &pos_emb_}};
  for (size_t i = 0; i < blocks_.size(); ++i) {
    Block& b = blocks_[i];
    const std::string prefix = "vision_tower.encoder.blocks." + std::to_string(i);
    slots.push_back({prefix + ".norm0.weight", &b.norm0});
    slots.push_back({prefix + ".norm1.weight", &b.norm1});
    for (LoraLinear* l : {&b.wqkv, &b.wo, &b.fc0, &b.fc1}) slots.push_back({l->name() + ".weight", &l->weight});
  }
  slots.push_back({"vision_tower.encoder.final_layernorm.weight", &final_norm_});
  for (int i = 0; i < 2; ++i) {
    Tensor* w = full_ ? &projector_params_[i].value : &projector_[i].weight;
    slots.push_back({std::string(kProjectorNames[i]) + ".weight", w});
  }
  slots.push_back({"mm_projector.post_norm.weight", full_ ? &post_norm_param_.value : &post_norm_});
  return slots;
}

void VisionTower::make_trainable(const LoraSettings& lora, DType parameter_dtype,
                                 const std::function<std::mt19937_64(const std::string&)>& rng_for,
                                 kernels::Backend& backend) {
  if (config_.projector_train == "lora") {
    for (LoraLinear& l : projector_) {
      std::mt19937_64 rng = rng_for(l.name());
      l.lora = make_lora_adapter(l.name(), l.in_features(), l.out_features(), lora, parameter_dtype,
                                 backend.allocator(), backend, rng);
    }
  } else if (config_.projector_train == "full") {
    // The whole projector trains: its weights live in the parameters, the frozen copies go.
    full_ = true;
    auto make = [&](Parameter& param, const std::string& name, Shape shape) {
      param.name = name;
      param.value = Tensor(shape, parameter_dtype, backend.allocator());
      param.grad = Tensor(shape, parameter_dtype, backend.allocator());
      backend.fill(param.grad, 0.0);
    };
    for (int i = 0; i < 2; ++i) {
      make(projector_params_[i], std::string(kProjectorNames[i]) + ".weight", projector_[i].weight.shape());
      projector_[i].weight = Tensor();
    }
    make(post_norm_param_, "mm_projector.post_norm.weight", post_norm_.shape());
    post_norm_param_.weight_decay = false;
    post_norm_ = Tensor();
  }
}

void VisionTower::collect_parameters(std::vector<Parameter*>& out) {
  if (full_) {
    for (Parameter& p : projector_params_) out.push_back(&p);
    out.push_back(&post_norm_param_);
  }
  for (LoraLinear& l : projector_) l.collect_parameters(out);
}

Tensor VisionTower::forward(const LayerContext& ctx, const TensorView& patches, const std::vector<ImageGrid>& grids,
                            bool keep) {
  kernels::Backend& be = ctx.backend;
  Tensor features = tower(ctx, patches, grids);
  const int64_t tokens = features.size(0);
  Tensor h1 = ctx.alloc({tokens, merged_width_});
  projector_linear(ctx, 0, h1, features);
  Tensor g = ctx.alloc({tokens, merged_width_});
  be.gelu_forward(GeluArgs{g, h1, GeluApproximation::kExact});
  Tensor h2 = ctx.alloc({tokens, text_hidden_});
  projector_linear(ctx, 1, h2, g);
  Tensor out = ctx.alloc({tokens, text_hidden_});
  Tensor rstd = ctx.alloc_accum({tokens});
  be.rmsnorm_forward(RmsNormArgs{out, rstd, h2, post_norm_weight(), config_.projector_eps});
  if (keep) saved_ = Saved{std::move(features), std::move(h1), std::move(g), std::move(h2), std::move(rstd)};
  return out;
}

void VisionTower::backward(const LayerContext& ctx, const TensorView& dtokens) {
  kernels::Backend& be = ctx.backend;
  const int64_t tokens = dtokens.size(0);
  MOETRAIN_ASSERT(saved_.h2.numel() == tokens * text_hidden_, "VisionTower::backward without its forward");
  Tensor dh2 = ctx.alloc({tokens, text_hidden_});
  Tensor dnorm = full_ ? ctx.alloc(post_norm_param_.value.shape(), post_norm_param_.value.dtype()) : Tensor();
  be.rmsnorm_backward(RmsNormBackwardArgs{dh2, dnorm, dtokens, saved_.h2, post_norm_weight(), saved_.rstd, false});
  if (full_) be.axpby(post_norm_param_.grad, dnorm, 1.0, 1.0);
  Tensor dg = ctx.alloc({tokens, merged_width_});
  projector_linear_backward(ctx, 1, dg, dh2, saved_.g);
  be.gelu_backward(GeluBackwardArgs{dg, dg, saved_.h1, GeluApproximation::kExact});
  projector_linear_backward(ctx, 0, TensorView{}, dg, saved_.features);
  release();
}

void VisionTower::projector_linear(const LayerContext& ctx, int i, const TensorView& y, const TensorView& x) const {
  if (full_) {
    ctx.backend.gemm(GemmArgs{y, x, projector_params_[i].value, false, true, 1.0, 0.0});
  } else {
    projector_[i].forward(ctx, y, x);
  }
}

void VisionTower::projector_linear_backward(const LayerContext& ctx, int i, const TensorView& dx, const TensorView& dy,
                                            const TensorView& x) {
  if (!full_) {
    projector_[i].backward(ctx, dx, dy, x, false);
    return;
  }
  Parameter& w = projector_params_[i];
  ctx.backend.gemm(GemmArgs{w.grad, dy, x, true, false, 1.0, 1.0});  // dW += dy^T x
  if (dx.data) ctx.backend.gemm(GemmArgs{dx, dy, w.value, false, false, 1.0, 0.0});
}

Tensor VisionTower::tower(const LayerContext& ctx, const TensorView& patches, const std::vector<ImageGrid>& grids) {
  kernels::Backend& be = ctx.backend;
  const int64_t hidden = config_.hidden_size, head_dim = config_.qkv_hidden_size / config_.num_heads;
  int64_t total = 0, tokens = 0;
  std::vector<int32_t> cu = {0};
  for (const ImageGrid& g : grids) {
    total += g.patches();
    tokens += vision_tokens_of(g, config_.merge_size);
    cu.push_back(static_cast<int32_t>(total));
  }
  const int64_t patch_width = 3 * config_.patch_size * config_.patch_size;
  MOETRAIN_CHECK(patches.ndim() == 2 && patches.size(0) == total && patches.size(1) == patch_width, ExitCode::kBadData,
                 fmt::format("image patches are {}; the grids need [{}, {}]", patches.shape.str(), total, patch_width));
  Tensor x = ctx.alloc({total, hidden});
  be.gemm(GemmArgs{x, patches, patch_embed_.view().reshaped({hidden, patch_width}), false, true, 1.0, 0.0});
  int64_t row = 0;
  for (const ImageGrid& g : grids) {
    be.vision_pos_embed(VisionPosEmbedArgs{x.view().slice_rows(row, row + g.patches()), pos_emb_,
                                           g.frames > 1 ? time_.view() : TensorView{}, g.frames, g.height, g.width});
    row += g.patches();
  }
  const std::vector<double> angles = vision_rope_angles(grids, head_dim);
  std::vector<double> cos(angles.size()), sin(angles.size());
  for (size_t i = 0; i < angles.size(); ++i) {
    cos[i] = std::cos(angles[i]);
    sin[i] = std::sin(angles[i]);
  }
  const Tensor cos_t = upload_values(ctx, cos, {total, head_dim / 2}, ctx.accum());
  const Tensor sin_t = upload_values(ctx, sin, {total, head_dim / 2}, ctx.accum());
  std::vector<int32_t> rows(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) rows[i] = static_cast<int32_t>(i);  // a table row per patch
  const Tensor positions = upload_i32(ctx, rows);
  const Tensor cu_seqlens = upload_i32(ctx, cu);
  for (const Block& block : blocks_) block_forward(ctx, block, x, cu_seqlens, positions, cos_t, sin_t);
  Tensor normed = ctx.alloc({total, hidden});
  Tensor rstd = ctx.alloc_accum({total});
  be.rmsnorm_forward(RmsNormArgs{normed, rstd, x, final_norm_, config_.norm_eps});
  Tensor features = ctx.alloc({tokens, merged_width_});
  row = 0;
  int64_t token = 0;
  for (const ImageGrid& g : grids) {
    const int64_t n = vision_tokens_of(g, config_.merge_size);
    be.patch_merge(PatchMergeArgs{features.view().slice_rows(token, token + n),
                                  normed.view().slice_rows(row, row + g.patches()), g.frames, g.height, g.width,
                                  config_.merge_size, config_.merge_size});
    row += g.patches();
    token += n;
  }
  return features;
}

// x += wo(attn(rope(wqkv(norm0 x)))); x += fc1(gelu_tanh(fc0(norm1 x))), in place.
void VisionTower::block_forward(const LayerContext& ctx, const Block& block, const TensorView& x,
                                const TensorView& cu_seqlens, const TensorView& positions, const TensorView& cos,
                                const TensorView& sin) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0), hidden = config_.hidden_size, heads = config_.num_heads;
  const int64_t qkv = config_.qkv_hidden_size, head_dim = qkv / heads;
  Tensor normed = ctx.alloc({n, hidden});
  Tensor rstd = ctx.alloc_accum({n});
  be.rmsnorm_forward(RmsNormArgs{normed, rstd, x, block.norm0, config_.norm_eps});
  Tensor packed = ctx.alloc({n, 3 * qkv});
  block.wqkv.forward(ctx, packed, normed);
  Tensor q = ctx.alloc({n, heads, head_dim}), k = ctx.alloc({n, heads, head_dim}), v = ctx.alloc({n, heads, head_dim});
  be.copy_columns(CopyColumnsArgs{q.view().reshaped({n, qkv}), packed, 0, 0, qkv, 1, false});
  be.copy_columns(CopyColumnsArgs{k.view().reshaped({n, qkv}), packed, 0, qkv, qkv, 1, false});
  be.copy_columns(CopyColumnsArgs{v.view().reshaped({n, qkv}), packed, 0, 2 * qkv, qkv, 1, false});
  for (Tensor* t : {&q, &k}) {
    const TensorView rows = t->view().reshaped({n * heads, head_dim});
    be.rope(RopeArgs{rows, rows, positions, cos, sin, heads, 0, head_dim, RopeLayout::kAdjacent, false});
  }
  Tensor attn = ctx.alloc({n, heads, head_dim});
  Tensor lse = ctx.alloc_accum({n, heads});
  AttentionArgs args{attn, lse, q, k, v, cu_seqlens, 1.0 / std::sqrt(static_cast<double>(head_dim))};
  args.causal = false;
  be.attention_forward(args);
  const TensorView attn_rows = attn.view().reshaped({n, qkv});
  be.gemm(GemmArgs{x, attn_rows, block.wo.weight, false, true, 1.0, 1.0});
  be.rmsnorm_forward(RmsNormArgs{normed, rstd, x, block.norm1, config_.norm_eps});
  Tensor mid = ctx.alloc({n, config_.intermediate_size});
  block.fc0.forward(ctx, mid, normed);
  be.gelu_forward(GeluArgs{mid, mid, GeluApproximation::kTanh});
  be.gemm(GemmArgs{x, mid, block.fc1.weight, false, true, 1.0, 1.0});
}

}  // namespace moetrain
