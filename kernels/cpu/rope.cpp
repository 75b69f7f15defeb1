// Rotary position embedding, CPU reference (contract: kernels/ops.h, RopeArgs).
//
// For pair i of a row at position p, with c = cos[p, i], s = sin[p, i]:
//   (a, b) -> (a c - b s, b c + a s)
// kInterleaved (DeepSeek): a = x[2i], b = x[2i + 1], written to out[i], out[i + rope_dim / 2]
//   (transformers' apply_rotary_pos_emb_interleave: de-interleave, then rotate_half).
// kHalfSplit (Llama):      a = x[i], b = x[i + rope_dim / 2], written back to the same places.
// kAdjacent (MoonViT):     a = x[2i], b = x[2i + 1], written back to the same places.
// `inverse` is the transpose (= inverse) of that map: it reads the half-split positions,
// rotates by -angle, and writes the input layout. That is both the backward and the undo.
// Columns outside the rope range are copied from x when out is another tensor.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <string>
#include <vector>

namespace moetrain::kernels::cpu {

template <typename T>
void rope(const RopeArgs& args) {
  const int64_t width = args.x.size(-1);
  const int64_t rows = width == 0 ? 0 : args.x.numel() / width;
  const int64_t half = args.rope_dim / 2;
  const int64_t max_position = args.cos.size(0);
  const int32_t* positions = args.positions.ptr<int32_t>();
  const T* cos_table = args.cos.ptr<T>();
  const T* sin_table = args.sin.ptr<T>();
  const T* x = args.x.ptr<T>();
  T* out = args.out.ptr<T>();
  const bool in_place = args.out.data == args.x.data;
  const bool interleaved = args.layout == RopeLayout::kInterleaved;
  const bool adjacent = args.layout == RopeLayout::kAdjacent;

  if (!in_place) std::copy(x, x + rows * width, out);  // the columns rope leaves alone
  std::vector<T> a(static_cast<size_t>(half)), b(static_cast<size_t>(half));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = r / args.heads;
    const int32_t position = positions[token];
    MOETRAIN_ASSERT(position >= 0 && position < max_position,
                    "rope: position " + std::to_string(position) + " of token " + std::to_string(token) +
                        " is outside the cos/sin table of " + std::to_string(max_position) + " positions");
    const T* c = cos_table + position * half;
    const T* s = sin_table + position * half;
    const T* xr = x + r * width + args.col_offset;
    T* outr = out + r * width + args.col_offset;
    if (adjacent) {
      const T sign = args.inverse ? T(-1) : T(1);
      for (int64_t i = 0; i < half; ++i) {
        const T xa = xr[2 * i], xb = xr[2 * i + 1];
        outr[2 * i] = xa * c[i] - sign * xb * s[i];
        outr[2 * i + 1] = xb * c[i] + sign * xa * s[i];
      }
    } else if (!args.inverse) {
      for (int64_t i = 0; i < half; ++i) {
        a[i] = interleaved ? xr[2 * i] : xr[i];
        b[i] = interleaved ? xr[2 * i + 1] : xr[i + half];
      }
      for (int64_t i = 0; i < half; ++i) {  // a and b hold copies: safe in place
        outr[i] = a[i] * c[i] - b[i] * s[i];
        outr[i + half] = b[i] * c[i] + a[i] * s[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        a[i] = xr[i] * c[i] + xr[i + half] * s[i];
        b[i] = xr[i + half] * c[i] - xr[i] * s[i];
      }
      for (int64_t i = 0; i < half; ++i) {
        outr[interleaved ? 2 * i : i] = a[i];
        outr[interleaved ? 2 * i + 1 : i + half] = b[i];
      }
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(rope, const RopeArgs&)

}  // namespace moetrain::kernels::cpu
