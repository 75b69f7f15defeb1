// Routed experts small enough for a finite-difference check of every gradient element, for the
// expert-level tests of the adapter forms (fused gate_up, shared expert A): 3 experts, hidden 5,
// width 4, and 7 rows of x routed 3, 0 (an expert without tokens) and 4, in F64 on the CPU
// backend, the weights, x, dy and every adapter random and non-zero.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "core/model/swiglu_experts.h"
#include "gradcheck.h"
#include "kernels/ops.h"

namespace moetrain::testing::routed_experts {

inline constexpr int64_t kGroups = 3, kHidden = 5, kWidth = 4, kRows = 7;
// Rows per expert: 3, 0 (an expert without tokens), 4.
inline const std::vector<int32_t> kOffsets = {0, 3, 3, 7};

// The experts with the adapters `add_adapters` puts on their SwigluExperts (with the backend to
// create them on); the loss is <FFN(x), dy>.
struct RoutedExperts {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  BatchTensors batch;
  SwigluExperts mlp{"model.layers.1.mlp.experts", kGroups, kHidden, kWidth, /*routed=*/true};
  Tensor offsets{Shape{kGroups + 1}, DType::kI32};
  Tensor x = random_tensor({kRows, kHidden}, DType::kF64, 11);
  Tensor dy = random_tensor({kRows, kHidden}, DType::kF64, 12);

  explicit RoutedExperts(const std::function<void(SwigluExperts&, kernels::Backend&)>& add_adapters) {
    mlp.gate_up = random_tensor({kGroups, 2 * kWidth, kHidden}, DType::kF64, 1);
    mlp.down = random_tensor({kGroups, kHidden, kWidth}, DType::kF64, 2);
    add_adapters(mlp, *backend);
    uint64_t seed = 20;
    for (Parameter* p : params()) fill_random(p->value, seed++, 0.1, 0.6);
    std::memcpy(offsets.data(), kOffsets.data(), offsets.nbytes());
  }

  std::vector<Parameter*> params() {
    std::vector<Parameter*> out;
    mlp.collect_parameters(out);
    return out;
  }
  LayerContext ctx() { return LayerContext{*backend, DType::kF64, batch}; }
  GroupOffsets groups() const { return GroupOffsets{offsets.view(), kOffsets.data()}; }

  Tensor forward() {
    Tensor out({kRows, kHidden}, DType::kF64);
    mlp.forward(ctx(), out, x, groups());
    return out;
  }
  double loss() { return dot(forward(), dy); }

  // Gradients of loss() into the adapters' grads (zeroed first) and the returned dx.
  Tensor backward() {
    for (Parameter* p : params()) backend->fill(p->grad, 0.0);
    forward();
    Tensor dx({kRows, kHidden}, DType::kF64);
    mlp.backward(ctx(), dx, dy, x, groups(), false);
    return dx;
  }
};

}  // namespace moetrain::testing::routed_experts
