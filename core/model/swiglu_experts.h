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
  // kernels/ops.h GroupedGemmArgs::b_scale). With model.weight_format fp8 they hold E4M3 codes of
  // their own shapes (U8) and these the F32 block scales [G, ceil(rows / 128), ceil(cols / 128)]
  // (core/model/fp8_storage.h). Undefined for BF16 weights.
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
  // While held, the adapters packed by a forward (PackedLora below) are kept and used by every
  // later forward and backward; holding or releasing drops them, so the next forward packs the
  // parameters' values then. The model holds them while the parameters cannot change: over an
  // optimizer step's micro-batches (TrainableModel::hold_parameters), so they are packed once per
  // step instead of once per forward (twice with recompute).
  void hold_packed_lora(bool hold);

  void collect_parameters(std::vector<Parameter*>& out);

 private:
  // One stacked adapter [G, r, in] / [G, out, r] (2-D when not routed and G = 1; A [r, in] with
  // shared_lora_a) named `name`.
  std::unique_ptr<LoraAdapter> make_adapter(const std::string& name, int64_t in, int64_t out,
                                            const LoraSettings& settings, DType dtype, kernels::Backend& backend,
                                            uint64_t seed) const;
  bool shares_a(const LoraAdapter& adapter) const;  // one A [r, in] for all groups

  // The adapters on one projection's output, packed by a forward into the compute dtype so
  // that the projection's LoRA is a few GEMMs over all groups, whatever the adapters: the A's
  // stacked along the rank (a [G, R, in], or [1, R, in] when A is shared across the groups) and
  // the B's times their scales as one block-diagonal B over the whole output (b [G, out, R]).
  // Separate gate and up adapters become one rank-(r_gate + r_up) adapter on gate_up this way,
  // and the F32 parameters are rounded to BF16 once per forward (once per optimizer step while
  // held: hold_packed_lora) instead of once per GEMM.
  struct PackedLora {
    struct Part {
      LoraAdapter* adapter = nullptr;
      int64_t out_row = 0;   // the adapter's B covers output columns [out_row, out_row + its out)
      int64_t rank_col = 0;  // and packed ranks [rank_col, rank_col + its r)
    };
    std::vector<Part> parts;  // empty: no adapter on the projection
    int64_t rank = 0;         // R
    bool shared_a = false;
    Tensor a;    // [G or 1, R, in]
    Tensor b;    // [G, out, R]
    Tensor x_a;  // [rows, R] = x A^T of the forward, for B's gradient
  };
  // The adapters on gate_up (separate gate and up, or the fused one) or on down.
  std::vector<PackedLora::Part> lora_parts(bool gate_up) const;
  void pack_lora(const LayerContext& ctx, PackedLora& packed, std::vector<PackedLora::Part> parts, int64_t in,
                 int64_t out) const;
  // packed.x_a = x A^T per group (kept for B's gradient).
  void lora_input(const LayerContext& ctx, PackedLora& packed, const TensorView& x, const GroupOffsets& offsets) const;
  // The base projection's GEMM `base` (c = a op(W), alpha 1) plus the LoRA term: forward
  // lora_in (s B)^T with lora_in = x A^T, backward lora_in A with lora_in = dy (s B).
  void project(kernels::Backend& be, kernels::GroupedGemmArgs base, const PackedLora& packed,
               const TensorView& lora_in, bool forward) const;
  // dy (s B) per group: [rows, R] (undefined without adapters).
  Tensor lora_dy_b(const LayerContext& ctx, const PackedLora& packed, const TensorView& dy,
                   const GroupOffsets& offsets) const;
  // A's gradients += dy_b^T x and B's += s dy^T (x A^T), each adapter taking its blocks.
  void lora_gradients(const LayerContext& ctx, const PackedLora& packed, const TensorView& dy_b,
                      const TensorView& dy, const TensorView& x, const GroupOffsets& offsets) const;

  std::string prefix_;
  int64_t groups_;
  int64_t hidden_;
  int64_t width_;
  bool routed_;
  int64_t first_group_;
  Tensor saved_gate_up_;  // [R, 2F] pre-activations
  Tensor saved_hidden_;   // [R, F] activation output
  PackedLora gate_up_packed_, down_packed_;
  bool hold_packed_ = false;
  bool packed_ = false;  // gate_up_packed_ and down_packed_ hold packed adapters
};

}  // namespace moetrain
