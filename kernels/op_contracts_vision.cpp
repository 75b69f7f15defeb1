// The argument contracts of the vision tower's ops (kernels/vision_ops.h), in the manner of
// kernels/op_contracts.cpp: operands in the CPU reference's order, then shapes, then aliasing.
#include <string>

#include "kernels/arg_checks.h"
#include "kernels/op_contracts.h"

namespace moetrain::kernels {
namespace {

std::string grid_text(int64_t frames, int64_t height, int64_t width) {
  return "grid (" + std::to_string(frames) + ", " + std::to_string(height) + ", " + std::to_string(width) + ")";
}

// x [frames * height * width, dim] of a grid with positive sides.
void expect_grid_rows(const char* op, const char* name, const TensorView& x, int64_t frames, int64_t height,
                      int64_t width) {
  expect(frames >= 1 && height >= 1 && width >= 1, op, grid_text(frames, height, width) + " has an empty side");
  expect_ndim(op, name, x, 2);
  expect(x.size(0) == frames * height * width, op,
         describe(name, x) + " should have " + std::to_string(frames * height * width) + " rows for " +
             grid_text(frames, height, width));
}

}  // namespace

void check_gelu_forward(OperandRules& rules, const GeluArgs& args) {
  const char* op = "gelu_forward";
  rules.activation(op, "y", args.y);
  rules.activation(op, "x", args.x);
  expect_shape(op, "y", args.y, args.x.shape);
  expect(args.y.data != args.x.data || args.y.dtype == args.x.dtype, op, "y aliases x with another dtype");
}

void check_gelu_backward(OperandRules& rules, const GeluBackwardArgs& args) {
  const char* op = "gelu_backward";
  rules.activation(op, "dx", args.dx);
  rules.activation(op, "dy", args.dy);
  rules.activation(op, "x", args.x);
  expect_shape(op, "dy", args.dy, args.x.shape);
  expect_shape(op, "dx", args.dx, args.x.shape);
  expect(args.dx.data != args.dy.data || args.dx.dtype == args.dy.dtype, op, "dx aliases dy with another dtype");
  expect(args.dx.data != args.x.data || args.x.numel() == 0, op, "dx must not overwrite x");
}

void check_vision_pos_embed(OperandRules& rules, const VisionPosEmbedArgs& args) {
  const char* op = "vision_pos_embed";
  rules.activation(op, "x", args.x);
  rules.activation(op, "table", args.table);
  expect_grid_rows(op, "x", args.x, args.frames, args.height, args.width);
  expect_ndim(op, "table", args.table, 3);
  expect(args.table.size(2) == args.x.size(1), op,
         describe("table", args.table) + " should be [height, width, " + std::to_string(args.x.size(1)) + "]");
  if (args.frames > 1) {
    rules.activation(op, "time", args.time);
    expect_ndim(op, "time", args.time, 2);
    expect(args.time.size(0) >= args.frames && args.time.size(1) == args.x.size(1), op,
           describe("time", args.time) + " should be [at least " + std::to_string(args.frames) + " frames, " +
               std::to_string(args.x.size(1)) + "]");
  }
}

void check_patch_merge(OperandRules& rules, const PatchMergeArgs& args) {
  const char* op = "patch_merge";
  rules.activation(op, "out", args.out);
  rules.activation(op, "x", args.x);
  expect_grid_rows(op, "x", args.x, args.frames, args.height, args.width);
  const int64_t mh = args.merge_height, mw = args.merge_width;
  expect(mh >= 1 && mw >= 1 && args.height % mh == 0 && args.width % mw == 0, op,
         grid_text(args.frames, args.height, args.width) + " is not a multiple of the merge kernel " +
             std::to_string(mh) + " x " + std::to_string(mw));
  if (mh < 1 || mw < 1) return;
  expect_shape(op, "out", args.out, Shape({(args.height / mh) * (args.width / mw), mh * mw * args.x.size(1)}));
  expect(args.out.data != args.x.data || args.x.numel() == 0, op, "out must not overwrite x");
}

}  // namespace moetrain::kernels
