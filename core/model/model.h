// The decoder-only LM, assembled from a ModelSpec:
//   embed -> L x [x + mixer(norm(x)); h + ffn(norm(h))] -> norm -> lm_head -> cross-entropy
// with LoRA adapters on the configured targets. Forward and backward are explicit (no
// autograd): each layer saves what its backward needs, or, with recompute, only the layer
// inputs are kept and each layer is re-run just before its backward.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/model/attn_res.h"
#include "core/model/fsdp_schedule.h"
#include "core/model/layer.h"
#include "core/model/layer_checkpoints.h"
#include "core/model/lora_linear.h"
#include "core/model/mla.h"
#include "core/model/model_spec.h"
#include "core/model/parallel_groups.h"
#include "core/model/parameter_group.h"
#include "core/model/step_io.h"
#include "core/model/trainable_model.h"
#include "core/model/vision_tower.h"

namespace moetrain {

class HfCheckpoint;

struct ModelOptions {
  DType dtype = DType::kF32;         // activations and base weights: F32 (F64 for gradient checks) on
                                     // the CPU, BF16 on CUDA; LoRA parameters are F32 (F64)
  // Re-run layers' forwards in the backward: every layer, or the first recompute_layers of them
  // (-1: every layer; parallel.recompute, parallel.recompute_layers).
  bool recompute = false;
  int64_t recompute_layers = -1;
  // The layer inputs wait for the backward in page-locked host memory (parallel.offload;
  // LayerCheckpoints), except those Block Attention Residuals read as block summaries.
  bool offload = false;
  uint64_t seed = 1234;              // LoRA init and random base weights
  LoraSettings lora;
  std::vector<std::string> lora_targets;
  // lora.expert_gate_up: fused gives each routed expert PEFT's one adapter on gate_up_proj (rank
  // 2r, SwigluExperts::gate_up_lora) instead of separate gate and up adapters of rank r.
  bool fused_expert_gate_up = false;
  // lora.rank_pattern / alpha_pattern: per-module ranks and alphas (core/config/lora_patterns.h).
  PatternMap<int64_t> lora_rank_pattern;
  PatternMap<double> lora_alpha_pattern;
  // lora.expert_a: shared gives each routed projection one A for all experts of the layer
  // (SwigluExperts::shared_lora_a): a replicated parameter, B stays per expert.
  bool shared_expert_a = false;
  // The aux loss is a mean over the step's sequences: each micro-batch's share is
  // 1 / (grad_accum x data-parallel ranks).
  double aux_loss_weight = 1.0;
  int64_t loss_chunk_rows = 1024;    // rows of logits alive at once in the loss
  // parallel.ffn_chunk_tokens: every layer's feed-forward half runs over token chunks of at most
  // this many tokens (Model::ffn_forward); 0: the whole micro-batch at once.
  int64_t ffn_chunk_tokens = 0;
  // parallel.cp_key_chunk: rows of the other shards' keys an MLA layer expands at once
  // (LayerContext::context_key_chunk); 0: the longest shard.
  int64_t cp_key_chunk = 0;
  // parallel.attention_query_block: on one rank, the MLA layers' query blocks
  // (LayerContext::attention_query_block); 0 with cp_key_chunk 0: the whole sequence.
  int64_t attention_query_block = 0;
  // parallel.mixer_segment_tokens: every KDA mixer runs over time segments of at most this many
  // tokens (KdaAttention, "time segments"); 0: the whole micro-batch at once.
  int64_t mixer_segment_tokens = 0;
  const ParallelGroups* parallel = nullptr;  // null: this rank is the whole job
  // FSDP (parallel->fsdp of size > 1): the frozen non-expert weights are sharded per layer.
  // fsdp_prefetch: layers gathered ahead of the one being computed (0: just in time).
  // fsdp_reshard_after_forward: free a layer's gathered weights after its forward and gather
  // them again for its backward (false: keep them from forward to backward, more memory).
  int64_t fsdp_prefetch = 1;
  bool fsdp_reshard_after_forward = true;
};

// What a config asks of the model: seed, recompute, the FSDP schedule and every LoRA setting.
// The caller adds what depends on where it runs: dtype, parallel groups, aux_loss_weight.
ModelOptions model_options_for(const Config& config);

// Frozen non-expert base weights on this rank (routed experts excluded: expert parallelism
// slices those). `resident` counts what the rank holds now: FSDP shards, any gathered buffer,
// and the weights kept whole (the F32 router score bias); `full` is the unsharded model's.
struct FrozenWeightBytes {
  size_t resident = 0;
  size_t full = 0;
  size_t kept_whole = 0;  // the part of `full` never sharded (included in `resident`)
};

// One decoder layer's frozen norms and depth mixes, and its two blocks.
struct DecoderLayer {
  Tensor input_norm;           // input_layernorm.weight
  Tensor post_attention_norm;  // post_attention_layernorm.weight
  AttnResMix attention_mix;    // self_attention_res_*: the attention's input (attn_res_block_size > 0)
  AttnResMix mlp_mix;          // mlp_res_*: the feed-forward's input
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

class Model final : public TrainableModel {
 public:
  Model(const ModelSpec& spec, kernels::Backend& backend, const ModelOptions& options);
  ~Model() override;

