// Where a weight of ours lives in a Hugging Face checkpoint, and what a module is called there.
//
// Our names are the released checkpoints' (DeepSeek-V3's, Moonshot's Kimi-Linear). transformers 5
// (5.17, read off its modeling_kimi_linear.py) spells some Kimi-Linear modules differently in
// memory, which is what it saves with `save_original_format=False` and what PEFT adapters on it
// are keyed by:
//   ours (released)                      transformers 5
//   self_attn.f_a_proj / f_b_proj        self_attn.forget_gate.f_a_proj / forget_gate.f_b_proj
//   self_attn.A_log / dt_bias            self_attn.forget_gate.A_log [1, 1, H, 1] / forget_gate.dt_bias [H d]
//   self_attn.{q,k,v}_conv1d [C, 1, W]   self_attn.conv1d [3C, 1, W] (q, k, v stacked)
//   block_sparse_moe.{gate,shared_experts}.*       mlp.*
//   block_sparse_moe.experts.<e>.w1 / w3 / w2      mlp.experts.gate_up_proj / down_proj (fused)
// The loader tries each layout in turn (docs/HF_SEMANTICS.md).
#pragma once

#include <string>
#include <vector>

#include "core/base/tensor.h"

namespace moetrain {

// One checkpoint tensor, or the block of its rows (leading dimension) [first_row, first_row +
// rows), filling elements [offset, offset + numel) of a weight's flattened values.
struct HfPiece {
  std::string name;
  Shape shape;              // the tensor's shape, checked unless any_layout
  bool any_layout = false;  // any shape with the right element count (A_log, dt_bias, convs)
  int64_t first_row = 0;    // rows of the stored tensor; with any_layout, rows of its leading dim
  int64_t rows = -1;        // -1: all of them
  int64_t offset = 0;
  int64_t numel = 0;
  // A vector that may hold more elements than numel, the extra ones zero: Kimi K3 stores A_log
  // zero-padded to a multiple of 128 heads (96 real). Its first numel elements are read.
  bool zero_padded = false;
};
using HfLayout = std::vector<HfPiece>;

// The whole tensor `name` of `shape` at `offset` (our own layout of a weight is made of these).
HfPiece hf_piece(const std::string& name, const Shape& shape, int64_t offset = 0);

// The layouts a weight stored as `ours` (in our names) may have in a checkpoint, `ours` first.
std::vector<HfLayout> hf_layouts(const HfLayout& ours);

// A routed expert's projection `projection` (gate_proj | up_proj | down_proj) of expert `e`
// under the module `experts` (model.layers.L.mlp.experts): the per-expert tensor names, ours
// first (mlp.experts.<e>.up_proj.weight, then block_sparse_moe.experts.<e>.w3.weight).
std::vector<std::string> hf_expert_names(const std::string& experts, int64_t e, const std::string& projection);

// transformers 5's spelling of a module of ours (e.g. ...self_attn.f_a_proj ->
// ...self_attn.forget_gate_down), or the name itself when both agree.
std::string transformers_module_name(const std::string& ours);

}  // namespace moetrain
