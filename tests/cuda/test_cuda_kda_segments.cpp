// KDA time segments (parallel.mixer_segment_tokens) on the GPU: a model of KDA and MLA layers
// trained three steps with its KDA layers in segments equals the whole-sequence run on the GPU
// and the CPU backend's run in F32 (same random weights and batch), and the step's peak of
// tensor bytes falls (a KDA layer's internals exist for one segment at a time). Documents cross
// the segment edges and start inside the short convolutions' halo. BF16 on the GPU: the segments
// change where KDA's chunks cut a document (its sums' order), so the comparisons are BF16-sized:
// each value within tol x the largest of its tensor (tests/cuda/test_cuda_golden_model.cpp sets
// the same kind of bound for whole models against an F32 reference).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// KDA, MLA, KDA with dense feed-forwards (no routing to flip between BF16 and F32), KDA at
// Kimi-Linear's head dim (2 heads of 128).
Config segments_config() {
  Config c = tiny_model_config(false);
  ModelConfig& m = c.model;
  m.num_layers = 3;
  m.layers = {"kda", "mla", "kda"};
  m.first_k_dense = 3;
  m.hidden_size = 256;
  m.intermediate_size = 512;
  m.kda.num_heads = 2;
  m.kda.head_dim = 128;
  m.max_position_embeddings = 2048;
  c.data.seq_len = 2048;
  return c;
}

// Two windows of 2048 tokens, packed from documents of 700, 3, 130 and 1500 tokens (cut at the
// window ends): starts off every multiple of 64, and a 3-token document inside a halo.
Batch segments_batch(int64_t vocab) {
  Batch b = Batch::of_windows(2, 2048);
  const std::vector<int32_t> pattern = {700, 3, 130, 1500};
  std::vector<int32_t> lengths;
  size_t next = 0;
  for (int w = 0; w < 2; ++w) {
    for (int32_t used = 0; used < 2048;) {
      const int32_t length = std::min(pattern[next++ % pattern.size()], 2048 - used);
      lengths.push_back(length);
      used += length;
    }
  }
  b.set_segments(lengths);
  uint64_t state = 11;
  for (int32_t& id : b.input_ids) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
    for (int32_t t = b.cu_seqlens[s]; t < b.cu_seqlens[s + 1]; ++t) {
      b.positions[t] = t - b.cu_seqlens[s];
      b.labels[t] = t + 1 < b.cu_seqlens[s + 1] ? b.input_ids[t + 1] : -1;
    }
  }
  return b;
}

ModelOptions options(DType dtype, bool recompute, int64_t segment_tokens) {
  ModelOptions o;
  o.dtype = dtype;
  o.lora = LoraSettings{4, 8.0, false};
  o.lora_targets = {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                    "o_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"};
  o.recompute = recompute;
  o.mixer_segment_tokens = segment_tokens;
  return o;
}

// A raw F32 gradient (OffloadRun::gradients) as values.
std::vector<double> values(const std::vector<uint8_t>& raw) {
  std::vector<float> f(raw.size() / sizeof(float));
  std::memcpy(f.data(), raw.data(), f.size() * sizeof(float));
  return std::vector<double>(f.begin(), f.end());
}

// Every gradient of `got` within tol x the largest |value| of the same gradient of `want`.
void check_gradients(const OffloadRun& got, const OffloadRun& want, double tol, const std::string& what) {
  REQUIRE(got.gradients.size() == want.gradients.size());
  for (size_t i = 0; i < want.gradients.size(); ++i) {
    const std::vector<double> a = values(got.gradients[i]), e = values(want.gradients[i]);
    REQUIRE(a.size() == e.size());
    double scale = 0, worst = 0;
    for (size_t j = 0; j < e.size(); ++j) {
      scale = std::max(scale, std::fabs(e[j]));
      worst = std::max(worst, std::isnan(a[j]) ? INFINITY : std::fabs(a[j] - e[j]));
    }
    INFO(what << ", gradient " << i << ": worst " << worst << " of scale " << scale);
    CHECK(scale > 0);
    CHECK(worst <= tol * scale);
  }
}

}  // namespace

TEST_CASE("cuda KDA time segments: the whole-sequence run's losses and gradients, and a lower peak",
          "[cuda][model]") {
  std::unique_ptr<kernels::Backend> cuda = kernels::make_cuda_backend();
  std::unique_ptr<kernels::Backend> cpu = kernels::make_cpu_backend();
  const Config config = segments_config();
  const ModelSpec spec = resolve_model_spec(config);
  const Batch batch = segments_batch(config.model.vocab_size);
  for (bool recompute : {true, false}) {
    INFO("recompute " << recompute);
    const OffloadRun whole = run_offload_steps(*cuda, spec, options(DType::kBF16, recompute, 0), batch, 3);
    const OffloadRun reference = run_offload_steps(*cpu, spec, options(DType::kF32, recompute, 0), batch, 3);
    for (int64_t segment : {512, 192}) {
      INFO("segments of " << segment);
      const OffloadRun segmented = run_offload_steps(*cuda, spec, options(DType::kBF16, recompute, segment), batch, 3);
      for (size_t step = 0; step < 3; ++step) {
        INFO("step " << step << ": loss " << segmented.losses[step] << " segmented, " << whole.losses[step]
                     << " whole, " << reference.losses[step] << " CPU F32");
        CHECK(std::fabs(segmented.losses[step] - whole.losses[step]) <= 2e-3 * std::fabs(whole.losses[step]));
        CHECK(std::fabs(segmented.losses[step] - reference.losses[step]) <= 5e-3 * std::fabs(reference.losses[step]));
      }
      check_gradients(segmented, whole, 3e-2, "against the GPU's whole run");
      check_gradients(segmented, reference, 1.5e-1, "against the CPU in F32");
      INFO("peak " << segmented.last_step_peak_bytes << " segmented, " << whole.last_step_peak_bytes << " whole");
      CHECK(segmented.last_step_peak_bytes < whole.last_step_peak_bytes);
    }
  }
}
