// The Model's image side (model.vision): a batch's images checked against its placeholder tokens
// and uploaded, the vision tower's image tokens merged into the text embeddings, and the
// projector's backward from their gradient (core/model/vision_tower.h).
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/base/host_convert.h"
#include "core/model/model.h"

namespace moetrain {

void Model::upload_images(const Batch& batch, BatchTensors& bt) {
  if (!vision_) {
    MOETRAIN_CHECK(batch.image_grids.empty(), ExitCode::kBadData,
                   fmt::format("the batch holds {} images but the model has no vision tower (model.vision.enabled)",
                               batch.image_grids.size() / 3));
    return;
  }
  const VisionConfig& v = vision_->config();
  const std::vector<ImageGrid> grids = image_grids_of(batch.image_grids, v);
  int64_t patches = 0, tokens = 0;
  for (const ImageGrid& g : grids) {
    patches += g.patches();
    tokens += vision_tokens_of(g, v.merge_size);
  }
  const int64_t patch_width = 3 * v.patch_size * v.patch_size;
  MOETRAIN_CHECK(static_cast<int64_t>(batch.image_patches.size()) == patches * patch_width, ExitCode::kBadData,
                 fmt::format("the batch's images hold {} patch values; their grids need {} patches of {}",
                             batch.image_patches.size(), patches, patch_width));
  std::vector<int32_t> rows;
  const int32_t placeholder = static_cast<int32_t>(v.placeholder_token_id);
  for (size_t t = 0; t < batch.input_ids.size(); ++t) {
    if (batch.input_ids[t] == placeholder) rows.push_back(static_cast<int32_t>(t));
    MOETRAIN_CHECK(batch.labels[t] != placeholder, ExitCode::kBadData,
                   fmt::format("token {}: its target is the image placeholder {} (model.vision.placeholder_token_id); "
                               "image positions are not targets (label -1)",
                               t, placeholder));
  }
  MOETRAIN_CHECK(static_cast<int64_t>(rows.size()) == tokens, ExitCode::kBadData,
                 fmt::format("the batch has {} image placeholder tokens (id {}) but its {} images make {} tokens; "
                             "prepare the data with one placeholder per image token",
                             rows.size(), placeholder, grids.size(), tokens));
  if (tokens == 0) return;
  MOETRAIN_CHECK(!batch.context, ExitCode::kBadConfig,
                 "images under context parallelism (parallel.cp > 1) are not supported yet: use parallel.cp: 1");
  const int64_t n = bt.num_tokens;
  std::vector<int32_t> index(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) index[t] = static_cast<int32_t>(t);
  for (size_t j = 0; j < rows.size(); ++j) index[rows[j]] = static_cast<int32_t>(n + static_cast<int64_t>(j));
  auto upload_i32 = [&](const std::vector<int32_t>& values) {
    Tensor host({static_cast<int64_t>(values.size())}, DType::kI32);
    std::copy(values.begin(), values.end(), host.ptr<int32_t>());
    Tensor device({host.size(0)}, DType::kI32, backend_.allocator());
    backend_.copy(device, host);
    return device;
  };
  bt.image_rows = upload_i32(rows);
  bt.merge_index = upload_i32(index);
  bt.image_grids = batch.image_grids;
  Tensor host({patches, patch_width}, DType::kF32);
  std::copy(batch.image_patches.begin(), batch.image_patches.end(), host.ptr<float>());
  Tensor staged(host.shape(), options_.dtype);
  convert_host(staged, host);
  bt.image_patches = Tensor(host.shape(), options_.dtype, backend_.allocator());
  backend_.copy(bt.image_patches, staged);
}

bool Model::vision_trains() const {
  if (!vision_) return false;
  std::vector<Parameter*> params;
  vision_->collect_parameters(params);
  return !params.empty();
}

void Model::merge_images(const LayerContext& ctx, const TensorView& out, bool keep, std::string& where) {
  if (!vision_ || ctx.batch.image_grids.empty()) return;
  where = "the vision tower and projector forward";
  const std::vector<ImageGrid> grids = image_grids_of(ctx.batch.image_grids, vision_->config());
  Tensor tokens = vision_->forward(ctx, ctx.batch.image_patches, grids, keep);
  const int64_t n = out.size(0), m = tokens.size(0), d = out.size(1);
  // [text embeddings | image tokens], then each row from its source (merge_index).
  Tensor sources = ctx.alloc({n + m, d});
  backend_.copy(sources.view().slice_rows(0, n), out);
  backend_.copy(sources.view().slice_rows(n, n + m), tokens);
  backend_.moe_permute(out, sources, ctx.batch.merge_index, 1);
}

void Model::merge_images_backward(const LayerContext& ctx, const TensorView& dembedded, std::string& where) {
  if (!vision_ || ctx.batch.image_grids.empty() || !vision_trains()) return;
  where = "the projector backward";
  Tensor dtokens = ctx.alloc({ctx.batch.image_rows.numel(), dembedded.size(1)});
  backend_.moe_permute(dtokens, dembedded, ctx.batch.image_rows, 1);
  vision_->backward(ctx, dtokens);
}

}  // namespace moetrain
