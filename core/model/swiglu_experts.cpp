#include "core/model/swiglu_experts.h"

namespace moetrain {

using kernels::GroupedGemmArgs;
using kernels::GroupedGemmKind;

GatedActivation gated_activation_of(const ModelConfig& model) {
  return GatedActivation{model.hidden_act == "situ", model.situ_beta, model.situ_linear_beta};
}

namespace {

// A grouped GEMM of `kind` over the row groups of `offsets`.
GroupedGemmArgs grouped_gemm(GroupedGemmKind kind, TensorView c, TensorView a, TensorView b, const GroupOffsets& offsets,
                             bool transpose_b, double alpha, double beta) {
  GroupedGemmArgs args;
  args.kind = kind;
  args.c = c;
  args.a = a;
  args.b = b;
  args.group_offsets = offsets.device;
  args.host_group_offsets = offsets.host;
  args.transpose_b = transpose_b;
  args.alpha = alpha;
  args.beta = beta;
  return args;
}

// c[rows_g] = alpha * a[rows_g] op(b[g]) + beta * c[rows_g].
GroupedGemmArgs grouped(TensorView c, TensorView a, TensorView b, const GroupOffsets& offsets, bool transpose_b,
                        double alpha = 1.0, double beta = 0.0) {
  return grouped_gemm(GroupedGemmKind::kMGrouped, c, a, b, offsets, transpose_b, alpha, beta);
}

// The grouped GEMM on a base weight, with its MXFP4 or FP8 scales when it is held packed.
GroupedGemmArgs with_scale(GroupedGemmArgs args, const Tensor& scale) {
  if (scale.defined()) args.b_scale = scale;
  return args;
}

// c[g] = alpha * a[rows_g]^T b[rows_g] + beta * c[g]: the per-group weight gradient.
GroupedGemmArgs k_grouped(TensorView c, TensorView a, TensorView b, const GroupOffsets& offsets, double alpha,
                          double beta) {
  return grouped_gemm(GroupedGemmKind::kKGrouped, c, a, b, offsets, GroupedGemmArgs{}.transpose_b, alpha, beta);
}

}  // namespace

const char* SwigluExperts::projection_name(Projection p) {
  switch (p) {
    case kGate: return "gate_proj";
    case kUp: return "up_proj";
    case kDown: return "down_proj";
  }
  return "?";
}

LoraSettings fused_gate_up_settings(const LoraSettings& lora) {
  return LoraSettings{2 * lora.rank, 2.0 * lora.alpha, lora.rslora};
}

void SwigluExperts::add_lora(Projection p, const LoraSettings& settings, DType dtype, kernels::Backend& backend,
                             uint64_t seed) {
  MOETRAIN_ASSERT(!gate_up_lora || p == kDown, prefix_ + ": gate/up adapters next to a fused gate_up adapter");
  int64_t in = p == kDown ? width_ : hidden_;
  int64_t out = p == kDown ? hidden_ : width_;
  lora[p] = make_adapter(prefix_ + "." + projection_name(p), in, out, settings, dtype, backend, seed);
}

void SwigluExperts::add_fused_gate_up_lora(const LoraSettings& settings, DType dtype, kernels::Backend& backend,
                                           uint64_t seed) {
  add_gate_up_lora(fused_gate_up_settings(settings), dtype, backend, seed);
}

void SwigluExperts::add_gate_up_lora(const LoraSettings& settings, DType dtype, kernels::Backend& backend,
                                     uint64_t seed) {
  MOETRAIN_ASSERT(routed_ && !lora[kGate] && !lora[kUp], prefix_ + ": a fused gate_up adapter is for routed experts "
                                                                   "without gate/up adapters");
  gate_up_lora = make_adapter(prefix_ + ".gate_up_proj", hidden_, 2 * width_, settings, dtype, backend, seed);
}

std::unique_ptr<LoraAdapter> SwigluExperts::make_adapter(const std::string& name, int64_t in, int64_t out,
                                                         const LoraSettings& settings, DType dtype,
                                                         kernels::Backend& backend, uint64_t seed) const {
  auto group_rng = [&](int64_t g) { return std::mt19937_64(seed ^ (0x9e3779b97f4a7c15ull * (first_group_ + g + 1))); };
  if (!routed_) {
    auto rng = group_rng(0);
    return make_lora_adapter(name, in, out, settings, dtype, backend.allocator(), backend, rng);
  }
  if (shared_lora_a) {  // one A [r, in] for every expert (the same on every rank), B per expert
    std::mt19937_64 rng(seed);
    auto adapter = make_lora_adapter(name, in, out, settings, dtype, backend.allocator(), backend, rng);
    adapter->b.value = Tensor({groups_, out, settings.rank}, dtype, backend.allocator());
    adapter->b.grad = Tensor({groups_, out, settings.rank}, dtype, backend.allocator());
    backend.fill(adapter->b.value, 0.0);
    backend.fill(adapter->b.grad, 0.0);
    return adapter;
  }
  // Stacked: one adapter per expert.
  auto adapter = std::make_unique<LoraAdapter>();
  adapter->scale = settings.scale();
  adapter->a.name = name + ".lora_A.weight";
  adapter->b.name = name + ".lora_B.weight";
  adapter->a.value = Tensor({groups_, settings.rank, in}, dtype, backend.allocator());
  adapter->b.value = Tensor({groups_, out, settings.rank}, dtype, backend.allocator());
  adapter->a.grad = Tensor({groups_, settings.rank, in}, dtype, backend.allocator());
  adapter->b.grad = Tensor({groups_, out, settings.rank}, dtype, backend.allocator());
  for (int64_t g = 0; g < groups_; ++g) {
    auto rng = group_rng(g);
    auto one = make_lora_adapter(name, in, out, settings, dtype, backend.allocator(), backend, rng);
    backend.copy(adapter->a.value.view().slice_rows(g, g + 1).reshaped({settings.rank, in}), one->a.value);
  }
  backend.fill(adapter->b.value, 0.0);
  backend.fill(adapter->a.grad, 0.0);
  backend.fill(adapter->b.grad, 0.0);
  return adapter;
}

bool SwigluExperts::shares_a(const LoraAdapter& adapter) const { return routed_ && adapter.a.value.shape().ndim() == 2; }

std::vector<SwigluExperts::PackedLora::Part> SwigluExperts::lora_parts(bool gate_up_output) const {
  std::vector<PackedLora::Part> parts;
  if (!gate_up_output) {
    if (lora[kDown]) parts.push_back({lora[kDown].get(), 0, 0});
    return parts;
  }
  if (gate_up_lora) {
    parts.push_back({gate_up_lora.get(), 0, 0});
    return parts;
  }
  int64_t rank = 0;
  for (Projection p : {kGate, kUp}) {
    if (!lora[p]) continue;
    parts.push_back({lora[p].get(), p == kGate ? 0 : width_, rank});
    rank += lora[p]->a.value.size(-2);
  }
  return parts;
}

void SwigluExperts::pack_lora(const LayerContext& ctx, PackedLora& packed, std::vector<PackedLora::Part> parts,
                              int64_t in, int64_t out) const {
  kernels::Backend& be = ctx.backend;
  packed = PackedLora{};
  if (parts.empty()) return;
  packed.parts = std::move(parts);
  for (const auto& part : packed.parts) packed.rank += part.adapter->a.value.size(-2);
  packed.shared_a = shares_a(*packed.parts[0].adapter);
  const int64_t a_batch = packed.shared_a ? 1 : groups_;
  packed.a = ctx.alloc({a_batch, packed.rank, in});
  packed.b = ctx.alloc({groups_, out, packed.rank});
  const LoraAdapter& first = *packed.parts[0].adapter;
  if (packed.parts.size() > 1 || first.b.value.size(-2) != out) be.fill(packed.b, 0.0);  // off the blocks
  for (const auto& part : packed.parts) {
    const LoraAdapter& ad = *part.adapter;
    const int64_t r = ad.a.value.size(-2), part_out = ad.b.value.size(-2);
    be.copy_block({packed.a, ad.a.value.view().reshaped({a_batch, r, in}), part.rank_col, 0, 0, 0, r, in, 1.0, false});
    be.copy_block({packed.b, ad.b.value.view().reshaped({groups_, part_out, r}), part.out_row, part.rank_col, 0, 0,
                   part_out, r, ad.scale, false});
  }
}

void SwigluExperts::lora_input(const LayerContext& ctx, PackedLora& packed, const TensorView& x,
                               const GroupOffsets& offsets) const {
  if (packed.parts.empty()) return;
  kernels::Backend& be = ctx.backend;
  const int64_t in = x.size(1);
  packed.x_a = ctx.alloc({x.size(0), packed.rank});
  if (packed.shared_a) {  // every row meets the same A: one dense GEMM over all groups' rows
    be.gemm(kernels::GemmArgs{packed.x_a, x, packed.a.view().reshaped({packed.rank, in}), false, true, 1.0, 0.0});
  } else {
    be.grouped_gemm(grouped(packed.x_a, x, packed.a, offsets, true));
  }
}

void SwigluExperts::project(kernels::Backend& be, GroupedGemmArgs base, const PackedLora& packed,
                            const TensorView& lora_in, bool forward) const {
  if (packed.parts.empty()) {
    be.grouped_gemm(base);
    return;
  }
  // Forward the LoRA term is lora_in (s B)^T, backward lora_in A: with a BF16 weight it joins the
  // base GEMM as more inner terms (no pass of its own over c); an MXFP4 weight's kernel has no
  // second product, and a shared A is one matrix for every group, so those take a GEMM of their own.
  const TensorView second_b = forward ? packed.b.view() : packed.a.view();
  if (!base.b_scale.data && (forward || !packed.shared_a)) {
    base.a2 = lora_in;
    base.b2 = second_b;
    be.grouped_gemm(base);
    return;
  }
  be.grouped_gemm(base);
  if (!forward && packed.shared_a) {
    be.gemm(kernels::GemmArgs{base.c, lora_in, second_b.reshaped({packed.rank, second_b.size(2)}), false, false,
                              1.0, 1.0});
  } else {
    GroupedGemmArgs lora_term = base;
    lora_term.a = lora_in;
    lora_term.b = second_b;
    lora_term.b_scale = TensorView();
    lora_term.alpha = 1.0;
    lora_term.beta = 1.0;
    be.grouped_gemm(lora_term);
  }
}

Tensor SwigluExperts::lora_dy_b(const LayerContext& ctx, const PackedLora& packed, const TensorView& dy,
                                const GroupOffsets& offsets) const {
  if (packed.parts.empty()) return Tensor();
  Tensor dy_b = ctx.alloc({dy.size(0), packed.rank});
  ctx.backend.grouped_gemm(grouped(dy_b, dy, packed.b, offsets, false));
  return dy_b;
}

void SwigluExperts::lora_gradients(const LayerContext& ctx, const PackedLora& packed, const TensorView& dy_b,
                                   const TensorView& dy, const TensorView& x, const GroupOffsets& offsets) const {
  if (packed.parts.empty()) return;
  kernels::Backend& be = ctx.backend;
  const int64_t in = x.size(1), out = dy.size(1), rank = packed.rank;
  const int64_t a_batch = packed.a.size(0);
  // One adapter on the whole output takes its gradients directly; several go through a buffer
  // the size of the packed tensors, from which each takes its blocks.
  const LoraAdapter& first = *packed.parts[0].adapter;
  const bool whole = packed.parts.size() == 1 && first.b.value.size(-2) == out;
  // A: dA += dy_b^T x per group (summed over the groups when A is shared).
  Tensor a_buffer = whole ? Tensor() : ctx.alloc_accum({a_batch, rank, in});
  const TensorView da = whole ? first.a.grad.view().reshaped({a_batch, rank, in}) : a_buffer.view();
  const double beta = whole ? 1.0 : 0.0;
  if (packed.shared_a) {
    be.gemm(kernels::GemmArgs{da.reshaped({rank, in}), dy_b, x, true, false, 1.0, beta});
  } else {
    be.grouped_gemm(k_grouped(da, dy_b, x, offsets, 1.0, beta));
  }
  // B: dB += s dy^T (x A^T) per group.
  Tensor b_buffer = whole ? Tensor() : ctx.alloc_accum({groups_, out, rank});
  const TensorView db = whole ? first.b.grad.view().reshaped({groups_, out, rank}) : b_buffer.view();
  be.grouped_gemm(k_grouped(db, dy, packed.x_a, offsets, whole ? first.scale : 1.0, beta));
  if (whole) return;
  for (const auto& part : packed.parts) {
    LoraAdapter& ad = *part.adapter;
    const int64_t r = ad.a.value.size(-2), part_out = ad.b.value.size(-2);
    be.copy_block({ad.a.grad.view().reshaped({a_batch, r, in}), a_buffer, 0, 0, part.rank_col, 0, r, in, 1.0, true});
    be.copy_block({ad.b.grad.view().reshaped({groups_, part_out, r}), b_buffer, 0, 0, part.out_row, part.rank_col,
                   part_out, r, ad.scale, true});
  }
}

void SwigluExperts::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x,
                            const GroupOffsets& group_offsets) {
  kernels::Backend& be = ctx.backend;
  int64_t rows = x.size(0);
  int64_t f = width_;
  if (!hold_packed_ || !packed_) {  // not held: every forward packs the current values
    pack_lora(ctx, gate_up_packed_, lora_parts(true), hidden_, 2 * f);
    pack_lora(ctx, down_packed_, lora_parts(false), f, hidden_);
    packed_ = true;
  }
  // gate_up = x Wgu^T + (x A^T) (s B)^T
  saved_gate_up_ = ctx.alloc({rows, 2 * f});
  lora_input(ctx, gate_up_packed_, x, group_offsets);
  project(be, with_scale(grouped(saved_gate_up_, x, gate_up, group_offsets, true), gate_up_scale), gate_up_packed_,
          gate_up_packed_.x_a, true);
  saved_hidden_ = ctx.alloc({rows, f});
  if (activation.situ) be.situ_forward({saved_hidden_, saved_gate_up_, activation.beta, activation.linear_beta});
  else be.swiglu_forward(saved_hidden_, saved_gate_up_);
  lora_input(ctx, down_packed_, saved_hidden_, group_offsets);
  project(be, with_scale(grouped(out, saved_hidden_, down, group_offsets, true), down_scale), down_packed_,
          down_packed_.x_a, true);
}