  // Base weights: from a Hugging Face directory (names and shapes checked against config.json;
  // a missing or misshapen tensor is Error(kBadCheckpoint) naming it; only the rows holding this
  // rank's FSDP shards and experts are read: checkpoint.bytes_read() says how much), or random
  // (N(0, 1/fan_in), norms 1) from options.seed for runs without a checkpoint.
  void load_weights(const HfCheckpoint& checkpoint);
  void init_random_weights();

  // The trainable parameters, group by group (parameter_groups()): replicated adapters first,
  // then the routed-expert adapters this rank holds under expert parallelism.
  std::vector<Parameter*> parameters() override { return parameters_; }
  std::vector<ParameterGroup*> parameter_groups() override;
  // forward_backward_async, then its result (which waits for the device).
  StepResult forward_backward(const Batch& batch, double grad_scale) override;
  // Queues the micro-batch without a host wait on the device: the batch is copied from pinned
  // staging, the embedding takes the ids this host has checked, and the loss and the MoE layers'
  // statistics stay on the device until the result is asked for (one copy into pinned memory
  // per micro-batch, behind an event).
  PendingStep forward_backward_async(const Batch& batch, double grad_scale) override;
  // The window's micro-batches as one packed pass (their concatenation: Batch::concatenated), so
  // each MoE layer's grouped GEMM, each FSDP gather and each expert-parallel exchange serves all
  // of them at once. Per-micro-batch parts stay per micro-batch: the router noise streams
  // (forward_count() advances by the window's size), the aux loss and the loss sums.
  PendingStep forward_backward_window_async(const std::vector<const Batch*>& window, double grad_scale) override;
  // Held, the experts' packed adapters (SwigluExperts::hold_packed_lora) are made once.
  void hold_parameters(bool hold) override;
  kernels::Backend& backend() override { return backend_; }
  double sum_over_data_ranks(double local) override;
  // score_bias[e] += model.moe.bias_update_rate * sign(mean - rows[e]) per MoE layer, the rows
  // summed over every rank in one all-reduce (core/model/expert_bias.cpp). A no-op at rate 0.
  void update_expert_bias(const std::vector<std::vector<int64_t>>& step_rows) override;
  // Each MoE layer's score_bias when model.moe.bias_update_rate > 0.
  std::vector<TrainedBuffer> trained_buffers() override;

  // Forward only, returning the logits [tokens, vocab] as a host F64 tensor (tests).
  Tensor logits(const Batch& batch);
  // The first layer's input [tokens, hidden] as a host F64 tensor: the token embeddings with the
  // image tokens merged at their placeholders (model.vision), forward only (tests).
  Tensor embedded(const Batch& batch);
  // Forward only: the loss sum and targets of the batch, with no router noise, forward_count()
  // unchanged and nothing kept for a backward (TrainableModel::evaluate). Reads the losses back
  // (one host wait).
  StepResult evaluate(const Batch& batch) override;

