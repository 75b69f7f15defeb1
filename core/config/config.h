// The typed configuration: one struct per YAML section (docs/ARCHITECTURE.md §7). Field names are the YAML
// keys. Defaults here are the defaults a config file gets for a key it leaves out; a key the
// file sets that is not a field is an error ("did you mean ...").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moetrain {

// A YAML map kept in the file's order (PEFT's pattern maps: the first matching key wins).
template <class T>
using PatternMap = std::vector<std::pair<std::string, T>>;

// Rotary scaling as DeepSeek-V3 uses it (`rope_scaling` in config.json).
struct RopeScalingConfig {
  std::string type = "none";  // none | yarn
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// Multi-head Latent Attention.
struct MlaConfig {
  int64_t num_heads = 4;
  std::optional<int64_t> q_lora_rank;  // null: q_proj directly from the hidden state
  int64_t kv_lora_rank = 32;
  int64_t qk_nope_head_dim = 16;
  int64_t qk_rope_head_dim = 8;   // with use_rope false these dims exist but are not rotated
                                  // (Kimi-Linear/K3 NoPE MLA keep 64 of them); 0 is also legal
  int64_t v_head_dim = 16;
  bool use_rope = true;
  double rope_theta = 10000.0;
  RopeScalingConfig rope_scaling;
};

// Routed + shared SwiGLU experts (DeepSeek-V3 / Kimi).
struct MoeConfig {
  int64_t num_experts = 8;               // n_routed_experts
  int64_t top_k = 2;                     // num_experts_per_tok
  int64_t num_shared_experts = 1;        // n_shared_experts (width: expert_intermediate_size each)
  int64_t expert_intermediate_size = 64; // moe_intermediate_size
  std::string scoring = "sigmoid";       // sigmoid | softmax
  int64_t num_groups = 1;                // n_group
  int64_t topk_groups = 1;               // topk_group
  bool normalize_topk = true;            // norm_topk_prob
  double routed_scaling_factor = 1.0;
  bool score_correction_bias = true;     // e_score_correction_bias present
  double aux_loss_coef = 0.0;            // 0 disables
  std::string aux_loss_type = "sequence";  // sequence | batch
  double router_noise = 0.0;             // std of Gaussian noise on selection scores in training
  double bias_update_rate = 0.0;         // aux-loss-free balancing: bias step per optimizer step
  // Latent MoE (Kimi K3): the routed experts run at this width between a down-projection from
  // hidden_size and an up-projection back (routing and the shared experts stay at hidden_size).
  int64_t latent_size = 0;               // routed_expert_hidden_size; 0: experts at hidden_size
  bool use_latent_norm = false;          // latent_moe_use_norm: RMSNorm on the latent weighted sum
  // The routed experts' frozen weights: bf16, or mxfp4 as Kimi K3 releases them (compressed-tensors
  // mxfp4-pack-quantized), kept packed on the device and decoded inside the grouped GEMM.
  std::string expert_format = "bf16";    // bf16 | mxfp4
};

// Kimi Delta Attention (the `kda` mixer; transformers `kimi_linear`'s linear-attention layers):
// num_heads heads of head_dim for q, k and v alike, a causal depthwise conv of conv_width on each.
struct KdaConfig {
  int64_t num_heads = 4;
  int64_t head_dim = 16;
  int64_t conv_width = 4;                // short_conv_kernel_size
  // The forget gate: 0 is Kimi-Linear's g = -exp(A_log) softplus(f + dt_bias); below 0 it is
  // Kimi K3's bounded g = lower_bound sigmoid(exp(A_log) (f + dt_bias)) (K3: -5).
  double lower_bound = 0.0;
  bool fused_qkv = false;                // K3: one qkv_proj and one conv over q, k, v together
  bool full_rank_output_gate = false;    // K3: g_proj [H d, D] instead of g_a_proj -> g_b_proj
};

// DeepSeek Sparse Attention (the `dsa` mixer; transformers `deepseek_v32`): MLA (shaped by
// model.mla, q LoRA required) whose queries attend only to the index_topk keys a frozen lightning
// indexer of index_n_heads heads of index_head_dim picks (kernels/ops.h, the DSA section).
struct DsaConfig {
  int64_t index_n_heads = 4;
  int64_t index_head_dim = 16;
  int64_t index_topk = 2048;
  // The indexer's rope on its first qk_rope_head_dim columns: false rotates the halves
  // (transformers' deepseek_v32, DeepSeek-V3.2's inference code), true interleaved pairs (GLM-5's
  // `indexer_rope_interleave`).
  bool indexer_rope_interleave = false;
};

// Kimi K3's MoonViT vision tower, its patch merger and projector (docs/HF_SEMANTICS.md §11;
// a kimi_k3 config.json's vision_config gives the shape, `enabled` stays the YAML's). Images
// become text-side tokens at the placeholder token's positions; the tower is frozen, the
// projector trains as `projector_train` says (lora: at lora.rank and lora.alpha).
struct VisionConfig {
  bool enabled = false;
  int64_t patch_size = 14;
  int64_t pos_emb_height = 64;        // the learned position table, resized to each image's grid
  int64_t pos_emb_width = 64;
  int64_t pos_emb_time = 4;           // the most frames an image (video) may have
  int64_t num_layers = 27;
  int64_t hidden_size = 1024;
  int64_t num_heads = 12;
  int64_t qkv_hidden_size = 1536;     // heads x head_dim; head_dim a multiple of 4 (2-D RoPE)
  int64_t intermediate_size = 4096;
  int64_t merge_size = 2;             // merge_kernel_size: merge_size x merge_size patches per token
  double norm_eps = 1.1920928955078125e-07;  // the tower's RMSNorms: torch's default, 2^-23
  double projector_eps = 1e-5;        // projector_ln_eps
  int64_t placeholder_token_id = 163605;     // media_placeholder_token_id
  std::string projector_train = "full";      // full | lora | frozen
};

struct ModelConfig {
  std::optional<std::string> hf_dir;     // a Hugging Face model directory; fields below override it
  std::string model_type = "deepseek_v3";
  int64_t vocab_size = 512;
  int64_t hidden_size = 128;
  int64_t num_layers = 4;
  std::vector<std::string> layers;       // mixer per layer: mla | kda | dsa; empty: all mla
  int64_t intermediate_size = 256;       // dense FFN width
  int64_t first_k_dense = 1;             // first_k_dense_replace: layers [0, k) use the dense FFN
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 4096;
  // A sigmoid gate on the attention output of mla and dsa layers before o_proj: y = attn *
  // sigmoid(g_proj(x)), one gate per head (headwise) or per channel (elementwise, Kimi K3's).
  std::string attention_gate = "none";   // none | headwise | elementwise
  // The gated activation of every MLP (dense, shared and routed experts): silu is SwiGLU, situ
  // Kimi K3's beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta) (kernels/ops.h).
  std::string hidden_act = "silu";       // silu | situ
  double situ_beta = 4.0;                // activation_situ_beta
  double situ_linear_beta = 0.0;         // activation_situ_linear_beta; 0: no cap on the up branch
  // Block Attention Residuals (Kimi K3's attn_res_block_size): every block_size layers the residual
  // stream files a summary, and each layer's attention and MLP inputs, and the final norm's, are
  // softmax mixes over the summaries so far and the block's running sum (kernels/ops.h AttnResArgs).
  int64_t attn_res_block_size = 0;       // 0: the plain residual stream
  // The frozen weights' storage: bf16 (the working dtype), or fp8 as DeepSeek-V3 / V3.2 and Kimi
  // K2 ship them (E4M3 codes and an F32 scale per 128 x 128 block, kernels/fp8_format.h), kept so
  // on the device and in the FSDP buckets and decoded inside the GEMMs (docs/CONFIG.md says which
  // weights it covers and what a checkpoint of the other format becomes).
  std::string weight_format = "bf16";    // bf16 | fp8
  // config.json's quantization_config.modules_to_not_convert: the modules an FP8 checkpoint keeps
  // in BF16 (not a YAML key; filled from model.hf_dir).
  std::vector<std::string> fp8_modules_to_not_convert;
  MlaConfig mla;
  KdaConfig kda;
  DsaConfig dsa;
  MoeConfig moe;
  VisionConfig vision;
};

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 16.0;
  bool rslora = false;                   // scale alpha / sqrt(rank) instead of alpha / rank
  std::vector<std::string> targets = {"q_proj", "o_proj", "experts"};
  // The routed experts' gate and up adapters: `separate` (one of rank r each) or `fused` (PEFT's
  // one adapter of rank 2r and alpha 2 alpha on the fused gate_up_proj, whose B mixes gate and up).
  std::string expert_gate_up = "separate";
  // Per-module ranks and alphas, PEFT's rank_pattern / alpha_pattern: {key: value}, where a key is
  // a module name, a short name (q_proj) or a regex that PEFT's rule matches against moetrain's
  // module names (core/config/lora_patterns.h); the first matching key, in order, wins.
  PatternMap<int64_t> rank_pattern;
  PatternMap<double> alpha_pattern;
  // The routed experts' A factors: `per_expert` (A [E, r, in], one per expert) or `shared` (one
  // A [r, in] per projection for all the experts of a layer, with per-expert B [E, out, r]).
  std::string expert_a = "per_expert";
};

