// `moetrain merge`: the base model with a checkpoint's LoRA adapters folded in, W + s B A (s =
// alpha / r, or alpha / sqrt(r) with rsLoRA, per module as lora.rank_pattern / alpha_pattern give
// it), written as a Hugging Face directory that engines without (MoE-)LoRA support serve as is:
//
//   config.json                        the base's, byte for byte (MXFP4 bases: see below)
//   model-0000K-of-0000N.safetensors   every base tensor under its own name and dtype; the base's
//                                      own shards (file names and grouping), or shards of at most
//                                      max_shard_bytes; untouched tensors bit-identical
//   model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map"}
//   the base's other top-level files   tokenizer, generation config, remote code: copied
//
// Which base tensor an adapter changes is what the loader reads that weight from (hf_names.h):
// plain, transformers 5 or Moonshot names, a fused qkv adapter onto separate q/k/v tensors, the
// routed experts' fused gate_up_proj / down_proj or per-expert tensors, Kimi K3's text model
// under language_model.. Every adapter must find its tensors, of the right shape (else
// Error(kBadCheckpoint) naming the module): none is dropped silently.
//
// MXFP4 experts (compressed-tensors `<name>.weight_packed` + `.weight_scale`) cannot hold W + s B A
// exactly (the delta is far below the format's step), so every packed weight is written decoded,
// as BF16 `<name>.weight` (exact for the untouched ones), and config.json loses its
// quantization_config (top level and text_config): the result is a plain BF16 model, about four
// times the experts' packed size; re-quantize it with the serving stack's tools if needed. FP8
// bases are refused when read (moetrain reads no FP8 tensors, so it cannot have trained on one).
//
// Many ranks (mpirun): output shard i is written by rank i mod world, each tensor computed and
// streamed on its own (host memory ~ the largest tensor in F64, never the model); rank 0 writes
// config.json and the index last. Everything goes to <out>.tmp/ (marked as a merge in progress,
// so a later merge may clear it), renamed to <out> at the end: a directory named <out> is always
// complete. An existing non-empty <out> is never touched (Error(kBadConfig)).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moetrain {

class CheckpointGroup;

struct MergeOptions {
  std::string checkpoint;                // a step_<N> directory or a checkpoint root (its newest)
  std::string out_dir;
  std::optional<std::string> base_dir;   // default: the checkpoint's model.hf_dir
  uint64_t max_shard_bytes = 0;          // 0: the base's own shards
};

// Every rank of `group` calls it; errors are agreed on, so every rank throws together.
void merge_checkpoint(CheckpointGroup& group, const MergeOptions& options);

// "5GB", "200MB", "64KiB", "1000" (bytes) -> bytes; Error(kBadConfig) naming `what` otherwise.
uint64_t parse_byte_size(const std::string& text, const std::string& what);

}  // namespace moetrain
