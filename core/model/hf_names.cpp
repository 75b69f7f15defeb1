#include "core/model/hf_names.h"

#include <utility>

namespace moetrain {
namespace {

// Our module name -> transformers 5's, for the Kimi-Linear modules that differ (transformers 5.17
// keeps the forget gate's projections, A_log and dt_bias in a `forget_gate` submodule).
const std::pair<const char*, const char*> kTransformersModules[] = {
    {".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj"},
    {".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj"},
};

// `name` with its first `from` (a whole dotted component run) replaced by `to`; empty if absent.
std::string replace_component(const std::string& name, const std::string& from, const std::string& to) {
  for (size_t at = name.find(from); at != std::string::npos; at = name.find(from, at + 1)) {
    const size_t end = at + from.size();
    if (end == name.size() || name[end] == '.') return name.substr(0, at) + to + name.substr(end);
  }
  return "";
}

HfPiece whole(const std::string& name, const Shape& shape, bool any_layout = false) {
  return HfPiece{name, shape, any_layout, 0, -1, 0, shape.numel()};
}

// `parts` stacked along the leading dimension (q, k, v into one fused tensor).
HfLayout stacked(const std::string& prefix, const std::vector<std::string>& parts, const std::string& suffix,
                 const Shape& shape, bool any_layout) {
  const int64_t rows = shape[0] / static_cast<int64_t>(parts.size());
  Shape part_shape = shape;
  part_shape[0] = rows;
  HfLayout layout;
  for (size_t j = 0; j < parts.size(); ++j) {
    HfPiece piece = whole(prefix + parts[j] + suffix, part_shape, any_layout);
    piece.offset = static_cast<int64_t>(j) * part_shape.numel();
    layout.push_back(piece);
  }
  return layout;
}

// The KDA weights whose storage differs between writers (hf_names.h).
std::vector<HfLayout> kda_layouts(const std::string& name, const Shape& shape) {
  const size_t at = name.rfind(".self_attn.");
  if (at == std::string::npos) return {};
  const std::string prefix = name.substr(0, at + 11);
  const std::string leaf = name.substr(at + 11);
  if (leaf == "A_log" || leaf == "dt_bias") {
    HfPiece released = whole(name, shape, true);
    released.zero_padded = leaf == "A_log";
    return {{released}, {whole(prefix + "forget_gate." + leaf, shape, true)}};
  }
  for (int64_t j = 0; j < 3; ++j) {
    if (leaf != std::string(1, "qkv"[j]) + "_conv1d.weight") continue;
    HfPiece packed = whole(prefix + "conv1d.weight", shape, true);
    packed.first_row = j * shape[0];
    packed.rows = shape[0];
    return {{whole(name, shape, true)}, {packed}};
  }
  if (leaf == "qkv_conv1d.weight") {
    return {{whole(name, shape, true)},
            {whole(prefix + "conv1d.weight", shape, true)},
            stacked(prefix, {"q_conv1d", "k_conv1d", "v_conv1d"}, ".weight", shape, true)};
  }
  if (leaf == "qkv_proj.weight") {
    return {{whole(name, shape)}, stacked(prefix, {"q_proj", "k_proj", "v_proj"}, ".weight", shape, false)};
  }
  return {};
}

}  // namespace

std::string transformers_module_name(const std::string& ours) {
  for (const auto& [from, to] : kTransformersModules) {
    std::string renamed = replace_component(ours, from, to);
    if (!renamed.empty()) return renamed;
  }
  return ours;
}

HfPiece hf_piece(const std::string& name, const Shape& shape, int64_t offset) {
  HfPiece piece = whole(name, shape);
  piece.offset = offset;
  return piece;
}

std::vector<HfLayout> hf_layouts(const HfLayout& ours) {
  std::vector<HfLayout> layouts;
  if (ours.size() == 1) {
    const std::string& name = ours[0].name;
    layouts = kda_layouts(name, ours[0].shape);
    const std::string renamed = transformers_module_name(name);
    if (renamed != name) layouts.push_back({whole(renamed, ours[0].shape)});
  }
  if (layouts.empty() || layouts[0].size() != ours.size() || layouts[0][0].name != ours[0].name) {
    layouts.insert(layouts.begin(), ours);
  }
  // Moonshot's checkpoints keep the MoE layers' router and shared experts under block_sparse_moe.
  const size_t count = layouts.size();
  for (size_t i = 0; i < count; ++i) {
    HfLayout moe = layouts[i];
    bool all = true;
    for (HfPiece& piece : moe) {
      piece.name = replace_component(piece.name, ".mlp", ".block_sparse_moe");
      all = all && !piece.name.empty();
    }
    if (all) layouts.push_back(moe);
  }
  return layouts;
}

std::vector<std::string> hf_expert_names(const std::string& experts, int64_t e, const std::string& projection) {
  const std::string index = std::to_string(e);
  std::vector<std::string> names = {experts + "." + index + "." + projection + ".weight"};
  const std::string moe = replace_component(experts, ".mlp", ".block_sparse_moe");
  if (!moe.empty()) {
    const char* w = projection == "gate_proj" ? "w1" : projection == "up_proj" ? "w3" : "w2";
    names.push_back(moe + "." + index + "." + w + ".weight");
  }
  return names;
}

}  // namespace moetrain