struct ParallelConfig {
  int64_t fsdp = 1;
  int64_t ep = 1;
  // Context parallelism: each micro-batch is cut into cp shards of its tokens, one per rank of a
  // group of cp ranks (docs/PARALLEL.md); the world / cp groups read different data.
  int64_t cp = 1;
  // How the cp shards cut a window (core/data/context_shards.h): `balanced`, each window in
  // 2 cp equal chunks with rank r holding chunks r and 2 cp - 1 - r, so that every rank does the
  // same causal attention work (data.seq_len a multiple of 2 cp); `contiguous`, one run of
  // consecutive tokens per rank, the last rank attending the most keys.
  std::string cp_layout = "balanced";
  int64_t prefetch = 1;
  // Re-run each layer's forward in its backward instead of keeping what the backward reads: less
  // memory, one more forward. recompute_layers: only the first N layers re-run (the rest keep
  // their activations; -1: every layer), to spend spare memory on speed.
  bool recompute = true;
  int64_t recompute_layers = -1;
  // The feed-forward half of every layer (norm, router, experts, dense MLP) runs over token
  // chunks of at most this many tokens, so that only one chunk's internals are alive: the mixer
  // still sees the whole sequence. 0: the whole micro-batch at once. Results equal the unchunked
  // run up to the order of the adapter-gradient sums (docs/PARALLEL.md, "Long sequences").
  int64_t ffn_chunk_tokens = 0;
  // Context parallelism: the MLA layers expand and attend the keys of the earlier shards in chunks
  // of at most this many rows, so that the expanded keys and values of one chunk only are alive
  // (docs/PARALLEL.md). 0: the longest shard.
  int64_t cp_key_chunk = 0;
  // On one rank (cp 1), the MLA layers run in query blocks of this many tokens, each attending
  // the keys it sees in chunks of cp_key_chunk rows (0: the block's length), the keys and values
  // expanded from the latent per chunk, so that only the latent, the queries and their output
  // are whole-sequence (docs/PARALLEL.md, "Long sequences"). 0 with cp_key_chunk 0: the whole
  // sequence at once. Equal to the whole-sequence run up to rounding.
  int64_t attention_query_block = 0;
  // The KDA mixers run over time segments of this many tokens (a multiple of KDA's chunk, 64),
  // carrying the recurrent state and the short convolutions' history from one segment to the
  // next, so that a KDA layer's internals exist for one segment at a time. 0: the plan's choice
  // (the whole sequence when it fits). Equal to the whole-sequence run up to rounding
  // (docs/PARALLEL.md, "Long sequences").
  int64_t mixer_segment_tokens = 0;
  // Move the layer inputs (one [tokens, hidden] per layer) to page-locked host memory between
  // forward and backward, copied on a side stream behind the compute (docs/PARALLEL.md). Works
  // with recompute on or off; with Block Attention Residuals the block summaries stay on the device.
  bool offload = false;
  // FSDP: free a layer's gathered base weights after its forward and gather them again for its
  // backward (true), or keep them from forward to backward (false: more memory, less traffic).
  bool reshard_after_forward = true;
  // Seconds a rank may go without progress (one micro-batch, the gradient reduction, a checkpoint
  // phase, one layer of a weight load) before it aborts the job naming what it was doing: a
  // collective waiting for a dead or hung rank must not wait out the scheduler's limit. 0: off.
  double timeout_s = 900.0;
};

