#include "core/model/lora_linear.h"

#include <cmath>

#include "core/base/host_convert.h"
#include "core/model/fp8_storage.h"

namespace moetrain {

using kernels::GemmArgs;

double LoraSettings::scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

std::unique_ptr<LoraAdapter> make_lora_adapter(const std::string& prefix, int64_t in, int64_t out,
                                               const LoraSettings& settings, DType dtype, Allocator& allocator,
                                               kernels::Backend& backend, std::mt19937_64& rng) {
  auto adapter = std::make_unique<LoraAdapter>();
  adapter->scale = settings.scale();
  adapter->a.name = prefix + ".lora_A.weight";
  adapter->b.name = prefix + ".lora_B.weight";
  adapter->a.value = Tensor({settings.rank, in}, dtype, allocator);
  adapter->b.value = Tensor({out, settings.rank}, dtype, allocator);
  adapter->a.grad = Tensor({settings.rank, in}, dtype, allocator);
  adapter->b.grad = Tensor({out, settings.rank}, dtype, allocator);

  // kaiming_uniform_(a=sqrt(5)) on [rank, in] has bound 1/sqrt(in). Drawn on the host from the
  // 53 top bits of the generator so the values do not depend on the standard library.
  Tensor host_a({settings.rank, in}, DType::kF64);
  double bound = 1.0 / std::sqrt(static_cast<double>(in));
  double* values = host_a.ptr<double>();
  for (int64_t i = 0; i < host_a.numel(); ++i) {
    double unit = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    values[i] = (2.0 * unit - 1.0) * bound;
  }
  Tensor staged({settings.rank, in}, dtype);
  convert_host(staged, host_a);
  backend.copy(adapter->a.value, staged);
  backend.fill(adapter->b.value, 0.0);
  backend.fill(adapter->a.grad, 0.0);
  backend.fill(adapter->b.grad, 0.0);
  return adapter;
}

void LoraLinear::alloc_weight(const LayerContext& ctx, const ModelConfig& config) {
  alloc_frozen_weight(ctx, {out_, in_}, keeps_fp8(config, name_), weight, weight_scale);
}

WeightSlot LoraLinear::weight_slot() {
  return {name_ + ".weight", &weight, WeightLayout::kPlain, 0, weight.dtype() == DType::kU8 ? &weight_scale : nullptr};
}

void LoraLinear::forward(const LayerContext& ctx, const TensorView& y, const TensorView& x) const {
  int64_t rows = x.size(0);
  frozen_gemm(ctx.backend, GemmArgs{y, x, weight, false, true, 1.0, 0.0}, weight_scale);
  if (!lora) return;
  Tensor xa = ctx.alloc({rows, lora->a.value.size(0)});
  ctx.backend.gemm(GemmArgs{xa, x, lora->a.value, false, true, 1.0, 0.0});
  ctx.backend.gemm(GemmArgs{y, xa, lora->b.value, false, true, lora->scale, 1.0});
}

void LoraLinear::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dy, const TensorView& x,
                          bool accumulate_dx) const {
  if (dx.data) frozen_gemm(ctx.backend, GemmArgs{dx, dy, weight, false, false, 1.0, accumulate_dx ? 1.0 : 0.0}, weight_scale);
  if (!lora) return;
  int64_t rows = x.size(0);
  int64_t rank = lora->a.value.size(0);
  // y += s * (x A^T) B^T  =>  dB += s * dy^T (x A^T),  dA += s * (dy B)^T x,  dx += s * (dy B) A
  Tensor xa = ctx.alloc({rows, rank});
  ctx.backend.gemm(GemmArgs{xa, x, lora->a.value, false, true, 1.0, 0.0});
  ctx.backend.gemm(GemmArgs{lora->b.grad, dy, xa, true, false, lora->scale, 1.0});
  Tensor dy_b = ctx.alloc({rows, rank});
  ctx.backend.gemm(GemmArgs{dy_b, dy, lora->b.value, false, false, 1.0, 0.0});
  ctx.backend.gemm(GemmArgs{lora->a.grad, dy_b, x, true, false, lora->scale, 1.0});
  if (dx.data) ctx.backend.gemm(GemmArgs{dx, dy_b, lora->a.value, false, false, lora->scale, 1.0});
}

void LoraLinear::collect_parameters(std::vector<Parameter*>& out) {
  if (!lora) return;
  out.push_back(&lora->a);
  out.push_back(&lora->b);
}

}  // namespace moetrain
