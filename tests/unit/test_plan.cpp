// core/plan: the parameter counts agree exactly with the tensors Model allocates, and the
// memory plan's numbers follow their formulas on a small config worked out by hand.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/model.h"
#include "core/plan/memory_plan.h"
#include "core/plan/model_flops.h"
#include "core/plan/param_count.h"
#include "core/train/optimizer.h"
#include "kernels/ops.h"
#include "tests/support/counting_backend.h"
#include "tiny_model.h"

using namespace moetrain;

namespace {

bool has_text(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

int64_t slot_elements(Model& model) {
  int64_t n = 0;
  for (const WeightSlot& slot : model.weight_slots()) n += slot.tensor->numel();
  return n;
}

int64_t routed_expert_elements(Model& model) {
  int64_t n = 0;
  for (const WeightSlot& slot : model.weight_slots()) {
    const std::string& name = slot.name;
    if (name.size() >= 8 && name.compare(name.size() - 8, 8, ".experts") == 0) n += slot.tensor->numel();
  }
  return n;
}

// The bytes of the plan item called `name` (a failed check when there is none).
double item_bytes(const std::vector<PlanItem>& items, const std::string& name) {
  for (const PlanItem& i : items)
    if (i.name == name) return i.bytes;
  FAIL("no plan item " << name);
  return 0.0;
}

int64_t parameter_elements(Model& model) {
  int64_t n = 0;
  for (Parameter* p : model.parameters()) n += p->value.numel();
  return n;
}

// The plan's count of rank-`rank` adapters on `targets`.
int64_t lora_elements(const ModelSpec& spec, int64_t rank, const std::vector<std::string>& targets) {
  LoraConfig lora;
  lora.rank = rank;
  lora.targets = targets;
  return count_lora_parameters(spec, lora).total();
}

struct Variant {
  const char* name;
  bool q_lora;
  bool tied;
  int64_t shared;
  bool bias;
  int64_t first_k_dense;
};

}  // namespace

TEST_CASE("parameter counts equal Model::weight_slots and Model::parameters") {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  const Variant variants[] = {
      {"q LoRA, shared expert", true, false, 1, true, 1},
      {"direct q, tied, no shared, no bias", false, true, 0, false, 1},
      {"two shared experts, all MoE", true, false, 2, true, 0},
      {"all dense", false, false, 1, true, 3},
  };
  for (const Variant& v : variants) {
    SECTION(v.name) {
      Config config = testing::tiny_model_config(v.q_lora);
      config.model.tie_word_embeddings = v.tied;
      config.model.moe.num_shared_experts = v.shared;
      config.model.moe.score_correction_bias = v.bias;
      config.model.first_k_dense = v.first_k_dense;
      ModelSpec spec = resolve_model_spec(config);
      ModelOptions options;
      options.lora = LoraSettings{4, 8.0, false};
      std::vector<std::string> targets = testing::all_lora_targets(v.q_lora);
      if (v.shared == 0 || v.first_k_dense != 1) {
        // Targets that match no module are rejected by the model; keep the ones that exist.
        // Without a dense layer, gate/up/down_proj only match when they select the shared
        // experts' projections by name (the model credits a match to `shared_experts` otherwise).
        std::vector<std::string> kept;
        for (const std::string& t : targets) {
          if ((v.shared == 0 || v.first_k_dense == 0) && t == "shared_experts") continue;
          if (v.first_k_dense == 3 && (t == "experts" || t == "shared_experts")) continue;
          kept.push_back(t);
        }
        targets = kept;
      }
      options.lora_targets = targets;
      Model model(spec, *backend, options);

      ModelParameterCount count = count_model_parameters(spec);
      CHECK(count.total() == slot_elements(model));
      CHECK(count.routed_experts() == routed_expert_elements(model));

      CHECK(lora_elements(spec, 4, targets) == parameter_elements(model));
    }
  }
}

TEST_CASE("a target subset counts only its adapters") {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  Config config = testing::tiny_model_config(true);
  ModelSpec spec = resolve_model_spec(config);
  for (std::vector<std::string> targets :
       {std::vector<std::string>{"o_proj"}, {"experts"}, {"q_b_proj", "down_proj"}, {"shared_experts", "up_proj"}}) {
    ModelOptions options;
    options.lora = LoraSettings{3, 6.0, false};
    options.lora_targets = targets;
    Model model(spec, *backend, options);
    CHECK(lora_elements(spec, 3, targets) == parameter_elements(model));
  }
}

TEST_CASE("kda, dsa and the attention gate are counted exactly") {
  Config config = testing::tiny_model_config(true);
  config.model.layers = {"mla", "kda", "dsa"};
  ModelSpec spec = plan_model_spec(config.model);
  ModelParameterCount count = count_model_parameters(spec);
  REQUIRE(count.layers.size() == 3);
  // KDA by hand, D 16, H 2, d 4 (c 8), W 4: q/k/v 3*8*16, convs 3*8*4, f_a 4*16, f_b 8*4,
  // A_log 2, dt_bias 8, b_proj 2*16, g_a 4*16, g_b 8*4, o_norm 4, o_proj 16*8.
  CHECK(count.layers[1].mixer == 384 + 96 + 64 + 32 + 2 + 8 + 32 + 64 + 32 + 4 + 128);
  // DSA = MLA + the indexer: wq_b 2*6 x q_lora 12, wk 6 x D 16, LayerNorm 2*6, weights_proj 2 x 16.
  CHECK(count.layers[2].mixer - count.layers[0].mixer == 2 * 6 * 12 + 6 * 16 + 2 * 6 + 2 * 16);

  // The gate's g_proj on both attention layers: D -> H (headwise) or H v (elementwise, v 5).
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  for (const char* gate : {"headwise", "elementwise"}) {
    INFO(gate);
    Config gated = config;
    gated.model.attention_gate = gate;
    ModelSpec gated_spec = resolve_model_spec(gated);
    ModelParameterCount gated_count = count_model_parameters(gated_spec);
    const int64_t g_proj = 16 * (std::string(gate) == "headwise" ? 2 : 2 * 5);
    CHECK(gated_count.layers[0].mixer - count.layers[0].mixer == g_proj);
    CHECK(gated_count.layers[2].mixer - count.layers[2].mixer == g_proj);
    ModelOptions options;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = {"g_proj", "kv_b_proj", "q_a_proj", "o_proj"};
    Model model(gated_spec, *backend, options);
    CHECK(gated_count.total() == slot_elements(model));
    CHECK(lora_elements(gated_spec, 4, options.lora_targets) == parameter_elements(model));
  }
}

TEST_CASE("a DSA layer's saved tensors per token, by hand") {
  // tiny_model_config with q LoRA (12), bf16 activations (a = 2), F32 statistics, H 2, qk 6 + 4,
  // v 5, kv rank 8, top 3 of windows of 8. Shared with MLA: q_a, q latent 2*12*a + 4, kv latent
  // 8*a + 4, attention output 2*5*a. MLA on top: kv_normed 8*a, q and k 2*2*10*a, v 2*5*a, lse
  // 2*4 = 124. DSA on top: 3 key ids 3*4, absorbed queries and the latent rows (2 + 1)*(8 + 4)*a,
  // latent output 2*8*a, lse 2*4 = 124; plus q 2*10*a = 40 when kv_b_proj has an adapter.
  Config dsa = testing::tiny_model_config(true);
  dsa.parallel.recompute = false;
  Config mla = dsa;
  mla.model.layers = {"mla", "kda", "mla"};
  auto saved = [](const Config& config) {
    for (const PlanItem& i : make_memory_plan(config, PlanOptions{}).per_token_full)
      if (i.name == "every layer's saved tensors") return i.bytes;
    FAIL("no saved-tensors item");
    return 0.0;
  };
  CHECK(saved(dsa) - saved(mla) == 0.0);
  dsa.lora.targets = {"kv_b_proj"};
  mla.lora.targets = {"kv_b_proj"};
  CHECK(saved(dsa) - saved(mla) == 40.0);
  // The gate's pre-activation on the two attention layers: H a headwise, H v a elementwise.
  Config gated = mla;
  gated.model.attention_gate = "elementwise";
  CHECK(saved(gated) - saved(mla) == 2 * 2 * 5 * 2.0);
  gated.model.attention_gate = "headwise";
  CHECK(saved(gated) - saved(mla) == 2 * 2 * 2.0);
}

TEST_CASE("the CUDA DSA backward's scratch, by hand") {
  // tiny_model_config: top 3 of windows of 8, kv rank 8 + rope 4. Per token: key ids and positions,
  // their sorted copies and the sort's buffer 6*3*4, offsets 4, the F32 dkv sum 12*4 = 124. Fixed:
  // the contributions of every query of the micro-batch (far under 2 GiB) 3*12*4 = 144 each.
  Config dsa = testing::tiny_model_config(true);
  Config mla = dsa;
  mla.model.layers = {"mla", "kda", "mla"};
  const MemoryPlan with = make_memory_plan(dsa, PlanOptions{});
  const MemoryPlan without = make_memory_plan(mla, PlanOptions{});
  for (bool recompute : {true, false}) {
    const auto& items = recompute ? with.per_token_recompute : with.per_token_full;
    CHECK(item_bytes(items, "DSA backward scratch (inverse index, dkv sum)") == 124.0);
    CHECK(item_bytes(recompute ? without.per_token_recompute : without.per_token_full,
               "DSA backward scratch (inverse index, dkv sum)") == 0.0);
  }
  const double tokens = static_cast<double>(dsa.data.micro_batch * dsa.data.seq_len);
  CHECK(item_bytes(with.fixed, "DSA backward contribution chunk (fp32)") == tokens * 144.0);
  CHECK(item_bytes(without.fixed, "DSA backward contribution chunk (fp32)") == 0.0);
}

TEST_CASE("Kimi K3's KDA (fused qkv, full-rank output gate) counts what the model builds") {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  Config config = testing::tiny_model_config(false);
  config.model.kda.fused_qkv = true;
  config.model.kda.full_rank_output_gate = true;
  config.model.kda.lower_bound = -5.0;
  ModelSpec spec = resolve_model_spec(config);
  const std::vector<std::string> targets = {"qkv_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"};
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = targets;
  Model model(spec, *backend, options);
  CHECK(count_model_parameters(spec).total() == slot_elements(model));
  CHECK(lora_elements(spec, 4, targets) == parameter_elements(model));
}

TEST_CASE("memory plan numbers by hand on a small config") {
  // hidden 16, vocab 37, 3 layers (dense first), 6 experts of width 8, top 2, one shared expert.
  Config config = testing::tiny_model_config(false);
  config.parallel.fsdp = 4;
  config.parallel.ep = 2;
  config.parallel.prefetch = 1;
  config.data.micro_batch = 2;
  config.data.seq_len = 8;
  config.data.grad_accum = 3;
  config.lora.rank = 4;
  config.lora.targets = {"o_proj", "experts"};
  PlanOptions options;
  options.world = 4;
  MemoryPlan plan = make_memory_plan(config, options);
  CHECK(plan.local_experts == 3);
  CHECK(plan.replicate == 1);
  CHECK(plan.tokens_per_micro_batch == 16);

  // Experts: 3 local x 2 MoE layers x (3 x 16 x 8) x 2 bytes.
  const PlanItem& experts = plan.fixed[2];
  CHECK(experts.name == "routed experts (bf16)");
  CHECK(experts.bytes == 3.0 * 2 * 384 * 2);
  // Non-expert adapters: value and grad (8 B) everywhere; moments and the reduced-grad shard
  // (16 B) split over the 4 data-parallel ranks.
  CHECK(plan.fixed[3].name == "adapters + grads (fp32)");
  CHECK(plan.fixed[4].name == "adapter Adam state, sharded (fp32)");
  CHECK(plan.fixed[3].bytes > 0);
  CHECK(plan.fixed[4].bytes == plan.fixed[3].bytes * 2 / 4);
  // Expert adapters: per expert (gate 4*(16+8) + up 4*(16+8) + down 4*(8+16)) = 288, x 3 local
  // experts x 2 MoE layers x 8 B; their moments split over the 2 ranks holding the same experts.
  const PlanItem& expert_lora = plan.fixed[5];
  CHECK(expert_lora.name == "expert adapters + grads (fp32)");
  CHECK(expert_lora.bytes == 288.0 * 3 * 2 * 8);
  CHECK(plan.fixed[6].bytes == 288.0 * 3 * 2 / 2 * 16);
  // Packed expert adapters, BF16: per expert gate_up A [8, 16] and block-diagonal B [16, 8], down
  // A [4, 8] and B [16, 4]: 352 elements, x 3 local experts x 2 MoE layers x 2 B.
  CHECK(plan.fixed[7].name == "packed MLP and expert adapters");
  CHECK(plan.fixed[7].bytes == 352.0 * 3 * 2 * 2);
  // Shards: each bucket padded to a multiple of 4: embedding 592 -> 148 per rank; head + final
  // norm 608 -> 152; layers as counted.
  ModelParameterCount count = count_model_parameters(plan_model_spec(config.model));
  int64_t shard = 148 + 152;
  for (const LayerParameterCount& l : count.layers) shard += (l.non_expert() + 3) / 4;
  CHECK(plan.fixed[0].bytes == 2.0 * shard);
  // EP all-to-all: 3 micro-batches x 6 passes (recompute) x 2 MoE layers x 16 tokens x top 2
  // x hidden 16 x 2 bytes x (2-1)/2.
  const PlanItem& ep = plan.communication.back();
  CHECK(ep.bytes == 3.0 * 6 * 2 * 16 * 2 * 16 * 2 * 0.5);
  // More tokens never fit in less memory, and the peak grows linearly in tokens.
  CHECK(plan.max_tokens(true) >= plan.max_tokens(false));
  CHECK(plan.peak_bytes(true) == plan.fixed_bytes() + 16 * plan.per_token_bytes(true));
}

TEST_CASE("on one rank the plan's Adam state is what AdamW allocates: the two moments") {
  // Unsharded parameter groups keep no reduced gradient and no all-gather input (8 B per
  // parameter, not the 16 B of a sharded group). The padding that aligns each parameter in its
  // group (ParameterGroup) is the only difference allowed.
  Config config = testing::tiny_model_config(false);
  config.lora.rank = 4;
  config.lora.targets = {"o_proj", "kv_b_proj", "experts"};
  const MemoryPlan plan = make_memory_plan(config, PlanOptions{});
  const double planned = item_bytes(plan.fixed, "adapter Adam state, sharded (fp32)") +
                         item_bytes(plan.fixed, "expert-adapter Adam state, sharded (fp32)");
  CHECK(planned == item_bytes(plan.fixed, "adapters + grads (fp32)") +
                       item_bytes(plan.fixed, "expert adapters + grads (fp32)"));

  auto cpu = kernels::make_cpu_backend();
  testing::CountingBackend backend(*cpu);
  ModelOptions options = model_options_for(config);
  Model model(resolve_model_spec(config), backend, options);
  backend.arm();  // from here the peak is the live bytes, and AdamW frees nothing it allocates
  const double before = static_cast<double>(backend.peak_bytes());
  const AdamW optimizer(model.parameter_groups(), AdamWOptions{}, backend);
  const double allocated = static_cast<double>(backend.peak_bytes()) - before;
  INFO("planned " << planned << " B, allocated " << allocated << " B");
  CHECK(allocated >= planned);
  CHECK(allocated <= planned + 2 * 4 * ParameterGroup::kAlignment * static_cast<double>(model.parameters().size()));
}

TEST_CASE("the plan's packed adapters are what a training step holds") {
  // Dense MLP, shared experts and routed experts with separate gate and up adapters (their B's
  // packed block-diagonal) or one fused gate_up adapter; A per expert or shared. On the CPU the
  // compute dtype is F32.
  for (const char* gate_up : {"separate", "fused"}) {
    for (const char* expert_a : {"per_expert", "shared"}) {
      INFO(gate_up << ", " << expert_a);
      Config config = testing::tiny_model_config(false);
      config.lora.rank = 4;
      config.lora.targets = {"gate_proj", "up_proj", "down_proj", "shared_experts", "experts", "o_proj"};
      config.lora.expert_gate_up = gate_up;
      config.lora.expert_a = expert_a;
      PlanOptions plan_options;
      plan_options.activation_bytes = 4;
      const MemoryPlan plan = make_memory_plan(config, plan_options);
      const double planned = item_bytes(plan.fixed, "packed MLP and expert adapters");

      auto cpu = kernels::make_cpu_backend();
      testing::CountingBackend backend(*cpu);
      Model model(resolve_model_spec(config), backend, model_options_for(config));
      model.init_random_weights();
      const Batch batch = testing::tiny_batch(config.model.vocab_size, 3);
      const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());
      model.forward_backward(batch, grad_scale);  // what the first step makes and keeps
      model.hold_parameters(true);
      model.forward_backward(batch, grad_scale);
      backend.arm();  // the peak from here starts at the bytes live now
      const double held = static_cast<double>(backend.peak_bytes());
      model.hold_parameters(false);
      backend.arm();
      const double released = static_cast<double>(backend.peak_bytes());
      CHECK(planned > 0);
      CHECK(held - released == planned);
    }
  }
}

