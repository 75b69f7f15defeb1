// G SwiGLU feed-forward networks over groups of rows: rows [offsets[g], offsets[g+1]) go through
// network g. One class serves three uses:
//   - routed experts (G = num_experts, rows are tokens sorted by expert: MGroupedContiguous);
//   - the shared experts and the dense MLP (G = 1, every row).
// out = (act(x Wg^T, x Wu^T)) Wd^T with act SwiGLU (silu(g) * u) or K3's SiTU (GatedActivation), Wg and Wu stored fused as gate_up [G, 2F, D]
// (gate rows first) and Wd as down [G, D, F]. Each projection may carry a LoRA adapter per
// group; the adapters of all groups are one stacked parameter ([G, r, in] / [G, out, r]; 2-D
// when G = 1), named `<prefix>.{gate,up,down}_proj.lora_{A,B}.weight` — export re-lays the
// stacked routed-expert tensors into PEFT's keys. Routed experts may instead carry PEFT's fused
// gate_up adapter (`lora.expert_gate_up: fused`): one adapter of rank 2r on the whole [gate | up]
// output, A [G, 2r, D], B [G, 2F, 2r], named `<prefix>.gate_up_proj.lora_{A,B}.weight`, whose B
// mixes gate and up (separate gate and up adapters are the block-diagonal special case).
// With `lora.expert_a: shared` a routed projection's adapter has one A [r, in] for all its groups
// (2-D, the same on every rank) and per-group B [G, out, r]: x A^T is one dense GEMM over all
// rows before the grouped (x A^T) B_g^T, and A's gradient the sum over the groups (one GEMM).
#pragma once

#include <array>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/lora_linear.h"

namespace moetrain {

// The gated activation between the gate/up and the down projection: SwiGLU, or Kimi K3's SiTU
// with its two caps (kernels/ops.h SituArgs; `model.hidden_act: situ`).
struct GatedActivation {
  bool situ = false;
  double beta = 4.0;         // SiTU only
  double linear_beta = 0.0;  // SiTU only; 0: the up branch is not capped
};
// The activation `model.hidden_act` (with model.situ_beta / situ_linear_beta) selects.
GatedActivation gated_activation_of(const ModelConfig& model);

// The fused gate_up adapter's rank and alpha: twice lora.rank and lora.alpha, as PEFT writes them
// (rank_pattern / alpha_pattern {".*\\.gate_up_proj": 2r / 2 alpha}); its scale follows from those
// (2 alpha / 2r, or 2 alpha / sqrt(2r) with rsLoRA), exactly as PEFT computes it.
LoraSettings fused_gate_up_settings(const LoraSettings& lora);

// Row offsets of the groups (experts) of a grouped computation, int32 [G + 1]: on the backend's
// device, and the same values on the host when the caller has them anyway (expert parallelism;
// checked, not needed: kernels::GroupedGemmArgs::host_group_offsets).
struct GroupOffsets {
  TensorView device;
  const int32_t* host = nullptr;
};

class SwigluExperts {
 public:
  enum Projection { kGate = 0, kUp = 1, kDown = 2 };
  static const char* projection_name(Projection p);

  // `routed`: the groups are routed experts [first_group, first_group + groups) of the model,
  // whose adapters are always stacked 3-D tensors (also when a rank holds a single expert).
  SwigluExperts(std::string prefix, int64_t groups, int64_t hidden, int64_t width, bool routed = false,
                int64_t first_group = 0)
      : prefix_(std::move(prefix)), groups_(groups), hidden_(hidden), width_(width), routed_(routed),
        first_group_(first_group) {}

  const std::string& prefix() const { return prefix_; }  // e.g. model.layers.1.mlp.experts
  int64_t groups() const { return groups_; }
  int64_t hidden() const { return hidden_; }
  int64_t width() const { return width_; }
  bool routed() const { return routed_; }
  int64_t first_group() const { return first_group_; }