void SwigluExperts::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                             const TensorView& x, const GroupOffsets& group_offsets, bool accumulate_dx) {
  kernels::Backend& be = ctx.backend;
  int64_t rows = x.size(0);
  int64_t f = width_;
  // Down projection: dh = dout Wd + (dout s B) A.
  Tensor dh = ctx.alloc({rows, f});
  const Tensor dout_b = lora_dy_b(ctx, down_packed_, dout, group_offsets);
  project(be, with_scale(grouped(dh, dout, down, group_offsets, false), down_scale), down_packed_, dout_b, false);
  lora_gradients(ctx, down_packed_, dout_b, dout, saved_hidden_, group_offsets);
  Tensor dgate_up = ctx.alloc({rows, 2 * f});
  if (activation.situ) {
    be.situ_backward(kernels::SituBackwardArgs{dgate_up, dh, saved_gate_up_, activation.beta, activation.linear_beta});
  } else {
    be.swiglu_backward(kernels::SwigluBackwardArgs{dgate_up, dh, saved_gate_up_});
  }
  // Gate and up projections: dx (+)= dgate_up Wgu + (dgate_up s B) A.
  const Tensor dgate_up_b = lora_dy_b(ctx, gate_up_packed_, dgate_up, group_offsets);
  if (dx.data) {
    project(be,
            with_scale(grouped(dx, dgate_up, gate_up, group_offsets, false, 1.0, accumulate_dx ? 1.0 : 0.0),
                       gate_up_scale),
            gate_up_packed_, dgate_up_b, false);
  }
  lora_gradients(ctx, gate_up_packed_, dgate_up_b, dgate_up, x, group_offsets);
}

void SwigluExperts::release_saved() {
  saved_gate_up_.reset();
  saved_hidden_.reset();
  gate_up_packed_.x_a.reset();
  down_packed_.x_a.reset();
  if (!hold_packed_) hold_packed_lora(false);
}

void SwigluExperts::hold_packed_lora(bool hold) {
  hold_packed_ = hold;
  packed_ = false;
  gate_up_packed_ = PackedLora{};
  down_packed_ = PackedLora{};
}

void SwigluExperts::collect_parameters(std::vector<Parameter*>& out) {
  if (gate_up_lora) {  // where the gate and up adapters would be: gate_up, then down
    out.push_back(&gate_up_lora->a);
    out.push_back(&gate_up_lora->b);
  }
  for (auto& adapter : lora) {
    if (!adapter) continue;
    out.push_back(&adapter->a);
    out.push_back(&adapter->b);
  }
}

}  // namespace moetrain
