// The plan as a table for people and as JSON for scripts.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/plan/memory_plan.h"

namespace moetrain {
namespace {

std::string gb(double bytes) { return fmt::format("{:10.2f} GB", bytes / 1e9); }
std::string count(double n) {
  if (n >= 1e12) return fmt::format("{:.3f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  return fmt::format("{:.0f}", n);
}
void rows(std::string& out, const std::vector<PlanItem>& items, double scale) {
  for (const PlanItem& item : items) {
    out += fmt::format("  {:<42}{}    {}\n", item.name, gb(item.bytes * scale), item.formula);
  }
}

nlohmann::json items_json(const std::vector<PlanItem>& items) {
  nlohmann::json list = nlohmann::json::array();
  for (const PlanItem& item : items) {
    list.push_back({{"name", item.name}, {"bytes", item.bytes}, {"formula", item.formula}});
  }
  return list;
}

}  // namespace

std::string format_plan(const MemoryPlan& plan) {
  const ModelParameterCount& p = plan.params;
  // "on", or "on, first N of L layers" where parallel.recompute_layers chose fewer.
  const std::string on = plan.recompute_layers == plan.num_layers
                             ? std::string("on")
                             : fmt::format("on, first {} of {} layers", plan.recompute_layers, plan.num_layers);
  std::string out;
  out += fmt::format("world {} = fsdp {} x replicate {}; ep {} ({} experts per rank, {} replicas of each)\n",
                     plan.world, plan.fsdp, plan.replicate, plan.ep, plan.local_experts, plan.world / plan.ep);
  out += fmt::format("parameters: total {} = non-expert {} + routed experts {}{}\n", count(p.total()),
                     count(p.non_expert()), count(p.routed_experts()),
                     p.vision() > 0 ? fmt::format(" + vision tower {} + projector {}", count(p.vision_tower),
                                                  count(p.projector))
                                    : std::string());
  out += fmt::format("LoRA: {} = non-expert {} + routed experts {}\n", count(plan.lora.total()),
                     count(plan.lora.non_expert()), count(plan.lora.routed_experts()));
  out += fmt::format("micro-batch: {} tokens per rank{}, {} micro-batches per step, recompute {}\n\n",
                     plan.tokens_per_micro_batch,
                     plan.cp > 1 ? fmt::format(" (a shard: cp {} ranks share each micro-batch of {} tokens)", plan.cp,
                                               plan.tokens_per_micro_batch * plan.cp)
                                 : "",
                     plan.micro_batches, plan.recompute ? on : "off");
  if (plan.expert_window_auto) {
    out += fmt::format("expert window chosen: {} micro-batch(es) per pass, the widest of the step's {} that fits with "
                       "whole feed-forwards (train.expert_window sets it)\n",
                       plan.expert_window, plan.micro_batches);
  }
  if (plan.expert_window > 1) {
    out += fmt::format("expert window: {} micro-batches per pass (train.expert_window), {} pass(es) per step: the "
                       "activations below are for the pass's {} tokens; each MoE layer's grouped GEMM takes their "
                       "rows at once, and FSDP gathers each layer {} time(s) per step instead of {}\n\n",
                       plan.expert_window, plan.passes_per_step(), plan.tokens_per_pass(), plan.passes_per_step(),
                       plan.micro_batches);
  }

  out += "memory per rank, fixed\n";
  rows(out, plan.fixed, 1.0);
  out += fmt::format("  {:<42}{}\n\n", "fixed total", gb(plan.fixed_bytes()));
  const double tokens = static_cast<double>(plan.tokens_per_pass());
  for (bool recompute : {true, false}) {
    out += fmt::format("memory per rank, per token x {} tokens ({})\n", plan.tokens_per_pass(),
                       "recompute " + (recompute ? on : "off"));
    rows(out, recompute ? plan.per_token_recompute : plan.per_token_full, tokens);
    out += fmt::format("  {:<42}{}   ({:.1f} KB per token)\n", "peak", gb(plan.peak_bytes(recompute)),
                       plan.per_token_bytes(recompute) / 1e3);
  }
  if (plan.ep > 1) {
    out += fmt::format("  EP receive buffer if every peer sent all it could to this rank: {} (not in the totals)\n",
                       gb(plan.ep_receive_worst_case_per_token * tokens));
  }
  out += "\ncommunication per rank per optimizer step (bytes sent)\n";
  rows(out, plan.communication, 1.0);
  out += fmt::format("  {:<42}{}\n", "total", gb(plan.communication_bytes()));
  if (plan.cp > 1) {
    // Each window one document: causal attention gives later tokens more keys.
    const std::string balanced = plan.cp_busiest_balanced > 0
                                     ? fmt::format("{:.2f}x", plan.cp_busiest_balanced)
                                     : std::string("not possible (data.seq_len is no multiple of 2 cp)");
    out += fmt::format("  context parallelism ({} layout): the busiest of the cp {} ranks does {:.2f}x the mean's "
                       "FLOPs; contiguous shards {:.2f}x, balanced chunk pairs {} (each window one document)\n",
                       plan.cp_balanced ? "balanced" : "contiguous", plan.cp, plan.cp_busiest_over_mean,
                       plan.cp_busiest_contiguous, balanced);
  }
  out += "\n";

  out += fmt::format("GPU {:.0f} GB, usable {:.1f} GB after the reserve\n", plan.gpu_bytes / 1e9,
                     plan.usable_bytes / 1e9);
  for (bool recompute : {true, false}) {
    const double peak = plan.peak_bytes(recompute);
    out += fmt::format("  recompute {:<3}: peak {:.1f} GB -> {}; at most {} tokens per {} per rank{}; expert "
                       "windows of up to {} of the {} micro-batches fit\n",
                       recompute ? on : "off", peak / 1e9, peak <= plan.usable_bytes ? "fits" : "DOES NOT FIT",
                       plan.max_tokens(recompute), plan.expert_window > 1 ? "pass" : "micro-batch",
                       plan.cp > 1 ? fmt::format(" ({} per micro-batch over the cp {} ranks)",
                                                 plan.max_tokens(recompute) * plan.cp, plan.cp)
                                   : "",
                       plan.widest_expert_window(recompute), plan.micro_batches);
  }
  const int64_t fewest = plan.fewest_recompute_layers();
  if (fewest == 0) {
    out += "  every layer may keep its activations (recompute off fits)\n";
  } else if (fewest > 0) {
    out += fmt::format("  the fewest layers to re-run: the first {} of {} (parallel.recompute_layers: {}; each one "
                       "re-run costs a layer's forward)\n",
                       fewest, plan.num_layers, fewest);
  }
  if (plan.ffn_chunk_tokens > 0) {
    out += fmt::format("  feed-forwards in token chunks of {} ({})\n", plan.ffn_chunk_tokens,
                       plan.ffn_chunk_auto ? fmt::format("chosen: the whole {} does not fit; parallel.ffn_chunk_tokens "
                                                         "sets it",
                                                         plan.expert_window > 1 ? "expert window" : "micro-batch")
                                           : std::string("parallel.ffn_chunk_tokens"));
  }
  if (plan.mixer_segment_tokens > 0) {
    out += fmt::format("  KDA layers in time segments of {} ({})\n", plan.mixer_segment_tokens,
                       plan.mixer_segment_auto ? "chosen: the whole-sequence mixer does not fit; "
                                                 "parallel.mixer_segment_tokens sets it"
                                               : "parallel.mixer_segment_tokens");
  }
  out += fmt::format("  longest micro-batch per rank that fits (recompute {}, feed-forward chunks and KDA segments "
                     "on): {} tokens without offload, {} with parallel.offload\n",
                     plan.recompute ? on : "off", plan.longest_without_offload, plan.longest_with_offload);
  out += fmt::format("verdict (recompute {} as configured): {}\n", plan.recompute ? on : "off",
                     plan.fits() ? "fits" : "does not fit");
  return out;
}

std::string plan_to_json(const MemoryPlan& plan) {
  const ModelParameterCount& p = plan.params;
  nlohmann::json j;
  j["world"] = plan.world;
  j["fsdp"] = plan.fsdp;
  j["replicate"] = plan.replicate;
  j["ep"] = plan.ep;
  j["cp"] = plan.cp;
  j["local_experts"] = plan.local_experts;
  j["tokens_per_micro_batch"] = plan.tokens_per_micro_batch;
  j["micro_batches"] = plan.micro_batches;
  j["expert_window"] = plan.expert_window;
  j["expert_window_auto"] = plan.expert_window_auto;
  j["tokens_per_pass"] = plan.tokens_per_pass();
  j["recompute"] = plan.recompute;
  j["recompute_layers"] = plan.recompute_layers;  // of the recompute column
  j["num_layers"] = plan.num_layers;
  j["fewest_recompute_layers"] = plan.fewest_recompute_layers();  // -1: none fits
  j["parameters"] = {{"total", p.total()},
                     {"non_expert", p.non_expert()},
                     {"routed_experts", p.routed_experts()},
                     {"vision_tower", p.vision_tower},
                     {"projector", p.projector}};
  j["lora_parameters"] = {{"total", plan.lora.total()},
                          {"non_expert", plan.lora.non_expert()},
                          {"routed_experts", plan.lora.routed_experts()}};
  j["memory"] = {{"fixed", items_json(plan.fixed)},
                 {"per_token_recompute", items_json(plan.per_token_recompute)},
                 {"per_token_no_recompute", items_json(plan.per_token_full)},
                 {"fixed_bytes", plan.fixed_bytes()},
                 {"peak_bytes_recompute", plan.peak_bytes(true)},
                 {"peak_bytes_no_recompute", plan.peak_bytes(false)},
                 {"max_tokens_recompute", plan.max_tokens(true)},
                 {"max_tokens_no_recompute", plan.max_tokens(false)},
                 {"widest_expert_window_recompute", plan.widest_expert_window(true)},
                 {"widest_expert_window_no_recompute", plan.widest_expert_window(false)},
                 {"ep_receive_worst_case_bytes", plan.ep_receive_worst_case_per_token *
                                                     static_cast<double>(plan.tokens_per_pass())}};
  j["communication"] = {{"items", items_json(plan.communication)}, {"total_bytes", plan.communication_bytes()}};
  j["gpu_bytes"] = plan.gpu_bytes;
  j["usable_bytes"] = plan.usable_bytes;
  j["ffn_chunk_tokens"] = plan.ffn_chunk_tokens;  // 0: the whole micro-batch
  j["ffn_chunk_auto"] = plan.ffn_chunk_auto;
  j["cp_layout"] = plan.cp_balanced ? "balanced" : "contiguous";
  j["cp_busiest_over_mean"] = plan.cp_busiest_over_mean;
  j["cp_busiest_over_mean_contiguous"] = plan.cp_busiest_contiguous;
  j["cp_busiest_over_mean_balanced"] = plan.cp_busiest_balanced;
  j["mixer_segment_tokens"] = plan.mixer_segment_tokens;  // 0: the whole micro-batch
  j["mixer_segment_auto"] = plan.mixer_segment_auto;
  j["longest_tokens_without_offload"] = plan.longest_without_offload;
  j["longest_tokens_with_offload"] = plan.longest_with_offload;
  j["fits"] = plan.fits();
  return j.dump(2);
}

}  // namespace moetrain