  GatedActivation activation;  // SwiGLU unless set
  Tensor gate_up;  // [G, 2F, D], frozen
  Tensor down;     // [G, D, F], frozen
  // Routed experts with model.moe.expert_format mxfp4: gate_up and down hold MXFP4 codes (U8
  // [G, 2F, D / 2] and [G, D, F / 2]) and these their E8M0 scales (U8 [G, 2F, D / 32], [G, D, F / 32];
  // kernels/ops.h GroupedGemmArgs::b_scale); undefined for BF16 weights.
  Tensor gate_up_scale;
  Tensor down_scale;
  std::array<std::unique_ptr<LoraAdapter>, 3> lora;  // per projection; null: none
  // PEFT's fused adapter on the whole gate_up output (routed experts only); when set, lora[kGate]
  // and lora[kUp] are null.
  std::unique_ptr<LoraAdapter> gate_up_lora;
  // Routed experts: adapters added while this is set share one A across the groups (lora.expert_a:
  // shared), drawn from a generator seeded by the seed alone.
  bool shared_lora_a = false;

  // Adapters on projection p, initialised as PEFT does; group g's A is drawn from a generator
  // seeded by (seed, first_group + g), so an expert starts the same whichever rank holds it.
  void add_lora(Projection p, const LoraSettings& settings, DType dtype, kernels::Backend& backend, uint64_t seed);
  // The fused gate_up adapter (rank and alpha of fused_gate_up_settings(settings)), initialised
  // the same way (A ~ U(+-1/sqrt(D)), B = 0).
  void add_fused_gate_up_lora(const LoraSettings& settings, DType dtype, kernels::Backend& backend, uint64_t seed);
  // The same with the gate_up adapter's own rank and alpha (a rank_pattern may set them).
  void add_gate_up_lora(const LoraSettings& settings, DType dtype, kernels::Backend& backend, uint64_t seed);

  // out [R, D] = FFN(x [R, D]) per group of rows (group_offsets: [G + 1]).
  // Saves what backward needs (the gate/up pre-activations and the activation's output).
  void forward(const LayerContext& ctx, const TensorView& out, const TensorView& x, const GroupOffsets& group_offsets);
  // dx (= or +=) from dout; adapter gradients +=. Needs the forward's x and offsets again.
  void backward(const LayerContext& ctx, const TensorView& dx, const TensorView& dout, const TensorView& x,
                const GroupOffsets& group_offsets, bool accumulate_dx);
  void release_saved();

  void collect_parameters(std::vector<Parameter*>& out);

 private:
  // One stacked adapter [G, r, in] / [G, out, r] (2-D when not routed and G = 1; A [r, in] with
  // shared_lora_a) named `name`.
  std::unique_ptr<LoraAdapter> make_adapter(const std::string& name, int64_t in, int64_t out,
                                            const LoraSettings& settings, DType dtype, kernels::Backend& backend,
                                            uint64_t seed) const;
  // Views of an adapter as [G, r, in] / [G, out, r] for the grouped GEMM.
  TensorView stacked_a(const LoraAdapter& adapter) const;
  TensorView stacked_b(const LoraAdapter& adapter) const;
  TensorView stacked_b(Projection p) const { return stacked_b(*lora[p]); }
  bool shares_a(const LoraAdapter& adapter) const;  // one A [r, in] for all groups
  // c = alpha in A_g^T + beta c (a_transposed) or alpha in A_g + beta c per group of rows, or with
  // a shared A one dense GEMM.
  void times_a(kernels::Backend& be, const TensorView& c, const TensorView& in, const LoraAdapter& adapter,
               const GroupOffsets& offsets, bool a_transposed, double alpha = 1.0, double beta = 0.0) const;
  // A's gradient += scale dy_b^T in per group (dy_b = dy B_g), or summed over the groups when shared.
  void add_a_gradient(kernels::Backend& be, LoraAdapter& adapter, const TensorView& dy_b, const TensorView& in,
                      const GroupOffsets& offsets) const;

  std::string prefix_;
  int64_t groups_;
  int64_t hidden_;
  int64_t width_;
  bool routed_;
  int64_t first_group_;
  Tensor saved_gate_up_;  // [R, 2F] pre-activations
  Tensor saved_hidden_;   // [R, F] activation output
};

}  // namespace moetrain