  const ModelSpec& spec() const { return spec_; }
  // Forward passes run so far: the position of the router-noise stream (checkpoints save it,
  // so a resumed run draws the noise the uninterrupted one would have).
  uint64_t forward_count() const { return forward_count_; }
  void set_forward_count(uint64_t count) { forward_count_ = count; }
  const ModelOptions& options() const { return options_; }
  // Every frozen weight, by HF name. Under FSDP the non-expert ones are shape-only placeholders
  // (no data) outside a layer's use: write weights only through load_weights/init_random_weights.
  std::vector<WeightSlot> weight_slots();
  FrozenWeightBytes frozen_non_expert_bytes();
  bool fsdp_sharded() const { return fsdp_.layer_buckets() > 0; }
  // The most FSDP buckets gathered at once so far (layers and the embed/norm/head bucket): with
  // re-gathering for backward, max(prefetch + 1, 2) -- the weights are freed after use.
  int64_t fsdp_peak_gathered_buckets() const { return fsdp_.peak_gathered(); }
  // The vision tower and projector (model.vision.enabled), else null.
  VisionTower* vision() { return vision_.get(); }
  // Every LoRA-capable projection, by HF module name (tests and adapter import/export).
  std::vector<std::pair<std::string, LoraLinear*>> linear_modules();

 private:
  // What a forward leaves for the loss and the backward.
  struct Forward {
    // The layer inputs that start a Block Attention Residuals block and the last layer's output
    // (the other layer inputs wait in Model::checkpoints_); a forward-only pass keeps the last
    // output and the block summaries alone.
    std::vector<Tensor> inputs;
    TensorView final_in;       // the final norm's input (undefined after a forward-only pass)
    Tensor final_hidden;       // [tokens, D] the final norm's output
    Tensor final_rstd;         // [tokens]
  };
  // kForBackward keeps what the backward reads (ModelOptions::recompute permitting) and the last
  // layer's gathered weights; kForwardOnly keeps nothing (logits, evaluate).
  enum class ForwardMode { kForBackward, kForwardOnly };

  // The batch checked on the host, then on the device.
  BatchTensors upload(const Batch& batch);
  // The images' tensors of `bt` (model.vision): checked against the placeholders of the batch.
  void upload_images(const Batch& batch, BatchTensors& bt);
  // The first layer's input [tokens, hidden]: the token embeddings, then merge_images.
  Tensor embed(const LayerContext& ctx, bool keep, std::string& where);
  // inputs[0] rows of the placeholders <- the image tokens (model.vision), with `embedded` the
  // text embeddings; with keep the projector keeps what its backward reads.
  void merge_images(const LayerContext& ctx, const TensorView& out, bool keep, std::string& where);
  // The projector's gradients from dembedded, the merged embeddings' gradient.
  void merge_images_backward(const LayerContext& ctx, const TensorView& dembedded, std::string& where);
  bool vision_trains() const;
  LayerContext context(const BatchTensors& batch);
  DType parameter_dtype() const { return options_.dtype == DType::kF64 ? DType::kF64 : DType::kF32; }
  const Tensor& head() const { return spec_.config.tie_word_embeddings ? embed_ : lm_head_; }
  // The MoE layers' routed halves, in layer order.
  std::vector<MoeFfn*> moe_layers();
  // x_out = layer(x_in); saves the layer's internals (and the norms' outputs) in `saved`.
  // `hidden` is the sum the feed-forward's output is added to (x + mixer, or with Block Attention
  // Residuals the block's running sum); mixer_mix / ffn_mix exist only when a depth mix made
  // those inputs.
  struct LayerSaved {
    Tensor normed_in, rstd_in, hidden, normed_mid, rstd_mid;
    AttnResSaved mixer_mix, ffn_mix;
  };
  // `summaries`: with Block Attention Residuals, the block summaries filed up to and including
  // this layer (AttnResiduals::summaries_for); empty otherwise. The backward adds the summaries'
  // gradients into `dsummaries` (accum dtype) and writes x's own (without its summary's share)
  // into dx. `ffn_chunks`: the token chunks the feed-forward half runs in (ffn_chunks()). A null
  // `out` runs the mixer half alone, up to the feed-forward's normed input: what a backward needs
  // that re-runs a chunked feed-forward chunk by chunk itself.
  void layer_forward(const LayerContext& ctx, size_t index, const TensorView* out, const TensorView& x,
                     const std::vector<TensorView>& summaries, int64_t ffn_chunks);
  void layer_backward(const LayerContext& ctx, size_t index, const TensorView& dx, const TensorView& dout,
                      const TensorView& x, const std::vector<TensorView>& summaries,
                      const std::vector<TensorView>& dsummaries, int64_t ffn_chunks);
  // The feed-forward half is position-wise, so it can run over token chunks and keep only one
  // chunk's internals alive (the MoE's dispatched rows are most of a layer's memory per token).
  // The count comes from the micro-batch's shape, which every rank shares, so the expert-parallel
  // exchanges of each chunk pair up across ranks; 1 without ModelOptions::ffn_chunk_tokens.
  int64_t ffn_chunks(const LayerContext& ctx) const;
  // out = hidden + ffn(normed_mid), chunk by chunk. Chunked, each chunk's internals are dropped
  // after it, and ffn_backward re-runs the chunk's forward before its backward; whole, the
  // backward reads the forward's.
  void ffn_forward(const LayerContext& ctx, size_t index, const TensorView& out, int64_t chunks);
  void ffn_backward(const LayerContext& ctx, size_t index, const TensorView& dnormed_mid, const TensorView& dout,
                    int64_t chunks);
  // Router noise and statistics for the MoE rows starting at first_row (MoeFfn::start_rows).
  void start_ffn_rows(const LayerContext& ctx, size_t index, int64_t first_row);
  void release_layer(size_t index);
  // Layer `index` drops what its backward reads after its forward and re-runs that forward in the
  // backward (ModelOptions::recompute, recompute_layers: the first layers re-run).
  bool recomputes(size_t index) const {
    return options_.recompute &&
           (options_.recompute_layers < 0 || static_cast<int64_t>(index) < options_.recompute_layers);
  }
  std::vector<WeightSlot> layer_weight_slots(size_t index);
  // FSDP (model_weights.cpp): at construction, each layer's (and the outer) non-expert frozen
  // weights become a bucket of which this rank keeps one shard; loading writes that shard only.
  void shard_layer_weights(size_t index);
  void shard_outer_weights();
  void attach_lora();
  void group_parameters();