TEST_CASE("a KDA layer's saved tensors and chunk states per token, by hand") {
  // tiny_model_config without q LoRA, bf16 activations (a = 2), F32 statistics.
  // MLA: kv latent + normed 2*8*a, rstd 4, q and k 2*2*10*a, v and attn 2*2*5*a, lse 2*4 = 164.
  // KDA (H 2, d 4, c 8): (12 c + 2 d) a + (c + 4 H) 4 = 104 * 2 + 16 * 4 = 272; its chunk states
  // H d^2 x 4 B / 64 = 2 per token.
  Config hybrid = testing::tiny_model_config(false);
  hybrid.parallel.recompute = false;
  Config all_mla = hybrid;
  all_mla.model.layers = {"mla", "mla", "mla"};
  PlanOptions options;
  MemoryPlan with_kda = make_memory_plan(hybrid, options);
  MemoryPlan without = make_memory_plan(all_mla, options);
  const std::string saved = "every layer's saved tensors";
  CHECK(item_bytes(with_kda.per_token_full, saved) - item_bytes(without.per_token_full, saved) == 272.0 - 164.0);
  CHECK(item_bytes(with_kda.per_token_full, "KDA chunk states (inside the op)") == 2.0);
  CHECK(item_bytes(without.per_token_full, "KDA chunk states (inside the op)") == 0.0);
}