// One dataset of a data mixture (docs/DATA.md): a path prefix (`dir/name` for dir/name.bin +
// dir/name.idx) and its sampling weight (> 0; weights need not sum to 1).
struct DataSourceSpec {
  std::string path;
  double weight = 1.0;
  bool operator==(const DataSourceSpec& other) const { return path == other.path && weight == other.weight; }
};

// data.source's value when the YAML gives a list of {path, weight}: the list is in `mixture`.
inline constexpr const char* kDataSourceMixture = "mixture";

// data.eval (docs/DATA.md, "Evaluation data"): what train.eval_every evaluates. At most one of
// `source` (a separate eval dataset: a prefix, a mixture list, or `synthetic` for windows of the
// synthetic stream that training never reaches) and `holdout` (that fraction of every training
// dataset's documents, never trained on). Neither set: no evaluation.
struct EvalDataConfig {
  std::string source;                  // "" (none), synthetic, a prefix, or kDataSourceMixture
  std::vector<DataSourceSpec> mixture; // when source is a list (as data.source)
  double holdout = 0.0;                // [0, 1): held-out fraction of each training dataset's documents
  int64_t windows = 0;                 // eval windows; 0: every window of the eval data once
  bool enabled() const { return !source.empty() || holdout > 0.0; }
};

