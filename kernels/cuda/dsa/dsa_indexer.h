// The DSA (DeepSeek Sparse Attention) lightning indexer's scores and causal top-k on the CUDA
// backend (kernels/ops.h DsaIndexerArgs; spec in kernels/cpu/dsa.*), in dsa_indexer.cu. Queries
// go in chunks of at most `chunk_rows` rows: a chunk's scores (F32, as order-preserving uint32
// keys, [chunk_rows, key_tokens]: k's rows) land in scratch, then one CTA per query radix-selects its
// top_k. Memory is chunk_rows x key_tokens, never tokens^2.
//
// Operands: q, k BF16 or F32 each; the indexer weights F32; topk_index, cu_seqlens int32 on the
// device. topk_index is overwritten; every sum runs in a fixed order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// Largest indexer head dim the kernels take (the backend checks it).
constexpr int64_t kDsaMaxIndexerDim = 1024;

// chunk_rows: queries per chunk; 0 picks it from a 1 GiB score budget (tests pass small values
// to exercise the chunk loop).
void dsa_indexer_topk(const DsaIndexerArgs& args, DeviceScratch& scratch, cudaStream_t stream,
                      int64_t chunk_rows = 0);

}  // namespace moetrain::kernels::cuda_ops