TEST_CASE("recompute of the first N layers: the kept layers' saved sets, or one re-run set") {
  // Three alike MoE layers (saved set S each): the backward starts with the kept layers' sets
  // alive and frees them before it re-runs the first ones, one at a time. EP all-to-all: 4
  // passes per MoE layer, 2 more for each re-run one.
  Config config = testing::tiny_model_config(false);
  config.model.layers = {"mla", "mla", "mla"};
  config.model.first_k_dense = 0;
  config.parallel.ep = 2;
  PlanOptions options;
  options.world = 2;
  auto plan_of = [&](bool recompute, int64_t layers) {
    Config c = config;
    c.parallel.recompute = recompute;
    c.parallel.recompute_layers = layers;
    return make_memory_plan(c, options);
  };
  const MemoryPlan all = plan_of(true, -1), off = plan_of(false, -1);
  const double s = item_bytes(all.per_token_recompute, "one layer's saved tensors (re-run)");
  REQUIRE(s > 0);
  CHECK(item_bytes(off.per_token_full, "every layer's saved tensors") == 3 * s);
  const MemoryPlan first1 = plan_of(true, 1), first2 = plan_of(true, 2), first3 = plan_of(true, 3);
  CHECK(first1.recompute_layers == 1);
  CHECK(item_bytes(first1.per_token_recompute, "saved tensors (first 1 of 3 layers re-run)") == 2 * s);
  CHECK(item_bytes(first2.per_token_recompute, "saved tensors (first 2 of 3 layers re-run)") == s);
  CHECK(first3.per_token_bytes(true) == all.per_token_bytes(true));
  CHECK(off.per_token_bytes(false) > first1.per_token_bytes(true));
  CHECK(first1.per_token_bytes(true) > all.per_token_bytes(true));
  // Without recompute the plan's "recompute" column is every layer's.
  CHECK(off.recompute_layers == 3);
  const double ep_off = off.communication.back().bytes;
  REQUIRE(ep_off > 0);
  CHECK(first1.communication.back().bytes == ep_off * 14 / 12);
  CHECK(all.communication.back().bytes == ep_off * 18 / 12);
  CHECK(has_text(format_plan(first1), "recompute on, first 1 of 3 layers"));

  // The peak for any N from one plan, and the fewest first layers to re-run for it to fit.
  MemoryPlan plan = plan_of(true, -1);
  CHECK(plan.peak_bytes_rerunning(3) == Approx(all.peak_bytes(true)).epsilon(1e-12));
  CHECK(plan.peak_bytes_rerunning(1) == Approx(first1.peak_bytes(true)).epsilon(1e-12));
  CHECK(plan.peak_bytes_rerunning(0) == Approx(off.peak_bytes(false)).epsilon(1e-12));
  plan.usable_bytes = (plan.peak_bytes_rerunning(0) + plan.peak_bytes_rerunning(1)) / 2;
  CHECK(plan.fewest_recompute_layers() == 1);
  CHECK(has_text(format_plan(plan), "the fewest layers to re-run: the first 1 of 3 (parallel.recompute_layers: 1;"));
  plan.usable_bytes = plan.peak_bytes_rerunning(0);
  CHECK(plan.fewest_recompute_layers() == 0);
  CHECK(has_text(format_plan(plan), "recompute off fits"));
  plan.usable_bytes = plan.peak_bytes_rerunning(3) / 2;
  CHECK(plan.fewest_recompute_layers() == -1);
}

