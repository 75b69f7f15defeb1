// MLA in query blocks x key chunks on one rank (parallel.attention_query_block,
// parallel.cp_key_chunk) on the GPU: a model of MLA and KDA layers one training step with its
// MLA layers blocked equals the whole-sequence run on the GPU and the CPU backend's run in F32
// (same random weights and batch), and the step's peak of tensor bytes falls (no layer keeps
// whole-sequence keys and values). Documents cross the block and chunk edges. BF16 on the GPU:
// the chunks' softmax merge and the adapter-gradient sums run in another order, so the
// comparisons are BF16-sized: each value within tol x the largest of its tensor, as in
// tests/cuda/test_cuda_kda_segments.cpp.
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

// MLA, KDA, MLA with dense feed-forwards (no routing to flip between BF16 and F32), the MLA at 8
// heads of 64 + 32 (q, k) and 64 (v), so that its keys and values weigh in the peak.
Config blocks_config() {
  Config c = tiny_model_config(false);
  ModelConfig& m = c.model;
  m.num_layers = 3;
  m.layers = {"mla", "kda", "mla"};
  m.first_k_dense = 3;
  m.hidden_size = 256;
  m.intermediate_size = 512;
  m.mla.num_heads = 8;
  m.mla.kv_lora_rank = 64;
  m.mla.qk_nope_head_dim = 64;
  m.mla.qk_rope_head_dim = 32;
  m.mla.v_head_dim = 64;
  m.max_position_embeddings = 2048;
  c.data.seq_len = 2048;
  return c;
}

// Two windows of 2048 tokens, packed from documents of 700, 3, 130 and 1500 tokens (cut at the
// window ends): starts off every multiple of 64, and a 3-token document inside a halo.
Batch blocks_batch(int64_t vocab) {
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

ModelOptions options(DType dtype, bool recompute, int64_t query_block, int64_t key_chunk) {
  ModelOptions o;
  o.dtype = dtype;
  o.lora = LoraSettings{4, 8.0, false};
  o.lora_targets = {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "k_proj", "v_proj", "gate_proj",
                    "up_proj", "down_proj"};
  o.recompute = recompute;
  o.attention_query_block = query_block;
  o.cp_key_chunk = key_chunk;
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

TEST_CASE("cuda MLA query blocks: the whole-sequence run's losses and gradients, and a lower peak",
          "[cuda][model]") {
  std::unique_ptr<kernels::Backend> cuda = kernels::make_cuda_backend();
  std::unique_ptr<kernels::Backend> cpu = kernels::make_cpu_backend();
  const Config config = blocks_config();
  const ModelSpec spec = resolve_model_spec(config);
  const Batch batch = blocks_batch(config.model.vocab_size);
  for (bool recompute : {true, false}) {
    INFO("recompute " << recompute);
    const OffloadRun whole = run_offload_steps(*cuda, spec, options(DType::kBF16, recompute, 0, 0), batch, 1);
    const OffloadRun reference = run_offload_steps(*cpu, spec, options(DType::kF32, recompute, 0, 0), batch, 1);
    for (const auto& [block, chunk] : {std::pair<int64_t, int64_t>{512, 0}, std::pair<int64_t, int64_t>{300, 200}}) {
      INFO("query blocks of " << block << ", key chunks of " << chunk);
      const OffloadRun blocked =
          run_offload_steps(*cuda, spec, options(DType::kBF16, recompute, block, chunk), batch, 1);
      for (size_t step = 0; step < blocked.losses.size(); ++step) {
        INFO("step " << step << ": loss " << blocked.losses[step] << " blocked, " << whole.losses[step] << " whole, "
                     << reference.losses[step] << " CPU F32");
        CHECK(std::fabs(blocked.losses[step] - whole.losses[step]) <= 2e-3 * std::fabs(whole.losses[step]));
        CHECK(std::fabs(blocked.losses[step] - reference.losses[step]) <= 5e-3 * std::fabs(reference.losses[step]));
      }
      check_gradients(blocked, whole, 1e-1, "against the GPU's whole run");
      check_gradients(blocked, reference, 1.5e-1, "against the CPU in F32");
      INFO("peak " << blocked.last_step_peak_bytes << " blocked, " << whole.last_step_peak_bytes << " whole");
      CHECK(blocked.last_step_peak_bytes < whole.last_step_peak_bytes);
    }
  }
}
