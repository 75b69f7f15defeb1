// parallel.attention_query_block and parallel.cp_key_chunk on one rank: the MLA layers run in
// query blocks x key chunks, their keys and values expanded from the latent per chunk and the
// chunks merged by their log-sum-exp, and the step equals the whole-sequence one. Each case
// compares against the same model run whole, in F64 on the CPU: packed documents that cross
// block and chunk edges (and documents of one token), blocks and chunks that do and do not
// divide the tokens, blocks of one token, recompute on and off, q LoRA, and the headwise and
// elementwise output gates. The chunks' softmax sums and the adapters' gradients sum in another
// order, so the results agree to rounding.
#include <memory>
#include <vector>

#include "catch.h"
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

std::vector<Case> cases() {
  Config headwise = tiny_model_config(/*q_lora=*/false);
  headwise.model.attention_gate = "headwise";
  return {{"MLA, KDA, MLA", tiny_model_config(/*q_lora=*/false), all_lora_targets(false)},
          {"MLA with q LoRA, KDA, DSA", tiny_model_config(/*q_lora=*/true), all_lora_targets(true)},
          {"MLA gated headwise", headwise, {"kv_b_proj", "kv_a_proj_with_mqa", "q_proj", "g_proj", "o_proj"}},
          {"Kimi K3 form, MLA gated elementwise", tiny_k3_config(2), {"kv_b_proj", "q_proj", "g_proj", "o_proj"}}};
}

struct Step {
  StepResult result;
  Tensor logits;
  std::vector<Tensor> gradients;
};

Step run(const Case& c, const Batch& batch, bool recompute, int64_t query_block, int64_t key_chunk) {
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = c.targets;
  options.recompute = recompute;
  options.attention_query_block = query_block;
  options.cp_key_chunk = key_chunk;
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

void check_same(const Step& blocked, const Step& whole) {
  const Comparison logits = compare_tensors(blocked.logits, whole.logits, 1e-10, 1e-14, "logits");
  INFO(logits.message);
  CHECK(logits.ok);
  CHECK(blocked.result.loss_sum == Approx(whole.result.loss_sum).epsilon(1e-12));
  REQUIRE(blocked.gradients.size() == whole.gradients.size());
  for (size_t i = 0; i < whole.gradients.size(); ++i) {
    const Comparison cmp =
        compare_tensors(blocked.gradients[i], whole.gradients[i], 1e-10, 1e-13, "gradient " + std::to_string(i));
    INFO(cmp.message);
    CHECK(cmp.ok);
  }
}

}  // namespace

TEST_CASE("MLA in query blocks x key chunks: the same logits, loss and adapter gradients as the whole sequence",
          "[model][mla][blocks]") {
  // Two windows of 23: documents of 7, 2, 5, 11, 1 cross every block and chunk edge.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 0}, {3, 0}, {5, 2}, {8, 3}, {46, 7},
                                                           {0, 5}, {7, 1}, {23, 23}, {100, 0}};
  for (const Case& c : cases()) {
    const Batch batch = packed_batch(c.config.model.vocab_size, 2, 23, {7, 2, 5, 11, 1}, 17);
    for (bool recompute : {false, true}) {
      const Step whole = run(c, batch, recompute, 0, 0);
      REQUIRE(whole.result.loss_sum > 0.0);
      for (const auto& [block, chunk] : shapes) {
        INFO(c.name << ", recompute " << recompute << ", query blocks of " << block << ", key chunks of " << chunk);
        check_same(run(c, batch, recompute, block, chunk), whole);
      }
    }
  }
}
