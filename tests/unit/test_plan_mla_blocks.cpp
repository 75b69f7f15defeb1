// The plan of MLA in query blocks x key chunks on one rank (parallel.attention_query_block,
// parallel.cp_key_chunk at cp 1): the MLA layers keep the rotated k_pe in place of their keys and
// values, and one block's key chunk is a fixed item.
#include <algorithm>
#include <string>

#include "catch.h"
#include "core/plan/memory_plan.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;

namespace {

double fixed_item(const MemoryPlan& plan, const std::string& name) {
  for (const PlanItem& i : plan.fixed)
    if (i.name == name) return i.bytes;
  FAIL("no item " << name);
  return 0.0;
}

}  // namespace

TEST_CASE("MLA query blocks on one rank: k_pe kept in place of k and v, one block's key chunk fixed") {
  Config config = testing::tiny_model_config(false);  // MLA, KDA, MLA: heads 2, qk 6 + 4, v 5, r 8
  config.data.micro_batch = 2;
  config.data.seq_len = 8;  // 16 tokens
  PlanOptions options;
  options.world = 1;
  const MemoryPlan whole = make_memory_plan(config, options);
  const char* name = "MLA query block and key chunk (one rank)";
  CHECK(fixed_item(whole, name) == 0.0);

  config.parallel.attention_query_block = 4;
  config.parallel.cp_key_chunk = 3;
  const MemoryPlan blocked = make_memory_plan(config, options);
  // A chunk of 3 keys: k, v, their gradients, kv_b_proj's output gradient 3 x 3 x 2 heads x
  // (10 + 5) x 2 B; its latent gradient 3 x (8 + 4) x 2 B; a block of 4 queries' dq, 4 x 2 x
  // max(10 x 2 B, 5 x 2 B + 4 B).
  CHECK(fixed_item(blocked, name) == 3.0 * 3 * 2 * 15 * 2 + 3.0 * 12 * 2 + 4.0 * 2 * 20);
  // The MLA layers (0 and 2) keep k_pe (4 x 2 B) for k and v (2 x 15 x 2 B); KDA's is as it was.
  REQUIRE(blocked.layer_saved.size() == 3);
  CHECK(blocked.layer_saved[0] - whole.layer_saved[0] == 4.0 * 2 - 2 * 15 * 2);
  CHECK(blocked.layer_saved[2] - whole.layer_saved[2] == 4.0 * 2 - 2 * 15 * 2);
  CHECK(blocked.layer_saved[1] == whole.layer_saved[1]);

  // Key chunks alone: one block of the whole micro-batch.
  config.parallel.attention_query_block = 0;
  CHECK(fixed_item(make_memory_plan(config, options), name) == 3.0 * 3 * 2 * 15 * 2 + 3.0 * 12 * 2 + 16.0 * 2 * 20);
  // Blocks past the micro-batch: the micro-batch; chunks default to the block.
  config.parallel.attention_query_block = 1000;
  config.parallel.cp_key_chunk = 0;
  CHECK(fixed_item(make_memory_plan(config, options), name) ==
        3.0 * 16 * 2 * 15 * 2 + 16.0 * 12 * 2 + 16.0 * 2 * 20);
  // Under context parallelism the shards' path runs instead.
  config.parallel.cp = 4;
  options.world = 4;
  CHECK(fixed_item(make_memory_plan(config, options), name) == 0.0);
}
