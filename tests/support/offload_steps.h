// A few training steps of a model with parallel.offload on or off (ModelOptions::offload), for
// the tests that offloaded layer checkpoints change nothing but where the inputs wait: the losses
// and the adapters after each step, read back as stored (bit-for-bit comparisons), and the
// backend's peak of tensor bytes over the last step.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/base/tensor.h"
#include "core/model/model.h"
#include "kernels/ops.h"

namespace moetrain::testing {

struct OffloadRun {
  std::vector<double> losses;                   // loss_sum per step
  std::vector<std::vector<uint8_t>> adapters;   // every parameter's value after the last step, raw
  std::vector<std::vector<uint8_t>> gradients;  // every parameter's gradient of the last step, raw
  size_t last_step_peak_bytes = 0;              // BackendStats::peak_bytes over the last step
};

inline std::vector<uint8_t> raw_bytes(kernels::Backend& backend, const Tensor& t) {
  Tensor host(t.shape(), t.dtype());
  backend.copy(host, t);
  std::vector<uint8_t> out(host.nbytes());
  std::memcpy(out.data(), host.data(), out.size());
  return out;
}

// `steps` steps of SGD (lr 0.05 on the adapters, so later steps see moved weights) on `batch`.
inline OffloadRun run_offload_steps(kernels::Backend& backend, const ModelSpec& spec, ModelOptions options,
                                    const Batch& batch, int steps) {
  Model model(spec, backend, options);
  model.init_random_weights();
  OffloadRun run;
  const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  for (int step = 0; step < steps; ++step) {
    if (step + 1 == steps) {
      backend.synchronize();
      backend.reset_peak_memory();
    }
    for (Parameter* p : model.parameters()) backend.fill(p->grad, 0.0);
    run.losses.push_back(model.forward_backward(batch, grad_scale).loss_sum);
    if (step + 1 == steps) {
      backend.synchronize();
      run.last_step_peak_bytes = backend.stats().peak_bytes;
      for (Parameter* p : model.parameters()) run.gradients.push_back(raw_bytes(backend, p->grad));
    }
    for (Parameter* p : model.parameters()) backend.axpby(p->value, p->grad, -0.05, 1.0);
  }
  for (Parameter* p : model.parameters()) run.adapters.push_back(raw_bytes(backend, p->value));
  return run;
}

}  // namespace moetrain::testing
