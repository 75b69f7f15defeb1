// parallel.mixer_segment_tokens: the KDA mixers run over time segments, carrying the recurrent
// state and the short convolutions' history across each edge, and the step equals the
// whole-sequence one. Each case compares against the same model run whole, in F64 on the CPU:
// packed documents that cross segment edges and start inside the convolutions' halo, sequences
// that are not a multiple of the segment, segments shorter than the halo (width - 1 = 3) and of
// one token, recompute on and off, fused qkv and the full-rank output gate. Where segments cut
// where KDA's 64-token chunks do (a multiple of 64 from every document start) the logits are the
// same bits; elsewhere the chunks' sums run in another order, and the adapters' gradients sum
// over segments (and the halo rows' conv gradients over two segments), so those agree to rounding.
#include <memory>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/model.h"
#include "tests/support/model_gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

// `windows` windows of `seq_len` tokens, packed from documents of the given lengths in turn
// (cut at window ends); labels are next tokens within a document.
Batch packed_batch(int64_t vocab, int64_t windows, int64_t seq_len, const std::vector<int32_t>& lengths,
                   uint64_t seed) {
  Batch b = Batch::of_windows(windows, seq_len);
  std::vector<int32_t> segments;
  size_t next = 0;
  for (int64_t w = 0; w < windows; ++w) {
    for (int64_t used = 0; used < seq_len;) {
      const int32_t length = static_cast<int32_t>(std::min<int64_t>(lengths[next++ % lengths.size()], seq_len - used));
      segments.push_back(length);
      used += length;
    }
  }
  b.set_segments(segments);
  uint64_t state = seed;
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

struct Case {
  const char* name;
  Config config;
  std::vector<std::string> targets;
};

Config kda_config(std::vector<std::string> layers, bool k3_form) {
  Config c = tiny_model_config(/*q_lora=*/false);
  ModelConfig& m = c.model;
  m.num_layers = static_cast<int64_t>(layers.size());
  m.layers = std::move(layers);
  m.max_position_embeddings = 256;
  m.kda.fused_qkv = k3_form;
  m.kda.full_rank_output_gate = k3_form;
  return c;
}

std::vector<Case> cases() {
  const std::vector<std::string> kda_targets = {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                                                "g_a_proj", "g_b_proj", "o_proj", "gate_proj", "up_proj"};
  return {{"one KDA layer", kda_config({"kda"}, false), kda_targets},
          {"KDA, MLA, KDA with MoE, fused qkv and the full-rank gate", kda_config({"kda", "mla", "kda"}, true),
           {"qkv_proj", "f_a_proj", "b_proj", "g_proj", "o_proj", "kv_b_proj", "experts", "shared_experts"}},
          {"MLA, KDA, DSA", tiny_model_config(/*q_lora=*/true), all_lora_targets(true)}};
}

struct Step {
  StepResult result;
  Tensor logits;
  std::vector<Tensor> gradients;
};

Step run(const Case& c, const Batch& batch, bool recompute, int64_t segment_tokens) {
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = c.targets;
  options.recompute = recompute;
  options.mixer_segment_tokens = segment_tokens;
  GradcheckModel m(c.config, options, 100, 3);
  Step step;
  step.logits = m.model->logits(batch);
  for (Parameter* p : m.model->parameters()) m.backend->fill(p->grad, 0.0);
  step.result = m.model->forward_backward(batch, 1.0 / static_cast<double>(batch.num_targets()));
  for (Parameter* p : m.model->parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    m.backend->copy(g, p->grad);
    step.gradients.push_back(std::move(g));
  }
  return step;
}

void check_same(const Step& segmented, const Step& whole, double rtol) {
  const Comparison logits = compare_tensors(segmented.logits, whole.logits, rtol, 1e-14, "logits");
  INFO(logits.message);
  CHECK(logits.ok);
  CHECK(segmented.result.loss_sum == Approx(whole.result.loss_sum).epsilon(1e-12));
  check_same_gradients(segmented.gradients, whole.gradients, 1e-10, 1e-13);
}

}  // namespace

TEST_CASE("KDA time segments: the same logits, loss and adapter gradients as the whole sequence",
          "[model][segments]") {
  // Two windows of 23: documents of 7, 2, 5, 11, 1 (starts at 7, 9, 14 and a 1-token one) cross
  // every segment edge and start inside the halo of several.
  for (const Case& c : cases()) {
    const Batch batch = packed_batch(c.config.model.vocab_size, 2, 23, {7, 2, 5, 11, 1}, 17);
    for (bool recompute : {false, true}) {
      const Step whole = run(c, batch, recompute, 0);
      REQUIRE(whole.result.loss_sum > 0.0);
      for (int64_t segment : {1, 2, 3, 5, 8, 45}) {
        INFO(c.name << ", recompute " << recompute << ", segments of " << segment << " tokens");
        check_same(run(c, batch, recompute, segment), whole, 1e-11);
      }
    }
  }
}

TEST_CASE("KDA time segments at KDA's chunk: the logits are the same bits", "[model][segments]") {
  // One document of 200 tokens, and documents of 64 and 128 (every start a multiple of 64): the
  // segments of 64 and 128 cut where the chunks do.
  const Case c = cases()[0];
  for (const std::vector<int32_t>& lengths : {std::vector<int32_t>{200}, std::vector<int32_t>{64, 128}}) {
    const Batch batch = packed_batch(c.config.model.vocab_size, 1, 200, lengths, 5);
    const Step whole = run(c, batch, true, 0);
    for (int64_t segment : {64, 128}) {
      INFO("documents of " << lengths[0] << "..., segments of " << segment);
      const Step segmented = run(c, batch, true, segment);
      const Comparison logits = compare_tensors(segmented.logits, whole.logits, 0.0, 0.0, "logits");
      INFO(logits.message);
      CHECK(logits.ok);
      check_same(segmented, whole, 0.0);
    }
  }
}
