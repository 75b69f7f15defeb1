// Kimi Delta Attention (the gated delta rule with a per-channel decay), CPU reference (contract:
// kernels/ops.h, KdaArgs). Two forms of the same function, each with its own backward:
//
// The recurrent form, the oracle: per segment and head, from S = 0 [k_dim, v_dim], token by token
//   S <- Diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  out_t = S^T (scale q_t)
// (the order of transformers' torch_recurrent_kda and fla's naive_recurrent_kda). Its backward
// runs back in time through the same steps, from the states kept by a forward pass.
//
// The chunked form, what the backend runs (and what the GPU kernels compute): each segment is cut
// into chunks of `chunk` tokens (a chunk never spans two segments; the last may be shorter). In a
// chunk of n tokens, with G_i = sum_{j <= i} g_j (the cumulative log decay), S the state entering:
//   A[i, j] = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])   (j < i; 0 elsewhere)
//   T = (I + A)^-1                     (unit lower triangular, by forward substitution)
//   u = T (beta v),  w = T (beta k exp(G)),  v_new = u - w S   (the delta-rule corrections)
//   out_i = (scale q_i exp(G_i)) S + sum_{j <= i} M[i, j] v_new_j,
//       M[i, j] = sum_d scale q_i[d] k_j[d] exp(G_i[d] - G_j[d])
//   S <- Diag(exp(G_last)) S + sum_j (k_j exp(G_last - G_j)) v_new_j^T
// Every exponent is a difference G_i - G_j with j <= i, or G itself: never positive for g <= 0, so
// no factor overflows however strong the decay (no exp(-G) appears anywhere).
// Its backward is written by hand: a forward sweep over the chunks recomputes the state entering
// each, then a reverse sweep carries dS from chunk to chunk (the formulas are in kda.cpp).
//
// Every function overwrites its outputs; all arguments are checked by the caller (the backend).
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

// The chunk length of the backend's KDA (fla's and transformers' chunk_size).
constexpr int64_t kKdaChunk = 64;

template <typename T>
void kda_recurrent_forward(const KdaArgs& args);

template <typename T>
void kda_recurrent_backward(const KdaBackwardArgs& args);

// `chunk` >= 1: the result does not depend on it (up to rounding); tests vary it.
template <typename T>
void kda_chunked_forward(const KdaArgs& args, int64_t chunk = kKdaChunk);

template <typename T>
void kda_chunked_backward(const KdaBackwardArgs& args, int64_t chunk = kKdaChunk);

}  // namespace moetrain::kernels::cpu
