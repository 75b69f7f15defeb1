// Whole-model LoRA gradient checks shared by the model tests: every adapter's analytic gradient
// (one forward_backward) against central differences of the training objective, and every
// adapter must receive gradient (else the check proves little).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "tiny_model.h"

namespace moetrain::testing {

// Two runs' adapter gradients (lora_gradients' order), each within rtol / atol of the other's.
inline void check_same_gradients(const std::vector<Tensor>& actual, const std::vector<Tensor>& expected, double rtol,
                                 double atol) {
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const Comparison cmp = compare_tensors(actual[i], expected[i], rtol, atol, "gradient " + std::to_string(i));
    INFO(cmp.message);
    CHECK(cmp.ok);
  }
}

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

// The `analytic` gradient (lora_gradients) of each parameter whose name `selected` accepts
// against central differences of `objective`; returns the indices (into model.parameters())
// of the parameters checked.
inline std::vector<size_t> check_selected_gradients(Model& model, const std::vector<Tensor>& analytic,
                                                    const std::function<double()>& objective,
                                                    const GradCheckOptions& options,
                                                    const std::function<bool(const std::string&)>& selected) {
  const std::vector<Parameter*> params = model.parameters();
  REQUIRE(params.size() == analytic.size());
  std::vector<size_t> checked;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!selected(params[i]->name)) continue;
    Comparison c = check_gradient(objective, params[i]->value, analytic[i], params[i]->name, options);
    INFO(c.message);
    CHECK(c.ok);
    checked.push_back(i);
  }
  return checked;
}

// Each parameter's `analytic` gradient (lora_gradients) against central differences of
// `objective`; none may be all zero.
inline void check_lora_gradients(Model& model, kernels::Backend& backend, const std::vector<Tensor>& analytic,
                                 const std::function<double()>& objective, const GradCheckOptions& options) {
  const auto every = [](const std::string&) { return true; };
  int nonzero = 0;
  for (size_t i : check_selected_gradients(model, analytic, objective, options, every))
    nonzero += backend.sum_squares(analytic[i]) > 0.0;
  CHECK(nonzero == static_cast<int>(model.parameters().size()));
}

// The tolerances of the whole-model checks of the tiny models.
inline GradCheckOptions whole_model_gradcheck_options() {
  GradCheckOptions options;
  options.eps = 1e-6;
  options.rtol = 1e-5;
  options.atol = 1e-9;
  options.max_elements = 6;
  return options;
}

// A model on the CPU in F64 whose adapters all hold non-zero random values (B included, and A
// larger than its init, so every adapter carries gradient to every input), with a tiny batch:
// what each whole-model gradient check starts from.
struct GradcheckModel {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
  Batch batch;
  double grad_scale = 0.0;

  GradcheckModel(const Config& config, ModelOptions options, uint64_t adapter_seed, uint64_t batch_seed) {
    options.dtype = DType::kF64;
    model = std::make_unique<Model>(resolve_model_spec(config), *backend, options);
    model->init_random_weights();
    for (Parameter* p : model->parameters()) fill_random(p->value, adapter_seed++, 0.05, 0.3);
    batch = tiny_batch(config.model.vocab_size, batch_seed);
    grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  }

  // The objective whose gradient forward_backward accumulates (the loss and the MoE's aux loss).
  double objective() {
    const StepResult r = model->forward_backward(batch, grad_scale);
    return r.loss_sum * grad_scale + r.aux_loss;
  }

  // Analytic gradients of one forward_backward, copied out.
  std::vector<Tensor> gradients() { return lora_gradients(*model, *backend, batch, grad_scale); }

  // Every adapter's gradient against central differences of objective() (check_lora_gradients);
  // by default at 6 elements per adapter, atol 1e-9 (the differences' rounding at eps 1e-6).
  void check_all_parameters(GradCheckOptions options = whole_model_gradcheck_options()) {
    check_lora_gradients(*model, *backend, gradients(), [this] { return objective(); }, options);
  }
};

}  // namespace moetrain::testing
