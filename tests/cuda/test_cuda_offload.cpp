// parallel.offload on the GPU: training with the layer inputs offloaded to page-locked host memory
// (copied on the backend's side stream) is bit for bit training without (both BF16 on CUDA, every
// op deterministic), and the step's peak of tensor bytes falls by about the layer inputs that
// leave the device: all but the last layer's, less the one prefetched while a layer runs.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "kernels/ops.h"
#include "offload_steps.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// tiny_model_config's mixers and MoE, six layers wide enough that the layer inputs ([4096, 256]
// BF16, 2 MiB each) dominate the difference in peak memory.
Config offload_config() {
  Config c = tiny_model_config(true);
  ModelConfig& m = c.model;
  m.num_layers = 6;
  m.layers = {"mla", "kda", "dsa", "mla", "kda", "dsa"};
  m.hidden_size = 256;
  m.max_position_embeddings = 512;
  c.data.seq_len = 512;
  return c;
}

// Eight windows of 512 tokens, two documents each.
Batch long_batch(int64_t vocab) {
  Batch b;
  b.batch_size = 8;
  b.seq_len = 512;
  uint64_t state = 7;
  for (int64_t w = 0; w < b.batch_size; ++w) {
    b.cu_seqlens.push_back(static_cast<int32_t>(w * 512));
    b.cu_seqlens.push_back(static_cast<int32_t>(w * 512 + 300));
  }
  b.cu_seqlens.push_back(8 * 512);
  for (int64_t t = 0; t < 8 * 512; ++t) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    b.input_ids.push_back(static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab)));
  }
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
    for (int32_t t = b.cu_seqlens[s]; t < b.cu_seqlens[s + 1]; ++t) {
      b.positions.push_back(t - b.cu_seqlens[s]);
      b.labels.push_back(t + 1 < b.cu_seqlens[s + 1] ? b.input_ids[t + 1] : -1);
    }
  }
  return b;
}

ModelOptions options(bool recompute, bool offload) {
  ModelOptions o;
  o.dtype = DType::kBF16;
  o.lora = LoraSettings{4, 8.0, false};
  o.lora_targets = all_lora_targets(true);
  o.recompute = recompute;
  o.offload = offload;
  return o;
}

}  // namespace

TEST_CASE("cuda offload: training is bit for bit the same, the peak falls by the layer inputs", "[cuda][model]") {
  std::unique_ptr<kernels::Backend> cuda = kernels::make_cuda_backend();
  const Config config = offload_config();
  const ModelSpec spec = resolve_model_spec(config);
  const Batch batch = long_batch(config.model.vocab_size);
  for (bool recompute : {true, false}) {
    INFO("recompute " << recompute);
    const OffloadRun kept = run_offload_steps(*cuda, spec, options(recompute, false), batch, 3);
    const OffloadRun offloaded = run_offload_steps(*cuda, spec, options(recompute, true), batch, 3);
    CHECK(kept.losses[2] != kept.losses[0]);
    CHECK(offloaded.losses == kept.losses);
    CHECK(offloaded.gradients == kept.gradients);
    CHECK(offloaded.adapters == kept.adapters);
    if (!recompute) continue;  // without recompute the saved internals, not the inputs, set the peak
    const double input_bytes = 8.0 * 512 * 256 * 2;
    const double saved = static_cast<double>(kept.last_step_peak_bytes) -
                         static_cast<double>(offloaded.last_step_peak_bytes);
    INFO("peak " << kept.last_step_peak_bytes << " kept, " << offloaded.last_step_peak_bytes
                 << " offloaded; one layer input " << input_bytes);
    // Six layers, seven inputs: at the backward's peak four are on the device (the layer's own, the
    // prefetched one below, its output and the gradient's counterpart), so three leave (measured
    // on the H200: exactly three).
    CHECK(saved >= 2.5 * input_bytes);
    CHECK(saved <= 6.5 * input_bytes);
  }
}