TEST_CASE("the plan refuses a world the mesh does not fit") {
  Config config = testing::tiny_model_config(false);
  config.parallel.fsdp = 3;
  PlanOptions options;
  options.world = 4;
  try {
    make_memory_plan(config, options);
    FAIL("no error");
  } catch (const moetrain::Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    CHECK(std::string(e.what()).find("`parallel.fsdp` = 3 does not divide the world size") != std::string::npos);
  }
}

TEST_CASE("feed-forward token chunks: the plan keeps a chunk of the feed-forward, or chooses one that fits") {
  Config config = testing::tiny_model_config(true);
  config.model.max_position_embeddings = 1 << 20;
  config.data.seq_len = 1 << 16;
  // A segment of the whole micro-batch: the KDA layer runs whole.
  config.parallel.mixer_segment_tokens = config.data.seq_len * config.data.micro_batch;
  PlanOptions roomy;
  roomy.gpu_bytes = 1e15;
  const MemoryPlan whole = make_memory_plan(config, roomy);
  CHECK(whole.ffn_chunk_tokens == 0);  // it fits whole: no chunks
  CHECK_FALSE(whole.ffn_chunk_auto);

  // A chunk from the config: each layer keeps its mixer half per token; one chunk's
  // feed-forward internals, saved and the backward's temporaries, are fixed bytes.
  config.parallel.ffn_chunk_tokens = 2048;
  const MemoryPlan chunked = make_memory_plan(config, roomy);
  CHECK(chunked.ffn_chunk_tokens == 2048);
  CHECK_FALSE(chunked.ffn_chunk_auto);
  REQUIRE(chunked.layer_saved.size() == whole.layer_saved.size());
  double largest_ffn = 0;
  for (size_t i = 0; i < whole.layer_saved.size(); ++i) {
    const double ffn = whole.layer_saved[i] - chunked.layer_saved[i];
    CHECK(ffn > 0);  // every layer has a feed-forward
    largest_ffn = std::max(largest_ffn, ffn);
  }
  CHECK(chunked.ffn_saved_max_per_token == Approx(largest_ffn));
  CHECK(chunked.fixed_bytes() - whole.fixed_bytes() == Approx(2 * 2048 * largest_ffn));
  CHECK(chunked.peak_bytes(true) < whole.peak_bytes(true));
  config.parallel.ffn_chunk_tokens = whole.tokens_per_micro_batch;  // a chunk of the whole is no chunk
  CHECK(make_memory_plan(config, roomy).ffn_chunk_tokens == 0);

  // Key 0 and too little memory for the whole micro-batch: the largest multiple of 1024 tokens
  // that fits.
  config.parallel.ffn_chunk_tokens = 0;
  PlanOptions tight;
  tight.reserve_fraction = 0.0;
  tight.gpu_bytes = 0.5 * (whole.peak_bytes(true) + chunked.peak_bytes(true));
  const MemoryPlan chosen = make_memory_plan(config, tight);
  INFO("chosen chunk " << chosen.ffn_chunk_tokens);
  CHECK(chosen.ffn_chunk_auto);
  CHECK(chosen.ffn_chunk_tokens >= 2048);
  CHECK(chosen.ffn_chunk_tokens % 1024 == 0);
  CHECK(chosen.fits());
  config.parallel.ffn_chunk_tokens = chosen.ffn_chunk_tokens + 1024;
  CHECK_FALSE(make_memory_plan(config, tight).fits());

  // The aux loss needs the whole micro-batch: no chunk is chosen.
  config.parallel.ffn_chunk_tokens = 0;
  config.model.moe.aux_loss_coef = 0.01;
  CHECK(make_memory_plan(config, tight).ffn_chunk_tokens == 0);
}

