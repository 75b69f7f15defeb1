#include "core/model/fp8_storage.h"

#include "core/io/fp8_block.h"
#include "kernels/fp8_format.h"

namespace moetrain {

bool keeps_fp8(const ModelConfig& m, const std::string& module) {
  if (m.weight_format != "fp8") return false;
  Fp8BlockQuantization quantization;
  quantization.format = Fp8Format::kE4M3;
  quantization.modules_to_not_convert = m.fp8_modules_to_not_convert;
  return quantization.converts(module);
}

void alloc_frozen_weight(const LayerContext& ctx, const Shape& shape, bool fp8, Tensor& weight, Tensor& scale) {
  if (!fp8) {
    weight = ctx.alloc(shape);
    return;
  }
  Shape blocks = shape;
  const int64_t n = shape.ndim();
  blocks[n - 2] = kernels::fp8_blocks(shape[n - 2]);
  blocks[n - 1] = kernels::fp8_blocks(shape[n - 1]);
  weight = ctx.alloc(shape, DType::kU8);
  scale = ctx.alloc(blocks, DType::kF32);
}

void frozen_gemm(kernels::Backend& backend, const kernels::GemmArgs& args, const TensorView& scale) {
  if (args.b.dtype == DType::kU8) {
    backend.gemm_fp8(kernels::GemmFp8Args{args, scale});
  } else {
    backend.gemm(args);
  }
}

FrozenRows frozen_rows(const Tensor& weight, const Tensor& scale, int64_t begin, int64_t end) {
  if (weight.dtype() != DType::kU8) return {weight.view().slice_rows(begin, end), TensorView()};
  MOETRAIN_ASSERT(begin % kernels::kFp8BlockSize == 0, "FP8 weight rows from " + std::to_string(begin) +
                                                           " do not start a 128-row block");
  return {weight.view().slice_rows(begin, end),
          scale.view().slice_rows(begin / kernels::kFp8BlockSize, kernels::fp8_blocks(end))};
}

}  // namespace moetrain
