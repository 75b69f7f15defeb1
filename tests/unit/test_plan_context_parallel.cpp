// core/plan under context parallelism: each rank's shard of the tokens and the gathered latent,
// the exchanges per step in both layouts (parallel.cp_layout), and the balance of the causal work
// (the busiest rank's model FLOPs over the mean's), worked out by hand on small configs.
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/data/context_shards.h"
#include "core/plan/memory_plan.h"
#include "core/plan/model_flops.h"
#include "core/plan/param_count.h"
#include "tiny_model.h"

using namespace moetrain;

TEST_CASE("context parallelism: each rank plans its shard of the tokens and the gathered MLA latent") {
  Config config = testing::tiny_model_config(false);  // MLA, KDA, MLA
  config.data.micro_batch = 2;
  config.data.seq_len = 8;
  PlanOptions options;
  options.world = 4;
  const MemoryPlan whole = make_memory_plan(config, options);
  config.parallel.cp = 4;
  const MemoryPlan shard = make_memory_plan(config, options);
  CHECK(whole.tokens_per_micro_batch == 16);
  CHECK(shard.cp == 4);
  CHECK(shard.tokens_per_micro_batch == 4);
  auto item = [](const MemoryPlan& plan, const std::string& name) {
    for (const PlanItem& i : plan.per_token_recompute)
      if (i.name == name) return i.bytes;
    FAIL("no item " << name);
    return 0.0;
  };
  // Per token of the shard: 2 x cp 4 x the latent (r 8 + rope 4) x 2 B, the gathered rows and
  // their gradient; a chunk of 4 keys (the shard) x 3 and the shard's out or dq (1), each heads 2
  // x (qk 6 + 4, v 5) x 2 B; none without cp.
  const char* name = "context-parallel latent and key chunk (MLA)";
  CHECK(item(shard, name) == 2.0 * 4 * 12 * 2 + (3.0 + 1) * 2 * 15 * 2);
  CHECK(item(whole, name) == 0.0);
  // An MLA layer keeps, for its k and v (2 x 15 x 2 B), the latent rows its queries see: cp 4 x 12
  // x 2 B. Layers 0 and 2 are MLA, layer 1 KDA.
  REQUIRE(shard.layer_saved.size() == 3);
  CHECK(shard.layer_saved[0] - whole.layer_saved[0] == 4.0 * 12 * 2 - 2 * 15 * 2);
  CHECK(shard.layer_saved[1] == whole.layer_saved[1]);
  const auto largest = [](const MemoryPlan& p) { return *std::max_element(p.layer_saved.begin(), p.layer_saved.end()); };
  // Re-run and backward temporaries both count the largest saved set.
  CHECK(shard.per_token_bytes(true) - whole.per_token_bytes(true) ==
        Approx(item(shard, name) + 2 * (largest(shard) - largest(whole))));
  // Key chunks of 3 rows: 3 x 3 / 4 of a token's expanded row; past the visible rows (cp x 4),
  // the visible rows.
  config.parallel.cp_key_chunk = 3;
  CHECK(item(make_memory_plan(config, options), name) == Approx(2.0 * 4 * 12 * 2 + (9.0 / 4 + 1) * 2 * 15 * 2));
  config.parallel.cp_key_chunk = 1000;
  CHECK(item(make_memory_plan(config, options), name) == Approx(2.0 * 4 * 12 * 2 + (3.0 * 16 / 4 + 1) * 2 * 15 * 2));
  config.parallel.cp_key_chunk = 0;
  config.parallel.cp = 3;  // does not divide the world
  CHECK_THROWS_AS(make_memory_plan(config, options), Error);
}

