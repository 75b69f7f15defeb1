// model.weight_format: fp8 (docs/CONFIG.md): which frozen weights stay in FP8 (E4M3 codes and an F32
// scale per 128 x 128 block, kernels/fp8_format.h) and the GEMM that takes a frozen weight in
// either format. FP8 are the weights an FP8 release quantizes: the MLA / DSA projections, the
// DSA indexer's wq_b and wk, the dense MLP and the shared and routed experts, less the modules its
// quantization_config.modules_to_not_convert names, and SwiGLU weights not in whole blocks
// (fp8_stacks) or DSA kv_b_proj heads not in whole blocks (DsaAttention); embeddings, norms, the
// router and lm_head (and KDA layers and the latent MoE's projections, which no FP8 release has)
// stay in the working dtype.
#pragma once

#include <string>

#include "core/config/config.h"
#include "core/model/layer_context.h"

namespace moetrain {

// Whether the frozen weight of HF module `module` (model.layers.3.self_attn.q_b_proj) is FP8.
bool keeps_fp8(const ModelConfig& m, const std::string& module);

// A SwiGLU network of this width keeps its weights in FP8 only when gate_proj over up_proj
// stacks in whole 128-row blocks (width % 128 == 0, as in every FP8 release); otherwise they stay
// in the working dtype (an FP8 checkpoint's are dequantized at load).
inline bool fp8_stacks(int64_t width) { return width % 128 == 0; }

// Allocates a frozen weight of `shape` ([rows, cols], or [G, rows, cols] for experts): in the
// working dtype, or with fp8 as U8 codes of `shape` into `weight` and its F32 block scales
// [..., ceil(rows / 128), ceil(cols / 128)] into `scale`.
void alloc_frozen_weight(const LayerContext& ctx, const Shape& shape, bool fp8, Tensor& weight, Tensor& scale);

// args.b is a frozen weight: gemm, or gemm_fp8 with `scale` when it is FP8 (U8 codes).
void frozen_gemm(kernels::Backend& backend, const kernels::GemmArgs& args, const TensorView& scale);

// Rows [begin, end) of an FP8 weight's codes and the scale rows of their blocks (begin a multiple
// of 128): a weight of its own, for the products DSA runs on one head's rows of kv_b_proj. A
// working-dtype weight's rows come with no scale.
struct FrozenRows {
  TensorView weight;
  TensorView scale;
};
FrozenRows frozen_rows(const Tensor& weight, const Tensor& scale, int64_t begin, int64_t end);

}  // namespace moetrain
