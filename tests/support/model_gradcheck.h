// Whole-model LoRA gradient checks shared by the model tests: every adapter's analytic gradient
// (one forward_backward) against central differences of the training objective, and every
// adapter must receive gradient (else the check proves little).
#pragma once

#include <functional>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/ops.h"

namespace moetrain::testing {

// The adapters' gradients of one forward_backward from zero, copied to host F64 tensors.
inline std::vector<Tensor> lora_gradients(Model& model, kernels::Backend& backend, const Batch& batch,
                                          double grad_scale) {
  for (Parameter* p : model.parameters()) backend.fill(p->grad, 0.0);
  model.forward_backward(batch, grad_scale);
  std::vector<Tensor> grads;
  for (Parameter* p : model.parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    backend.copy(g, p->grad);
    grads.push_back(std::move(g));
  }
  return grads;
}

// Each parameter's `analytic` gradient (lora_gradients) against central differences of
// `objective`; none may be all zero.
inline void check_lora_gradients(Model& model, kernels::Backend& backend, const std::vector<Tensor>& analytic,
                                 const std::function<double()>& objective, const GradCheckOptions& options) {
  const std::vector<Parameter*> params = model.parameters();
  REQUIRE(params.size() == analytic.size());
  int nonzero = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    Comparison c = check_gradient(objective, params[i]->value, analytic[i], params[i]->name, options);
    INFO(c.message);
    CHECK(c.ok);
    nonzero += backend.sum_squares(analytic[i]) > 0.0;
  }
  CHECK(nonzero == static_cast<int>(params.size()));
}

}  // namespace moetrain::testing
