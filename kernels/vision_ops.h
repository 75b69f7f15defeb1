// The ops of Kimi K3's MoonViT vision tower and its projector (NeMo AutoModel
// `kimi_k3/vision.py`; docs/HF_SEMANTICS.md, "Kimi K3 vision"), part of the op interface of
// kernels/ops.h, which includes this file. The tower's blocks reuse gemm, rmsnorm, rope
// (RopeLayout::kAdjacent) and attention (non-causal); the ops here are what they lack.
#pragma once

#include <cstdint>

#include "core/base/tensor.h"

namespace moetrain::kernels {

// GELU, elementwise: y = x * Phi(x) (kExact, torch's nn.GELU()), or the tanh form
// y = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (kTanh, GELU(approximate="tanh"), the
// tower's MLP). y may alias x.
enum class GeluApproximation { kExact, kTanh };
struct GeluArgs {
  TensorView y;  // [rows, width]
  TensorView x;  // [rows, width]
  GeluApproximation approximation = GeluApproximation::kExact;
};
// dx = dy * gelu'(x), overwritten; dx may alias dy.
struct GeluBackwardArgs {
  TensorView dx;
  TensorView dy;
  TensorView x;
  GeluApproximation approximation = GeluApproximation::kExact;
};

// The tower's position embedding for one image (or video) of `frames` x `height` x `width`
// patches in raster order (frame, row, column), added into x [frames * height * width, dim]:
//   x[(f, r, c)] += bilinear(table, height, width)[r, c] + (frames > 1 ? time[f] : 0)
// table [table_height, table_width, dim] is the learned grid, resized to height x width as
// F.interpolate(mode="bilinear", align_corners=False) does (no antialias; a source coordinate
// (i + 0.5) * in / out - 0.5 clamped below at 0, its neighbour clamped at in - 1); an image of
// the table's own size takes it unchanged. time [>= frames, dim] is the fixed sin-cos table, read
// only when frames > 1 (a single frame gets no time term at all). The table is frozen: no backward.
struct VisionPosEmbedArgs {
  TensorView x;
  TensorView table;
  TensorView time;  // may be empty when frames == 1
  int64_t frames = 1;
  int64_t height = 0;
  int64_t width = 0;
};

// The tower's patch merger for one image ("sd2_tpool"): the mean over frames, then each
// merge_height x merge_width neighbourhood concatenated into one row, neighbours in raster order:
//   out[i * (width / mw) + j, (a * mw + b) * dim + d] = mean_f x[(f, i * mh + a, j * mw + b), d]
// x [frames * height * width, dim]; out [(height / mh) * (width / mw), mh * mw * dim], overwritten.
// height and width are multiples of the merge kernel. Forward only (the tower is frozen).
struct PatchMergeArgs {
  TensorView out;
  TensorView x;
  int64_t frames = 1;
  int64_t height = 0;
  int64_t width = 0;
  int64_t merge_height = 2;
  int64_t merge_width = 2;
};

}  // namespace moetrain::kernels
