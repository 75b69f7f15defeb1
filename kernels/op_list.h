// The ops of Backend (kernels/ops.h), listed once for the code that has to name every op: the
// timing decorator (kernels/timing_backend.h) and the argument contracts (kernels/op_contracts.h)
// are written from these lists. ops.h stays the contract and says what each op computes.
//
// A new op is declared in ops.h and added here in the same order; the compiler then asks every
// backend for it (TimingBackend and each backend would be abstract without it), and an entry
// whose name or argument type differs from ops.h does not compile (the decorator overrides it).
//
// Memory members (copy, copy_async, pinned_allocator, record_event) and
// embedding_forward_checked_ids, which a backend need not override, are not listed.
#pragma once

// X(op, Args) for every op that takes one argument struct: void op(const Args& args).
#define MOETRAIN_STRUCT_OPS(X) \
  X(random_mxfp4, RandomMxfp4Args) \
  X(copy_columns, CopyColumnsArgs) \
  X(copy_block, CopyBlockArgs) \
  X(gemm, GemmArgs) \
  X(gemm_fp8, GemmFp8Args) \
  X(grouped_gemm, GroupedGemmArgs) \
  X(rmsnorm_forward, RmsNormArgs) \
  X(rmsnorm_backward, RmsNormBackwardArgs) \
  X(rope, RopeArgs) \
  X(attention_forward, AttentionArgs) \
  X(attention_backward, AttentionBackwardArgs) \
  X(attention_merge, AttentionMergeArgs) \
  X(swiglu_backward, SwigluBackwardArgs) \
  X(situ_forward, SituArgs) \
  X(situ_backward, SituBackwardArgs) \
  X(router_forward, RouterArgs) \
  X(router_backward, RouterBackwardArgs) \
  X(aux_loss, AuxLossArgs) \
  X(moe_permutation, MoePermutationArgs) \
  X(moe_combine, MoeCombineArgs) \
  X(moe_combine_backward, MoeCombineBackwardArgs) \
  X(cross_entropy, CrossEntropyArgs) \
  X(adamw, AdamWArgs) \
  X(short_conv_forward, ShortConvArgs) \
  X(short_conv_backward, ShortConvBackwardArgs) \
  X(l2norm_forward, L2NormArgs) \
  X(l2norm_backward, L2NormBackwardArgs) \
  X(kda_gate_forward, KdaGateArgs) \
  X(kda_gate_backward, KdaGateBackwardArgs) \
  X(kda_forward, KdaArgs) \
  X(kda_backward, KdaBackwardArgs) \
  X(gated_rmsnorm_forward, GatedRmsNormArgs) \
  X(gated_rmsnorm_backward, GatedRmsNormBackwardArgs) \
  X(layernorm_forward, LayerNormArgs) \
  X(dsa_indexer_topk, DsaIndexerArgs) \
  X(sparse_attention_forward, SparseAttentionArgs) \
  X(sparse_attention_backward, SparseAttentionBackwardArgs) \
  X(attention_gate_forward, AttentionGateArgs) \
  X(attention_gate_backward, AttentionGateBackwardArgs) \
  X(attn_res_forward, AttnResArgs) \
  X(attn_res_backward, AttnResBackwardArgs) \
  X(gelu_forward, GeluArgs) \
  X(gelu_backward, GeluBackwardArgs) \
  X(vision_pos_embed, VisionPosEmbedArgs) \
  X(patch_merge, PatchMergeArgs)

// X(Return, op, (parameters), (arguments)) for every op with plain parameters:
// Return op parameters, called as op arguments.
#define MOETRAIN_PLAIN_OPS(X) \
  X(void, convert, (const TensorView& dst, const TensorView& src), (dst, src)) \
  X(void, fill, (const TensorView& dst, double value), (dst, value)) \
  X(void, axpby, (const TensorView& y, const TensorView& x, double alpha, double beta), (y, x, alpha, beta)) \
  X(double, sum_squares, (const TensorView& x), (x)) \
  X(void, sum_over_heads, (const TensorView& dst, const TensorView& src), (dst, src)) \
  X(void, embedding_forward, (const TensorView& out, const TensorView& table, const TensorView& ids), \
    (out, table, ids)) \
  X(void, embedding_backward, (const TensorView& dtable, const TensorView& dout, const TensorView& ids), \
    (dtable, dout, ids)) \
  X(void, swiglu_forward, (const TensorView& h, const TensorView& gate_up), (h, gate_up)) \
  X(void, moe_permute, (const TensorView& out, const TensorView& x, const TensorView& sorted_pair, int64_t top_k), \
    (out, x, sorted_pair, top_k)) \
  X(void, moe_unpermute_sum, \
    (const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k, bool accumulate), \
    (dx, drows, pair_row, top_k, accumulate)) \
  X(void, sigmoid_forward, (const TensorView& y, const TensorView& x), (y, x)) \
  X(void, sigmoid_backward, (const TensorView& dx, const TensorView& dy, const TensorView& y), (dx, dy, y))