struct DataConfig {
  // `synthetic` (the built-in data), a dataset path prefix, or kDataSourceMixture when the YAML
  // value of `source` is a list of {path, weight} (then held in `mixture`). One YAML key, two
  // fields: the schema reads and writes them together.
  std::string source = "synthetic";
  std::vector<DataSourceSpec> mixture;   // empty unless source is a list
  int64_t seq_len = 256;
  int64_t micro_batch = 2;
  int64_t grad_accum = 1;
  int64_t seed = 1234;
  EvalDataConfig eval;
};

struct TrainConfig {
  int64_t steps = 100;
  double lr = 2.0e-4;
  int64_t warmup_steps = 10;
  std::string schedule = "cosine";       // cosine | linear | constant
  double min_lr_ratio = 0.1;             // the decay ends at lr * min_lr_ratio
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double grad_clip = 1.0;                // 0 disables clipping
  int64_t seed = 1234;
  std::string device = "auto";           // auto | cpu | cuda
  int64_t eval_every = 0;                // evaluate data.eval every N steps (0: only at the end)
  // Micro-batches of a step run together as one pass (1: one at a time), so that each MoE
  // layer's grouped GEMM takes the routed rows of all of them (core/train/trainer.h); at most
  // data.grad_accum. The activations of the whole window are alive at once (`moetrain plan`);
  // 0: the plan's choice, the widest window whose pass fits the device with whole feed-forwards.
  int64_t expert_window = 1;
};