// tiny_model_config's KDA layer (layer 1): H 2 heads of d 4 (c = 8 channels), BF16 activations.
// Its forward saves (12c + 2d) x 2 B + (c + 4H) x 4 B = 272 B per token, its backward's
// temporaries (11c + d + H) x 2 B + (c + H) x 4 B = 228 B, the chunk states H d^2 x 4 B / 64 = 2 B,
// and a segment's entering state H d^2 x 4 B = 128 B.
TEST_CASE("KDA time segments: the plan counts one segment's internals, and chooses a segment that fits") {
  Config config = testing::tiny_model_config(true);
  config.model.max_position_embeddings = 1 << 20;
  config.data.seq_len = 1 << 16;
  config.parallel.ffn_chunk_tokens = 2048;
  config.parallel.mixer_segment_tokens = config.data.seq_len * config.data.micro_batch;  // the whole: no segments
  PlanOptions roomy;
  roomy.gpu_bytes = 1e15;
  const MemoryPlan whole = make_memory_plan(config, roomy);
  CHECK(whole.mixer_segment_tokens == 0);
  config.parallel.mixer_segment_tokens = 1024;
  const MemoryPlan segmented = make_memory_plan(config, roomy);
  CHECK(segmented.mixer_segment_tokens == 1024);
  CHECK_FALSE(segmented.mixer_segment_auto);
  REQUIRE(segmented.layer_saved.size() == 3);
  CHECK(whole.layer_saved[0] == segmented.layer_saved[0]);  // MLA and DSA: unchanged
  CHECK(whole.layer_saved[2] == segmented.layer_saved[2]);
  CHECK(whole.layer_saved[1] - segmented.layer_saved[1] == Approx(272.0 - 128.0 / 1024));
  CHECK(segmented.fixed_bytes() - whole.fixed_bytes() == Approx(1024.0 * (272 + 228 + 2)));
  auto item = [](const std::vector<PlanItem>& items, const std::string& name) {
    for (const PlanItem& i : items) {
      if (i.name == name) return i.bytes;
    }
    FAIL("no plan item " << name);
    return 0.0;
  };
  CHECK(item(whole.per_token_recompute, "KDA chunk states (inside the op)") == Approx(2.0));
  CHECK(item(segmented.per_token_recompute, "KDA chunk states (inside the op)") == 0.0);

  // Key 0 and too little memory for the whole-sequence KDA layer: the longest segment of the
  // plan's list that fits (its saved set per token is below the whole one, its fixed part above).
  config.parallel.mixer_segment_tokens = 0;
  PlanOptions tight;
  tight.reserve_fraction = 0.0;
  tight.gpu_bytes = whole.peak_bytes(true) - 1.0;
  const MemoryPlan chosen = make_memory_plan(config, tight);
  INFO("chosen segment " << chosen.mixer_segment_tokens);
  CHECK(chosen.mixer_segment_auto);
  CHECK(chosen.mixer_segment_tokens == 16384);
  CHECK(chosen.fits());
  CHECK(chosen.longest_without_offload == chosen.max_tokens(true));
  config.parallel.offload = true;
  CHECK(make_memory_plan(config, tight).longest_with_offload == chosen.longest_with_offload);
  CHECK(chosen.longest_with_offload >= chosen.longest_without_offload);

  // Under context parallelism the KDA layers run whole (segments take no state from other ranks).
  config.parallel.offload = false;
  config.parallel.cp = 2;
  PlanOptions two = tight;
  two.world = 2;
  CHECK(make_memory_plan(config, two).mixer_segment_tokens == 0);
}

