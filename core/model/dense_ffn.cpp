#include "core/model/dense_ffn.h"

#include "core/model/fp8_storage.h"

namespace moetrain {
namespace {

// An int32 device tensor [2] holding {0, rows}.
Tensor single_group_offsets(const LayerContext& ctx, int64_t rows) {
  Tensor host({2}, DType::kI32);
  host.ptr<int32_t>()[0] = 0;
  host.ptr<int32_t>()[1] = static_cast<int32_t>(rows);
  Tensor device({2}, DType::kI32, ctx.backend.allocator());
  ctx.backend.copy(device, host);
  return device;
}

}  // namespace

DenseFfn::DenseFfn(std::string prefix, int64_t hidden, int64_t width, const LayerContext& ctx,
                   const ModelConfig& config)
    : mlp(std::move(prefix), 1, hidden, width) {
  const bool fp8 = keeps_fp8(config, mlp.prefix() + ".gate_proj") && fp8_stacks(width);
  alloc_frozen_weight(ctx, {1, 2 * width, hidden}, fp8, mlp.gate_up, mlp.gate_up_scale);
  alloc_frozen_weight(ctx, {1, hidden, width}, fp8, mlp.down, mlp.down_scale);
}

GroupOffsets DenseFfn::offsets(const LayerContext& ctx, int64_t rows) {
  if (offsets_host_[1] != rows) {
    offsets_ = single_group_offsets(ctx, rows);
    offsets_host_[1] = static_cast<int32_t>(rows);
  }
  return GroupOffsets{offsets_.view(), offsets_host_};
}

void DenseFfn::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  mlp.forward(ctx, out, x, offsets(ctx, x.size(0)));
}

void DenseFfn::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x) {
  mlp.backward(ctx, dx, dout, x, offsets(ctx, x.size(0)), false);
}

void DenseFfn::collect_weights(std::vector<WeightSlot>& out) {
  const bool fp8 = mlp.gate_up.dtype() == DType::kU8;
  out.push_back({mlp.prefix(), &mlp.gate_up, WeightLayout::kSwigluGateUp, 0, fp8 ? &mlp.gate_up_scale : nullptr});
  out.push_back({mlp.prefix(), &mlp.down, WeightLayout::kSwigluDown, 0, fp8 ? &mlp.down_scale : nullptr});
}

}  // namespace moetrain