struct CheckpointConfig {
  std::optional<std::string> dir;        // null: <run_dir>/checkpoints
  int64_t every = 0;                     // 0: no periodic saves
  int64_t keep_last = 2;
  std::string resume = "auto";           // auto | none | a checkpoint path
  bool save_on_signal = true;            // SIGTERM/SIGINT/SIGHUP/SIGUSR1: save at the next step boundary, exit 75
  // A fresh run (nothing resumed) whose checkpoint directory already holds checkpoints: false
  // refuses to start; true moves them (and metrics.jsonl) aside first, under a timestamped name.
  bool overwrite = false;
  std::string export_adapter = "true";   // PEFT adapter at the end: true (<run_dir>/adapter) | false | a dir
  // How routed experts appear in exported adapters: transformers5 (what PEFT on transformers 5
  // loads exactly: fused expert adapters, MLPs through target_parameters) | per_expert (2-D keys
  // per expert, transformers 4 / vLLM naming) | released (per_expert under the released checkpoint's
  // names: block_sparse_moe, experts' w1/w3/w2, Kimi K3's language_model.; as NeMo AutoModel saves
  // K3 adapters). core/checkpoint/adapter_export.h has the details.
  std::string export_layout = "transformers5";
  std::optional<std::string> init_adapter;  // a PEFT adapter directory to start the LoRA weights from
};

struct LoggingConfig {
  std::string run_dir = "runs/quickstart";
  int64_t every = 1;
  std::string level = "info";            // debug | info | warn | error
};

struct Config {
  ModelConfig model;
  LoraConfig lora;
  ParallelConfig parallel;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  std::string source_path;               // the file it was read from (for messages)
  // Full paths of the model.* keys the file or an override set ("model.mla.num_heads"): with
  // model.hf_dir, these override config.json and every other model field comes from it.
  std::vector<std::string> explicit_model_keys;
};

// Reads `path`, applies `overrides` ("key.path=value", each validated like a file key), and
// checks every single-field and cross-field rule that needs no world size. Throws
// Error(kBadConfig) naming the file, key, line and the fix (all problems at once).
//
// Reading is strict: an unknown key, a wrong type, a repeated key or null for a non-optional
// key is an error. Every key has a default, with one exception: without model.hf_dir the
// model's shape (model.vocab_size, model.hidden_size, model.num_layers) must be stated.
// With model.hf_dir set, rules over model keys the file leaves out wait until config.json is
// merged (the importer then calls validate_config).
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from YAML text (tests); `source_name` stands for the path in messages.
Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides = {});

// Every single-field and cross-field rule of load_config on a Config built or merged in code
// (e.g. after importing a Hugging Face config.json). Throws Error(kBadConfig).
void validate_config(const Config& config);

// The same for a config whose values did not all come from its source file: `sources` maps a
// key path ("model.moe.num_experts") to where its value came from (e.g. "/m/config.json
// (\"n_routed_experts\")"), and a rule that fails over such a key names that place instead of
// the YAML file. Keys absent from `sources` are the YAML's.
void validate_config(const Config& config, const std::map<std::string, std::string>& sources);

// True when both hold the same value for every key (source_path and explicit_model_keys are
// bookkeeping, not settings): e.g. a resumed run's config against its checkpoint's.
bool same_settings(const Config& a, const Config& b);
// The keys whose values differ, as "key: <a's value> -> <b's value>", in schema order.
std::vector<std::string> config_differences(const Config& a, const Config& b);

// Rules that depend on the job's world size (world divisible by fsdp, experts by ep, ...),
// checked on every rank before any collective. Throws Error(kBadConfig).
void validate_for_world(const Config& config, int world_size);

// The resolved config as YAML, every field present (printed at start, saved to the run dir,
// and parseable by parse_config to the same Config).
std::string config_to_yaml(const Config& config);

}  // namespace moetrain