  // The step's parts, in order. Each keeps `where` at the part of the step it is in (an Error
  // from it gets that in front: an out-of-memory then names the layer and pass as well as the
  // tensor). The embedding/head bucket stays gathered after forward for the head's GEMMs.
  Forward forward(const LayerContext& ctx, ForwardMode mode, std::string& where);
  // Per-token losses [tokens] on the device, from the head's logits in row chunks. With dfinal
  // given, the final hidden state's gradient (times grad_scale) is written into it; without, the
  // pass is forward only (grad_scale unused).
  Tensor head_loss(const LayerContext& ctx, const TensorView& final_hidden, const TensorView* dfinal,
                   double grad_scale);
  // From the final norm's output gradient down to the first layer's input (the embedding is
  // frozen); releases the outer weights first.
  void backward(const LayerContext& ctx, Forward& fwd, const TensorView& dfinal, std::string& where);
  // forward_backward_window_async's body (a single micro-batch is a window of one).
  PendingStep run_step(const std::vector<const Batch*>& window, double grad_scale, std::string& where);

  ModelSpec spec_;
  kernels::Backend& backend_;
  ModelOptions options_;
  RopeDeviceTables rope_;
  Tensor embed_;       // [V, D]
  Tensor final_norm_;  // [D]
  Tensor lm_head_;     // [V, D] (unused when tied: embed_ is the head)
  std::vector<DecoderLayer> layers_;
  std::vector<LayerSaved> saved_;
  AttnResiduals attn_res_;
  uint64_t forward_count_ = 0;  // seeds router noise per forward
  FsdpSchedule fsdp_;
  std::vector<std::unique_ptr<ParameterGroup>> parameter_groups_;  // own the parameters' storage
  std::vector<Parameter*> parameters_;
  BatchStaging batches_;
  ResultReadback results_;
  LayerCheckpoints checkpoints_;  // the layer inputs from forward to backward
  std::unique_ptr<VisionTower> vision_;
};

}  // namespace moetrain
