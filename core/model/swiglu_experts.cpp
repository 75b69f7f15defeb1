#include "core/model/swiglu_experts.h"

namespace moetrain {

using kernels::CopyColumnsArgs;
using kernels::GroupedGemmArgs;
using kernels::GroupedGemmKind;

GatedActivation gated_activation_of(const ModelConfig& model) {
  return GatedActivation{model.hidden_act == "situ", model.situ_beta, model.situ_linear_beta};
}

namespace {

GroupedGemmArgs grouped(TensorView c, TensorView a, TensorView b, const GroupOffsets& offsets, bool transpose_b,
                        double alpha = 1.0, double beta = 0.0) {
  GroupedGemmArgs args;
  args.kind = GroupedGemmKind::kMGrouped;
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

// The grouped GEMM on a base weight, with its MXFP4 scales when it is held packed.
GroupedGemmArgs with_scale(GroupedGemmArgs args, const Tensor& scale) {
  if (scale.defined()) args.b_scale = scale;
  return args;
}

// c[g] += alpha * a[rows_g]^T b[rows_g]: the per-group weight gradient.
GroupedGemmArgs k_grouped(TensorView c, TensorView a, TensorView b, const GroupOffsets& offsets, double alpha) {
  GroupedGemmArgs args;
  args.kind = GroupedGemmKind::kKGrouped;
  args.c = c;
  args.a = a;
  args.b = b;
  args.group_offsets = offsets.device;
  args.host_group_offsets = offsets.host;
  args.alpha = alpha;
  args.beta = 1.0;
  return args;
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

TensorView SwigluExperts::stacked_a(const LoraAdapter& adapter) const {
  const Tensor& a = adapter.a.value;
  return a.view().reshaped({groups_, a.size(-2), a.size(-1)});
}

TensorView SwigluExperts::stacked_b(const LoraAdapter& adapter) const {
  const Tensor& b = adapter.b.value;
  return b.view().reshaped({groups_, b.size(-2), b.size(-1)});
}

bool SwigluExperts::shares_a(const LoraAdapter& adapter) const { return routed_ && adapter.a.value.shape().ndim() == 2; }

void SwigluExperts::times_a(kernels::Backend& be, const TensorView& c, const TensorView& in, const LoraAdapter& adapter,
                            const GroupOffsets& offsets, bool a_transposed, double alpha, double beta) const {
  if (shares_a(adapter)) {  // every row meets the same A: one dense GEMM over all groups' rows
    be.gemm(kernels::GemmArgs{c, in, adapter.a.value, false, a_transposed, alpha, beta});
  } else {
    be.grouped_gemm(grouped(c, in, stacked_a(adapter), offsets, a_transposed, alpha, beta));
  }
}

void SwigluExperts::add_a_gradient(kernels::Backend& be, LoraAdapter& adapter, const TensorView& dy_b,
                                   const TensorView& in, const GroupOffsets& offsets) const {
  if (shares_a(adapter)) {  // the sum over the groups of their (dy B_g)^T x: one GEMM over all rows
    be.gemm(kernels::GemmArgs{adapter.a.grad, dy_b, in, true, false, adapter.scale, 1.0});
  } else {
    be.grouped_gemm(k_grouped(adapter.a.grad.view().reshaped(stacked_a(adapter).shape), dy_b, in, offsets, adapter.scale));
  }
}

void SwigluExperts::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x,
                            const GroupOffsets& group_offsets) {
  kernels::Backend& be = ctx.backend;
  int64_t rows = x.size(0);
  int64_t f = width_;
  saved_gate_up_ = ctx.alloc({rows, 2 * f});
  be.grouped_gemm(with_scale(grouped(saved_gate_up_, x, gate_up, group_offsets, true), gate_up_scale));
  for (Projection p : {kGate, kUp}) {
    if (!lora[p]) continue;
    int64_t rank = lora[p]->a.value.size(-2);
    Tensor xa = ctx.alloc({rows, rank});
    times_a(be, xa, x, *lora[p], group_offsets, true);
    Tensor delta = ctx.alloc({rows, f});
    be.grouped_gemm(grouped(delta, xa, stacked_b(p), group_offsets, true, lora[p]->scale));
    be.copy_columns(CopyColumnsArgs{saved_gate_up_, delta, p == kGate ? 0 : f, 0, f, 1, true});
  }
  if (gate_up_lora) {  // gate_up += s (x A^T) B^T over all 2F columns at once
    Tensor xa = ctx.alloc({rows, gate_up_lora->a.value.size(-2)});
    times_a(be, xa, x, *gate_up_lora, group_offsets, true);
    be.grouped_gemm(grouped(saved_gate_up_, xa, stacked_b(*gate_up_lora), group_offsets, true, gate_up_lora->scale, 1.0));
  }
  saved_hidden_ = ctx.alloc({rows, f});
  if (activation.situ) be.situ_forward({saved_hidden_, saved_gate_up_, activation.beta, activation.linear_beta});
  else be.swiglu_forward(saved_hidden_, saved_gate_up_);
  be.grouped_gemm(with_scale(grouped(out, saved_hidden_, down, group_offsets, true), down_scale));
  if (lora[kDown]) {
    int64_t rank = lora[kDown]->a.value.size(-2);
    Tensor ha = ctx.alloc({rows, rank});
    times_a(be, ha, saved_hidden_, *lora[kDown], group_offsets, true);
    be.grouped_gemm(grouped(out, ha, stacked_b(kDown), group_offsets, true, lora[kDown]->scale, 1.0));
  }
}

void SwigluExperts::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                             const TensorView& x, const GroupOffsets& group_offsets, bool accumulate_dx) {
  kernels::Backend& be = ctx.backend;
  int64_t rows = x.size(0);
  int64_t f = width_;
  // Down projection: dh = dout Wd (+ LoRA).
  Tensor dh = ctx.alloc({rows, f});
  be.grouped_gemm(with_scale(grouped(dh, dout, down, group_offsets, false), down_scale));
  if (lora[kDown]) {
    LoraAdapter& ad = *lora[kDown];
    int64_t rank = ad.a.value.size(-2);
    Tensor dout_b = ctx.alloc({rows, rank});
    be.grouped_gemm(grouped(dout_b, dout, stacked_b(kDown), group_offsets, false));
    times_a(be, dh, dout_b, ad, group_offsets, false, ad.scale, 1.0);
    add_a_gradient(be, ad, dout_b, saved_hidden_, group_offsets);
    Tensor ha = ctx.alloc({rows, rank});
    times_a(be, ha, saved_hidden_, ad, group_offsets, true);
    be.grouped_gemm(k_grouped(ad.b.grad.view().reshaped(stacked_b(kDown).shape), dout, ha, group_offsets, ad.scale));
  }
  Tensor dgate_up = ctx.alloc({rows, 2 * f});
  if (activation.situ) {
    be.situ_backward(kernels::SituBackwardArgs{dgate_up, dh, saved_gate_up_, activation.beta, activation.linear_beta});
  } else {
    be.swiglu_backward(kernels::SwigluBackwardArgs{dgate_up, dh, saved_gate_up_});
  }
  // Gate and up projections: dx = dgate_up Wgu (+ LoRA).
  if (dx.data) {
    be.grouped_gemm(
        with_scale(grouped(dx, dgate_up, gate_up, group_offsets, false, 1.0, accumulate_dx ? 1.0 : 0.0), gate_up_scale));
  }
  for (Projection p : {kGate, kUp}) {
    if (!lora[p]) continue;
    LoraAdapter& ad = *lora[p];
    int64_t rank = ad.a.value.size(-2);
    Tensor dpart = ctx.alloc({rows, f});
    be.copy_columns(CopyColumnsArgs{dpart, dgate_up, 0, p == kGate ? 0 : f, f, 1, false});
    Tensor dpart_b = ctx.alloc({rows, rank});
    be.grouped_gemm(grouped(dpart_b, dpart, stacked_b(p), group_offsets, false));
    if (dx.data) times_a(be, dx, dpart_b, ad, group_offsets, false, ad.scale, 1.0);
    add_a_gradient(be, ad, dpart_b, x, group_offsets);
    Tensor xa = ctx.alloc({rows, rank});
    times_a(be, xa, x, ad, group_offsets, true);
    be.grouped_gemm(k_grouped(ad.b.grad.view().reshaped(stacked_b(p).shape), dpart, xa, group_offsets, ad.scale));
  }
  if (gate_up_lora) {
    // gate_up += s (x A^T) B^T  =>  dB += s dgate_up^T (x A^T),  dA += s (dgate_up B)^T x,  dx += s (dgate_up B) A
    LoraAdapter& ad = *gate_up_lora;
    const int64_t rank = ad.a.value.size(-2);
    Tensor dgate_up_b = ctx.alloc({rows, rank});
    be.grouped_gemm(grouped(dgate_up_b, dgate_up, stacked_b(ad), group_offsets, false));
    if (dx.data) times_a(be, dx, dgate_up_b, ad, group_offsets, false, ad.scale, 1.0);
    add_a_gradient(be, ad, dgate_up_b, x, group_offsets);
    Tensor xa = ctx.alloc({rows, rank});
    times_a(be, xa, x, ad, group_offsets, true);
    be.grouped_gemm(k_grouped(ad.b.grad.view().reshaped(stacked_b(ad).shape), dgate_up, xa, group_offsets, ad.scale));
  }
}

void SwigluExperts::release_saved() {
  saved_gate_up_.reset();
  saved_hidden_.reset();
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
