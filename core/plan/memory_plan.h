// `moetrain plan`: per-rank memory and per-step communication of a config on a given world
// size, computed from the shapes alone (no GPU, no weights). docs/PLAN.md gives every formula.
//
// Memory splits into what does not depend on the tokens a rank processes (weight shards,
// gathered buffers, experts, adapters and optimizer state, the loss chunk) and bytes per token
// (activations, EP buffers), so the plan can say how many tokens per micro-batch fit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/plan/param_count.h"

namespace moetrain {

struct PlanOptions {
  int world = 1;
  double gpu_bytes = 141e9;        // H200: 141 GB
  double reserve_fraction = 0.08;  // CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation
  double capacity_factor = 1.0;    // routed rows a rank receives / its balanced share
  int64_t activation_bytes = 2;    // BF16 activations (the CUDA backend's policy)
  int64_t loss_chunk_rows = 1024;  // ModelOptions::loss_chunk_rows
};

struct PlanItem {
  std::string name;
  double bytes = 0;         // memory: bytes on one rank; communication: bytes one rank sends per step
  std::string formula;      // how it was computed, in words and symbols
};

struct MemoryPlan {
  // The job.
  int world = 1, fsdp = 1, ep = 1, replicate = 1, prefetch = 1, cp = 1;
  bool recompute = true;
  // Layers that re-run their forward in the "recompute" column (per_token_recompute): all of
  // them, or the first parallel.recompute_layers.
  int64_t recompute_layers = 0;
  int64_t num_layers = 0;
  int64_t tokens_per_micro_batch = 0;  // this rank's: data.micro_batch x data.seq_len / parallel.cp
  // The feed-forwards' token chunk (parallel.ffn_chunk_tokens; 0: the whole micro-batch at once).
  // The config's, or with the key at 0 the plan's choice (ffn_chunk_auto): the whole micro-batch
  // when it fits, else the largest chunk that does (at least ~128 rows per local expert).
  int64_t ffn_chunk_tokens = 0;
  bool ffn_chunk_auto = false;
  double ffn_saved_max_per_token = 0;  // the largest feed-forward's internals, bytes per token
  // The KDA layers' time segment (parallel.mixer_segment_tokens; 0: the whole micro-batch). The
  // config's, or with the key at 0 the plan's choice (mixer_segment_auto): none when the plan fits
  // without, else the longest of 16K, 8K, 4K, 2K, 1K tokens that fits.
  int64_t mixer_segment_tokens = 0;
  bool mixer_segment_auto = false;
  // The longest micro-batch per rank that fits (recompute as configured) with feed-forward chunks
  // and KDA segments on (the chosen ones, else the smallest the plan would choose), without and
  // with parallel.offload.
  int64_t longest_without_offload = 0;
  int64_t longest_with_offload = 0;
  int64_t micro_batches = 1;           // data.grad_accum
  // train.expert_window: micro-batches that run as one pass, so the activations are sized for
  // tokens_per_pass(); the FSDP gathers happen once per pass.
  int64_t expert_window = 1;
  bool expert_window_auto = false;  // train.expert_window 0: the plan chose it
  int64_t tokens_per_pass() const { return tokens_per_micro_batch * expert_window; }
  int64_t passes_per_step() const { return (micro_batches + expert_window - 1) / expert_window; }
  int64_t local_experts = 0;
  ModelParameterCount params;
  LoraParameterCount lora;

  std::vector<PlanItem> fixed;                // per rank, independent of tokens
  std::vector<PlanItem> per_token_recompute;  // bytes per token of the micro-batch
  std::vector<PlanItem> per_token_full;       // the same without recompute
  std::vector<double> layer_saved;            // per layer: bytes per token its forward saves
  std::vector<PlanItem> communication;        // bytes sent per rank per optimizer step
  double ep_receive_worst_case_per_token = 0; // if every peer routed its tokens to this rank
  // Context parallelism's balance: the busiest rank's model FLOPs over the mean rank's, with every
  // window of the micro-batch one document, in the configured layout (parallel.cp_layout), and in
  // each layout: contiguous shards (causal attention gives later shards more keys per query) and
  // balanced chunk pairs (0 when data.seq_len is no multiple of 2 cp). 1 without cp or attention.
  bool cp_balanced = false;
  double cp_busiest_over_mean = 1.0;
  double cp_busiest_contiguous = 1.0, cp_busiest_balanced = 1.0;

  double gpu_bytes = 0, usable_bytes = 0;

  double fixed_bytes() const;
  double per_token_bytes(bool with_recompute) const;
  double peak_bytes(bool with_recompute) const;          // at tokens_per_pass()
  int64_t max_tokens(bool with_recompute) const;          // per pass that fit usable_bytes
  // The widest expert window whose pass fits usable_bytes at this micro-batch, at most
  // micro_batches (0: not even one micro-batch; the feed-forward chunk held as planned).
  int64_t widest_expert_window(bool with_recompute) const;
  // The peak with the first `layers` re-run (0: none, num_layers: all; parallel.recompute_layers),
  // and the fewest that fit usable_bytes (-1: not even all).
  double peak_bytes_rerunning(int64_t layers) const;
  int64_t fewest_recompute_layers() const;
  double communication_bytes() const;
  bool fits() const { return peak_bytes(recompute) <= usable_bytes; }
};

// Throws Error(kBadConfig) when the config does not fit the world (mesh rules). With
// train.expert_window 0 the plan chooses the window: the widest of data.grad_accum micro-batches
// whose pass fits with its feed-forwards whole (a chunked one would split the grouped GEMMs
// again), else 1; always 1 under context parallelism.
MemoryPlan make_memory_plan(const Config& config, const PlanOptions& options);

std::string format_plan(const MemoryPlan& plan);       // a readable table
std::string plan_to_json(const MemoryPlan& plan);      // the same numbers as one JSON object

}  // namespace moetrain
