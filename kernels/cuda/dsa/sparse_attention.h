// DSA (DeepSeek Sparse Attention) attention on the CUDA backend: attention in MQA form over each
// query's selected rows (kernels/ops.h SparseAttentionArgs; spec in kernels/cpu/dsa.*). The
// indexer that selects the rows is dsa_indexer.h; the key LayerNorm and output gate norm_gate.h.
//
//   sparse_attention.cu  the forward and a deterministic backward (no atomics: per-(query, slot)
//                        dkv contributions in scratch, summed per key through an inverse index in
//                        a fixed order). SIMT, any dims and dtypes.
//   sparse_attention_forward_sm90.cu, sparse_attention_backward_sm90.cu  the forward and the
//                        backward's per-query step on Hopper tensor cores (wgmma) for BF16 at the
//                        latent dims 576 / 512; sparse_attention_forward / _backward pick them when
//                        supported (MOETRAIN_SPARSE_ATTENTION=simt forces the SIMT kernels).
//
// Operands: activations BF16 or F32 each; lse F32; topk_index, cu_seqlens int32 on the device
// (never read back: kernels mask entries outside [segment start, t]). Every output is
// overwritten; every sum runs in a fixed order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common/scratch.h"
#include "kernels/ops.h"

namespace moetrain::kernels::cuda_ops {

// Largest head dims the kernels take (the backend checks them): qk_dim and v_dim (FlashMLA's
// 576 / 512 fit).
constexpr int64_t kSparseMaxQkDim = 1024;
constexpr int64_t kSparseMaxVDim = 512;

void sparse_attention_forward(const SparseAttentionArgs& args, cudaStream_t stream);
// The Hopper forward (sparse_attention_forward_sm90.cu): BF16 q, kv, out (16-byte aligned),
// qk_dim 576, v_dim 512, scale > 0, an sm_90a build on a 9.0 device, and MOETRAIN_SPARSE_ATTENTION
// not "simt". Same outputs as the SIMT forward up to rounding.
bool sparse_attention_forward_sm90_supported(const SparseAttentionArgs& args);
void sparse_attention_forward_sm90(const SparseAttentionArgs& args, cudaStream_t stream);
// chunk_rows: queries whose dkv contributions sit in scratch at once; 0 picks it from a 512 MiB
// budget (2 GiB, in whole waves of the device's SMs, on the Hopper path: a chunk is one launch).
void sparse_attention_backward(const SparseAttentionBackwardArgs& args, DeviceScratch& scratch, cudaStream_t stream,
                               int64_t chunk_rows = 0);
// The Hopper backward's step 1 (sparse_attention_backward_sm90.cu) under the forward's conditions
// (dout, out and dq BF16 too): dq and the dkv contributions of queries [chunk_begin, chunk_begin +
// rows) into `contrib` ([rows, top_k, 576] F32, valid slots only), as the SIMT step 1 writes them.
bool sparse_attention_backward_sm90_supported(const SparseAttentionBackwardArgs& args);
void sparse_attention_backward_sm90_queries(const SparseAttentionBackwardArgs& args, float* contrib,
                                            int64_t chunk_begin, int64_t rows, cudaStream_t stream);

}  // namespace moetrain::kernels::cuda_ops
