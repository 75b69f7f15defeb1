#include "core/model/latent_moe.h"

namespace moetrain {

using kernels::RmsNormArgs;
using kernels::RmsNormBackwardArgs;

LatentMoeFfn::LatentMoeFfn(const ModelSpec& spec, int64_t layer, const LayerContext& ctx,
                           const ParallelGroups* parallel)
    : moe(spec, layer, ctx, parallel, spec.config.moe.latent_size),
      down_proj("model.layers." + std::to_string(layer) + ".mlp.routed_expert_down_proj", spec.config.hidden_size,
                spec.config.moe.latent_size),
      up_proj("model.layers." + std::to_string(layer) + ".mlp.routed_expert_up_proj", spec.config.moe.latent_size,
              spec.config.hidden_size),
      latent_(spec.config.moe.latent_size),
      use_norm_(spec.config.moe.use_latent_norm),
      eps_(spec.config.rms_norm_eps),
      prefix_("model.layers." + std::to_string(layer) + ".mlp") {
  const int64_t d = spec.config.hidden_size;
  down_proj.weight = ctx.alloc({latent_, d});
  up_proj.weight = ctx.alloc({d, latent_});
  if (use_norm_) norm = ctx.alloc({latent_});
}

void LatentMoeFfn::forward(const LayerContext& ctx, const TensorView& out, const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  Saved& s = saved_;
  s.z = ctx.alloc({n, latent_});
  down_proj.forward(ctx, s.z, x);
  s.y = ctx.alloc({n, latent_});
  moe.forward_routed(ctx, s.y, x, s.z);
  if (use_norm_) {
    s.normed = ctx.alloc({n, latent_});
    s.rstd = ctx.alloc_accum({n});
    be.rmsnorm_forward(RmsNormArgs{s.normed, s.rstd, s.y, norm, eps_});
  }
  up_proj.forward(ctx, out, up_input());
  moe.forward_shared(ctx, out, x);
}

void LatentMoeFfn::backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout,
                            const TensorView& x) {
  kernels::Backend& be = ctx.backend;
  const int64_t n = x.size(0);
  Saved& s = saved_;
  Tensor dnormed = ctx.alloc({n, latent_});
  up_proj.backward(ctx, dnormed, dout, up_input(), /*accumulate_dx=*/false);
  Tensor dnorm_in;
  TensorView dy = dnormed;
  if (use_norm_) {
    dnorm_in = ctx.alloc({n, latent_});
    dy = dnorm_in;
    RmsNormBackwardArgs back;
    back.dx = dy;
    back.dy = dnormed;
    back.x = s.y;
    back.weight = norm;
    back.rstd = s.rstd;
    be.rmsnorm_backward(back);
  }
  moe.backward_shared(ctx, dx, dout, x);
  Tensor dz = ctx.alloc({n, latent_});
  moe.backward_routed(ctx, dx, dz, dy, /*accumulate_rows=*/false);
  down_proj.backward(ctx, dx, dz, x, /*accumulate_dx=*/true);
}

void LatentMoeFfn::release_saved() {
  saved_ = Saved{};
  moe.release_saved();
}

void LatentMoeFfn::collect_parameters(std::vector<Parameter*>& out) {
  moe.collect_parameters(out);
  down_proj.collect_parameters(out);
  up_proj.collect_parameters(out);
}

void LatentMoeFfn::collect_weights(std::vector<WeightSlot>& out) {
  moe.collect_weights(out);
  out.push_back({down_proj.name() + ".weight", &down_proj.weight});
  out.push_back({up_proj.name() + ".weight", &up_proj.weight});
  if (use_norm_) out.push_back({prefix_ + ".routed_expert_norm.weight", &norm});
}

}  // namespace moetrain
