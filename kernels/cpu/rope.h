// Rotary position embedding, CPU reference (contract: kernels/ops.h, RopeArgs).
//
// For pair i of a row at position p, with c = cos[p, i], s = sin[p, i]:
//   (a, b) -> (a c - b s, b c + a s)
// kInterleaved (DeepSeek): a = x[2i], b = x[2i + 1], written to out[i], out[i + rope_dim / 2]
//   (transformers' apply_rotary_pos_emb_interleave: de-interleave, then rotate_half).
// kHalfSplit (Llama):      a = x[i], b = x[i + rope_dim / 2], written back to the same places.
// `inverse` is the transpose (= inverse) of that map: it reads the half-split positions,
// rotates by -angle, and writes the input layout. That is both the backward and the undo.
// Columns outside the rope range are copied from x when out is another tensor.
#pragma once

#include "kernels/ops.h"

namespace moetrain::kernels::cpu {

template <typename T>
void rope(const RopeArgs& args);

}  // namespace moetrain::kernels::cpu