TEST_CASE("context parallelism: the plan counts each mixer's exchanges per step") {
  Config config = testing::tiny_model_config(true);  // MLA, KDA, DSA
  config.data.micro_batch = 2;
  config.data.seq_len = 8;
  config.data.grad_accum = 2;
  config.parallel.recompute = true;
  PlanOptions options;
  options.world = 4;
  auto item = [](const MemoryPlan& plan, const std::string& name) {
    for (const PlanItem& i : plan.communication)
      if (i.name == name) return i.bytes;
    return -1.0;
  };
  CHECK(item(make_memory_plan(config, options), "CP MLA latent") == -1.0);  // none at cp 1
  config.parallel.cp = 4;
  config.parallel.cp_layout = "contiguous";
  // 4 tokens a rank, 3 other ranks, 2 micro-batches, every layer re-run, 2 B activations.
  const MemoryPlan plan = make_memory_plan(config, options);
  REQUIRE(plan.tokens_per_micro_batch == 4);
  // MLA: the latent (8 + 4) gathered forward and re-run (the backward keeps the re-run's), and
  // its gradient.
  CHECK(item(plan, "CP MLA latent") == 2.0 * 3 * 3 * 4 * 12 * 2);
  // DSA: latent (8 + 4) and indexer keys (6) forward and re-run, the latent and its gradient.
  CHECK(item(plan, "CP DSA latent and indexer keys") == 2.0 * 3 * (2 * 18 + 2 * 12) * 4 * 2);
  // KDA: M [2, 4, 4] and a state [2, 4, 4] in F32 forward, re-run and backward; the 3 last rows of
  // q, k and v (3 x 2 heads x 4) forward, re-run, and twice in the backward.
  CHECK(item(plan, "CP KDA state transitions") == 2.0 * 3 * 3 * (32 + 32) * 4);
  CHECK(item(plan, "CP KDA convolution halo") == 2.0 * 3 * 4 * 3 * 24 * 2);
  config.parallel.recompute = false;
  const MemoryPlan kept = make_memory_plan(config, options);
  CHECK(item(kept, "CP MLA latent") == 2.0 * 3 * 2 * 4 * 12 * 2);
  CHECK(item(kept, "CP KDA state transitions") == 2.0 * 3 * 2 * (32 + 32) * 4);
  config.parallel.recompute = true;
  // Balanced: a rank holds two spans of each of the 2 windows, each with its (M, state) pair and
  // its halo; the latent pieces stay one padded shard a rank.
  config.parallel.cp_layout = "balanced";
  const MemoryPlan paired = make_memory_plan(config, options);
  CHECK(item(paired, "CP KDA state transitions") == 4 * 2.0 * 3 * 3 * (32 + 32) * 4);
  CHECK(item(paired, "CP KDA convolution halo") == 4 * 2.0 * 3 * 4 * 3 * 24 * 2);
  CHECK(item(paired, "CP MLA latent") == item(plan, "CP MLA latent"));
  CHECK(item(paired, "CP DSA latent and indexer keys") == item(plan, "CP DSA latent and indexer keys"));
}

TEST_CASE("context parallelism: the plan says how much more work the busiest contiguous shard does") {
  Config config = testing::tiny_model_config(false);  // MLA, KDA, MLA
  config.data.micro_batch = 1;
  config.data.seq_len = 8;
  config.parallel.cp_layout = "contiguous";
  PlanOptions options;
  options.world = 2;
  CHECK(make_memory_plan(config, options).cp_busiest_over_mean == 1.0);
  config.parallel.cp = 2;
  // One window of 8: shard 0's queries see 1 + 2 + 3 + 4 = 10 keys, shard 1's 5 + ... + 8 = 26. With
  // c FLOPs per token and A per causal pair, the first 4 tokens cost 4c + 10A and all 8 cost
  // 8c + 36A; shard 1 costs 4c + 26A against a mean of 4c + 18A.
  const ModelFlops flops(plan_model_spec(config.model), config.lora);
  const double four = flops.step(4, {0, 4}).total(), eight = flops.step(8, {0, 8}).total();
  const double per_pair = (eight - 2 * four) / 16, per_token = (four - 10 * per_pair) / 4;
  REQUIRE(per_pair > 0);
  CHECK(make_memory_plan(config, options).cp_busiest_over_mean ==
        Approx((4 * per_token + 26 * per_pair) / (4 * per_token + 18 * per_pair)).epsilon(1e-12));
  // Longer windows: attention's share and the imbalance grow, bounded by (2 cp - 1) / cp.
  config.data.seq_len = 32;
  options.world = 4;
  config.parallel.cp = 4;
  const double at_32 = make_memory_plan(config, options).cp_busiest_over_mean;
  config.model.max_position_embeddings = 4096;
  config.data.seq_len = 4096;
  const double at_4096 = make_memory_plan(config, options).cp_busiest_over_mean;
  CHECK(at_32 > 1.0);
  CHECK(at_4096 > at_32);
  CHECK(at_4096 < 7.0 / 4.0);
  // KDA's cost is per token: its shards balance exactly.
  config.model.layers = {"kda", "kda", "kda"};
  CHECK(make_memory_plan(config, options).cp_busiest_over_mean == Approx(1.0).epsilon(1e-12));
}

