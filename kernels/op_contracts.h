// Every op's argument contract, written once for all backends: the ranks, shapes and sizes its
// arguments must have relative to each other, the memory they may or must not share, and the role
// of each operand. A backend's entry point calls check_<op>(rules, args) with its OperandRules,
// which decide what differs per backend: the device an operand must live on, the dtypes it
// computes in, and whether index tensors are read back to check their values. Checks that only
// one backend needs (a kernel's size limit, a read-back of token ids) stay in that backend.
// A failed check throws Error(kInternal) "kernel argument: <op>: ..." (kernels/arg_checks.h).
#pragma once

#include <cstdint>

#include "core/base/tensor.h"
#include "kernels/ops.h"

namespace moetrain::kernels {

// What a backend accepts for an operand. The operand classes are those of ops.h's "Compute
// dtype" convention.
class OperandRules {
 public:
  explicit OperandRules(Device device) : device_(device) {}
  virtual ~OperandRules() = default;

  // An activation, a frozen weight or a gradient of either.
  virtual void activation(const char* op, const char* name, const TensorView& t) = 0;
  // An accumulation operand: saved statistics, losses, router scores, parameter gradients,
  // optimizer state, cos/sin tables.
  virtual void accumulation(const char* op, const char* name, const TensorView& t) = 0;
  // int32 prefix sums [count + 1] over `total` rows; `count_name` ("sequences", "groups") is
  // what the entries delimit, for messages.
  virtual void offsets(const char* op, const char* name, const TensorView& t, int64_t total,
                       const char* count_name) = 0;
  // Every entry of the int32 `t` in [0, bound), on a backend that reads index tensors.
  virtual void indices_below(const char* op, const char* name, const TensorView& t, int64_t bound) = 0;
  // A sparse attention's topk_index rows are causal selections (ops.h), on a backend that reads
  // index tensors.
  virtual void selection(const char* op, const TensorView& topk_index) = 0;

  // On the backend's device, with memory unless it has no elements.
  void placed(const char* op, const char* name, const TensorView& t) const;
  // Placed, of a dtype no backend chooses (int32 indices, uint8 MXFP4 codes).
  void fixed_dtype(const char* op, const char* name, const TensorView& t, DType dtype) const;

 private:
  Device device_;
};

// Utilities
void check_convert(OperandRules& rules, const TensorView& dst, const TensorView& src);
void check_fill(OperandRules& rules, const TensorView& dst);
void check_random_mxfp4(OperandRules& rules, const RandomMxfp4Args& args);
void check_axpby(OperandRules& rules, const TensorView& y, const TensorView& x);
void check_sum_squares(OperandRules& rules, const TensorView& x);
void check_copy_columns(OperandRules& rules, const CopyColumnsArgs& args);
void check_copy_block(OperandRules& rules, const CopyBlockArgs& args);
void check_sum_over_heads(OperandRules& rules, const TensorView& dst, const TensorView& src);
void check_gemm(OperandRules& rules, const GemmArgs& args);
// Not args.host_group_offsets: how a backend checks it depends on whether it read the device copy.
void check_grouped_gemm(OperandRules& rules, const GroupedGemmArgs& args);

// Dense layers. `op` names the entry point (embedding_forward or a variant of it).
void check_embedding_forward(OperandRules& rules, const char* op, const TensorView& out, const TensorView& table,
                             const TensorView& ids);
void check_embedding_backward(OperandRules& rules, const TensorView& dtable, const TensorView& dout,
                              const TensorView& ids);
void check_rmsnorm_forward(OperandRules& rules, const RmsNormArgs& args);
void check_rmsnorm_backward(OperandRules& rules, const RmsNormBackwardArgs& args);
// max_rope_dim: the largest rope_dim the backend's kernel takes, 0 for no limit.
void check_rope(OperandRules& rules, const RopeArgs& args, int64_t max_rope_dim);
void check_attention_forward(OperandRules& rules, const AttentionArgs& args);
void check_attention_backward(OperandRules& rules, const AttentionBackwardArgs& args);
void check_swiglu_forward(OperandRules& rules, const TensorView& h, const TensorView& gate_up);
void check_swiglu_backward(OperandRules& rules, const SwigluBackwardArgs& args);
void check_attn_res_forward(OperandRules& rules, const AttnResArgs& args);
void check_attn_res_backward(OperandRules& rules, const AttnResBackwardArgs& args);
void check_situ_forward(OperandRules& rules, const SituArgs& args);
void check_situ_backward(OperandRules& rules, const SituBackwardArgs& args);

// MoE, loss, optimizer
void check_router_forward(OperandRules& rules, const RouterArgs& args);
void check_router_backward(OperandRules& rules, const RouterBackwardArgs& args);
void check_aux_loss(OperandRules& rules, const AuxLossArgs& args);
void check_moe_permutation(OperandRules& rules, const MoePermutationArgs& args);
void check_moe_permute(OperandRules& rules, const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                       int64_t top_k);
void check_moe_unpermute_sum(OperandRules& rules, const TensorView& dx, const TensorView& drows,
                             const TensorView& pair_row, int64_t top_k);
void check_moe_combine(OperandRules& rules, const MoeCombineArgs& args);
void check_moe_combine_backward(OperandRules& rules, const MoeCombineBackwardArgs& args);
void check_cross_entropy(OperandRules& rules, const CrossEntropyArgs& args);
void check_adamw(OperandRules& rules, const AdamWArgs& args);

// KDA family
void check_short_conv_forward(OperandRules& rules, const ShortConvArgs& args);
void check_short_conv_backward(OperandRules& rules, const ShortConvBackwardArgs& args);
void check_l2norm_forward(OperandRules& rules, const L2NormArgs& args);
void check_l2norm_backward(OperandRules& rules, const L2NormBackwardArgs& args);
void check_kda_gate_forward(OperandRules& rules, const KdaGateArgs& args);
void check_kda_gate_backward(OperandRules& rules, const KdaGateBackwardArgs& args);
void check_kda_forward(OperandRules& rules, const KdaArgs& args);
void check_kda_backward(OperandRules& rules, const KdaBackwardArgs& args);
void check_gated_rmsnorm_forward(OperandRules& rules, const GatedRmsNormArgs& args);
void check_gated_rmsnorm_backward(OperandRules& rules, const GatedRmsNormBackwardArgs& args);
void check_sigmoid_forward(OperandRules& rules, const TensorView& y, const TensorView& x);
void check_sigmoid_backward(OperandRules& rules, const TensorView& dx, const TensorView& dy, const TensorView& y);

// DSA family
void check_layernorm_forward(OperandRules& rules, const LayerNormArgs& args);
void check_dsa_indexer_topk(OperandRules& rules, const DsaIndexerArgs& args);
void check_sparse_attention_forward(OperandRules& rules, const SparseAttentionArgs& args);
void check_sparse_attention_backward(OperandRules& rules, const SparseAttentionBackwardArgs& args);
void check_attention_gate_forward(OperandRules& rules, const AttentionGateArgs& args);
void check_attention_gate_backward(OperandRules& rules, const AttentionGateBackwardArgs& args);

}  // namespace moetrain::kernels