TEST_CASE("parallel.offload: the plan keeps four layer inputs on the device") {
  Config config = testing::tiny_model_config(true);
  config.model.num_layers = 6;  // 7 inputs without offload
  config.model.layers = {"mla", "kda", "dsa", "kda", "mla", "kda"};
  const MemoryPlan kept = make_memory_plan(config, PlanOptions{});
  config.parallel.offload = true;
  const MemoryPlan offloaded = make_memory_plan(config, PlanOptions{});
  const double row = static_cast<double>(config.model.hidden_size) * 2;  // BF16
  CHECK(kept.per_token_recompute[0].bytes == 7 * row);
  CHECK(offloaded.per_token_recompute[0].bytes == 4 * row);
  CHECK(offloaded.per_token_full[0].bytes == 4 * row);
}

TEST_CASE("weight_format fp8: the plan counts what the model keeps in FP8, 1 B a weight and 4 B a block") {
  // hidden 256, MLA (q-LoRA 128, kv-LoRA 128, 2 heads of 64 + 64, v 64), a dense layer of 256,
  // then a MoE layer of 4 experts of 128 and one shared expert: every matrix in whole or partial
  // 128-blocks, worked out by hand below.
  Config config;
  ModelConfig& m = config.model;
  m.vocab_size = 64;
  m.hidden_size = 256;
  m.num_layers = 2;
  m.layers = {"mla", "mla"};
  m.first_k_dense = 1;
  m.intermediate_size = 256;
  m.mla.num_heads = 2;
  m.mla.q_lora_rank = 128;
  m.mla.kv_lora_rank = 128;
  m.mla.qk_nope_head_dim = 64;
  m.mla.qk_rope_head_dim = 64;
  m.mla.v_head_dim = 64;
  m.moe.num_experts = 4;
  m.moe.top_k = 2;
  m.moe.num_shared_experts = 1;
  m.moe.expert_intermediate_size = 128;
  m.weight_format = "fp8";
  config.lora.targets = {"o_proj"};
  const ModelSpec spec = resolve_model_spec(config);
  const ModelParameterCount count = count_model_parameters(spec);
  REQUIRE(count.layers.size() == 2);
  // Attention: q_a [128, 256] 2 blocks, q_b [256, 128] 2, kv_a [192, 256] 4, kv_b [256, 128] 2,
  // o_proj [256, 128] 2: 180224 weights, 12 blocks. Dense MLP: [512, 256] 8 + [256, 256] 4;
  // shared expert (and each routed one): [256, 256] 4 + [256, 128] 2.
  CHECK(count.layers[0].fp8_non_expert == 180224 + 196608);
  CHECK(count.layers[0].fp8_non_expert_blocks == 12 + 12);
  CHECK(count.layers[1].fp8_non_expert == 180224 + 98304);
  CHECK(count.layers[1].fp8_non_expert_blocks == 12 + 6);
  CHECK(count.layers[1].fp8_routed_expert_blocks == 4 * 6);

  // The model holds exactly those: FP8 codes and scales of its FP8 slots.
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  Model model(spec, *backend, ModelOptions{});
  int64_t codes = 0, scales = 0, routed_scales = 0;
  for (const WeightSlot& slot : model.weight_slots()) {
    if (!slot.fp8()) continue;
    const bool routed = slot.name.find(".experts") != std::string::npos;
    (routed ? routed_scales : scales) += slot.scale->numel();
    if (!routed) codes += slot.tensor->numel();
  }
  CHECK(codes == count.layers[0].fp8_non_expert + count.layers[1].fp8_non_expert);
  CHECK(scales == count.layers[0].fp8_non_expert_blocks + count.layers[1].fp8_non_expert_blocks);
  CHECK(routed_scales == count.layers[1].fp8_routed_expert_blocks);

  // One rank: the buckets' bytes are the BF16 rest at 2 B, the FP8 weights at 1 B, the blocks at 4 B.
  PlanOptions options;
  options.world = 1;
  const MemoryPlan plan = make_memory_plan(config, options);
  const double fp8_weights = 376832 + 278528, blocks = 24 + 18;
  const double bf16_rest = static_cast<double>(count.non_expert()) - fp8_weights;
  CHECK(item_bytes(plan.fixed, "frozen weight shards (fp8 + bf16)") == bf16_rest * 2 + fp8_weights + blocks * 4);
  CHECK(item_bytes(plan.fixed, "routed experts (fp8)") == 4.0 * 98304 + 24 * 4);
}

