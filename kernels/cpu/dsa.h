// DeepSeek Sparse Attention, CPU reference (contracts: kernels/ops.h, the DSA section):
// the indexer key's LayerNorm, the lightning indexer's causal top-k, and sparse attention in MQA
// form over the selected keys, forward and backward. Sums run in double in a fixed order (query,
// then head, then selected key), so results depend on nothing but the inputs; with every key
// selected the forward performs exactly attention_forward's arithmetic (kernels/cpu/attention.cpp),
// so "top-k >= T" reproduces dense attention bit for bit.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// y = (x - mean) * rstd * weight + bias per row, statistics in double. y may alias x.
template <typename T>
void layernorm_forward(const LayerNormArgs& args);

// Scores in double; selection by (score descending, key ascending), written in ascending key
// order, -1 padded. The caller has checked shapes and cu_seqlens.
template <typename T>
void dsa_indexer_topk(const DsaIndexerArgs& args);

// The caller has checked that every row of topk_index is valid keys <= t (strictly ascending)
// followed by -1s.
template <typename T>
void sparse_attention_forward(const SparseAttentionArgs& args);

// dq, dkv overwritten; P recomputed from q, kv and lse.
template <typename T>
void sparse_attention_backward(const SparseAttentionBackwardArgs& args);

}  // namespace moetrain::kernels::cpu
