// MLA in query blocks x key chunks on one rank (parallel.attention_query_block,
// parallel.cp_key_chunk) on the GPU: refused with a config error naming the keys while its CUDA
// backward differs from the whole-sequence run (the CPU's blocked run is held to the whole run in
// tests/unit/test_model_mla_blocks.cpp). Documents cross the block edges of the refused run.
#include <algorithm>
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

}  // namespace

// The blocked backward's adapter gradients on CUDA do not yet match the whole run's (docs/PARALLEL.md):
// the backend refuses the keys with a config error.
TEST_CASE("cuda MLA query blocks are refused, naming the keys", "[cuda][model]") {
  std::unique_ptr<kernels::Backend> cuda = kernels::make_cuda_backend();
  const Config config = blocks_config();
  const ModelSpec spec = resolve_model_spec(config);
  const Batch batch = blocks_batch(config.model.vocab_size);
  try {
    run_offload_steps(*cuda, spec, options(DType::kBF16, true, 512, 0), batch, 1);
    FAIL("blocked MLA ran on CUDA");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    CHECK(std::string(e.what()).find("parallel.attention_query_block") != std::string::npos);
  }
}