TEST_CASE("expert windows: activations for the window's tokens, FSDP gathers once per pass, the widest that fits") {
  Config config = testing::tiny_model_config(false);  // no DSA: the fixed part does not move with the tokens
  config.model.max_position_embeddings = 4096;
  config.parallel.fsdp = 4;
  config.data.micro_batch = 1;
  config.data.seq_len = 1024;  // the loss chunk is 1024 rows at any window
  config.data.grad_accum = 4;
  PlanOptions options;
  options.world = 4;
  const MemoryPlan one = make_memory_plan(config, options);
  config.train.expert_window = 3;
  const MemoryPlan three = make_memory_plan(config, options);
  CHECK(one.tokens_per_pass() == 1024);
  CHECK(three.tokens_per_pass() == 3 * 1024);
  CHECK(three.passes_per_step() == 2);  // 3 + the 1 left
  CHECK(three.per_token_bytes(true) == one.per_token_bytes(true));
  CHECK(three.fixed_bytes() == one.fixed_bytes());
  CHECK(three.peak_bytes(true) == three.fixed_bytes() + 3 * 1024 * three.per_token_bytes(true));
  auto item = [](const MemoryPlan& plan, const std::string& name) {
    for (const PlanItem& i : plan.communication)
      if (i.name == name) return i.bytes;
    FAIL("no item " << name);
    return 0.0;
  };
  // Each layer gathered in 2 passes instead of 4 micro-batches; the EP bytes do not change.
  CHECK(item(three, "FSDP all-gather of frozen weights") == item(one, "FSDP all-gather of frozen weights") / 2);
  CHECK(item(three, "EP all-to-all (dispatch + combine)") == item(one, "EP all-to-all (dispatch + combine)"));

  // Room for 3.5 micro-batches' activations: windows of up to 3 fit.
  PlanOptions tight = options;
  tight.reserve_fraction = 0.0;
  tight.gpu_bytes = one.fixed_bytes() + 3.5 * 1024 * one.per_token_bytes(true);
  config.train.expert_window = 1;
  CHECK(make_memory_plan(config, tight).widest_expert_window(true) == 3);
  config.train.expert_window = 3;
  CHECK(make_memory_plan(config, tight).fits());
  config.train.expert_window = 4;  // whole it does not fit: the plan chunks the feed-forwards
  CHECK(make_memory_plan(config, tight).ffn_chunk_auto);
  config.train.expert_window = 0;  // the plan's choice: the widest with whole feed-forwards
  const MemoryPlan chosen = make_memory_plan(config, tight);
  CHECK(chosen.expert_window_auto);
  CHECK(chosen.expert_window == 3);
  CHECK_FALSE(chosen.ffn_chunk_auto);
  config.train.expert_window = 4;
  config.model.moe.aux_loss_coef = 0.01;  // which the aux loss forbids
  CHECK_FALSE(make_memory_plan(config, tight).fits());
  tight.gpu_bytes = 1e15;  // never more than the step's micro-batches
  CHECK(make_memory_plan(config, tight).widest_expert_window(true) == 4);
}