TEST_CASE("context parallelism: a shard's model FLOPs count its queries' keys on other ranks") {
  Config config = testing::tiny_model_config(true);  // MLA, KDA, DSA
  const ModelFlops flops(plan_model_spec(config.model), config.lora);
  // Two windows of 12, documents [0, 5) [5, 12) | [12, 24); every layout's shares add up to the
  // whole micro-batch's FLOPs, and one rank holding everything costs the same.
  const std::vector<int32_t> cu = {0, 5, 12, 24};
  const double whole = flops.step(24, cu).total();
  for (const ContextShards& shards : {ContextShards::even(cu, 3), ContextShards::balanced(cu, 3, 12),
                                      ContextShards::balanced(cu, 1, 12)}) {
    double sum = 0;
    for (int r = 0; r < shards.ranks(); ++r) sum += flops.shard(shards, r).total();
    CHECK(sum == Approx(whole).epsilon(1e-12));
  }
  // Rank 1 of two contiguous shards holds [12, 24): one whole document, as on its own.
  CHECK(flops.shard(ContextShards::even(cu, 2), 1).total() == Approx(flops.step(12, {0, 12}).total()).epsilon(1e-12));
  // Rank 2 of three holds [16, 24): more than a document of 8 alone (its queries see [12, 16) too).
  CHECK(flops.shard(ContextShards::even(cu, 3), 2).total() > flops.step(8, {0, 8}).total());
}

TEST_CASE("context parallelism: balanced chunk pairs give every rank the same causal work") {
  Config config = testing::tiny_model_config(false);  // MLA, KDA, MLA
  config.data.micro_batch = 2;
  config.data.seq_len = 8;
  PlanOptions options;
  options.world = 2;
  config.parallel.cp = 2;
  // Chunks of 2: rank 0 holds tokens 1-2 and 7-8 of each window (1 + 2 + 7 + 8 = 18 keys), rank 1
  // tokens 3-6 (3 + 4 + 5 + 6 = 18); contiguous, rank 1 holds the second window, no worse than
  // rank 0 (windows are documents of their own).
  const MemoryPlan balanced = make_memory_plan(config, options);
  CHECK(balanced.cp_balanced);
  CHECK(balanced.cp_busiest_over_mean == balanced.cp_busiest_balanced);
  CHECK(balanced.cp_busiest_balanced == Approx(1.0).epsilon(1e-12));
  CHECK(balanced.cp_busiest_contiguous == Approx(1.0).epsilon(1e-12));
  // One window of 4096 at cp 4: contiguous is far off, balanced exact.
  config.model.max_position_embeddings = 4096;
  config.data.micro_batch = 1;
  config.data.seq_len = 4096;
  options.world = 4;
  config.parallel.cp = 4;
  const MemoryPlan long_window = make_memory_plan(config, options);
  CHECK(long_window.cp_busiest_contiguous > 1.15);
  CHECK(long_window.cp_busiest_balanced == Approx(1.0).epsilon(1e-12));
  CHECK(long_window.cp_busiest_over_mean == long_window.cp_busiest_balanced);
  config.parallel.cp_layout = "contiguous";
  CHECK(make_memory_plan(config, options).cp_busiest_over_mean == long_window.cp_busiest_contiguous);
  // A window that does not split into 2 cp chunks: no balanced figure.
  config.data.seq_len = 4092;
  CHECK(make_memory_plan(config, options).cp_busiest_balanced == 0.0);
}
