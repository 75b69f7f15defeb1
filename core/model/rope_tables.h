// Rotary embedding tables with DeepSeek's YaRN scaling, and the softmax-scale correction
// (mscale) that goes with it, computed in double on the host.
#pragma once

#include <vector>

#include "core/config/config.h"

namespace moetrain {

struct RopeTables {
  int64_t positions = 0;
  int64_t half_dim = 0;          // rope_dim / 2
  std::vector<double> cos;       // [positions, half_dim], attention factor folded in
  std::vector<double> sin;
};

// inv_freq for each of the rope_dim / 2 frequency pairs (YaRN-blended when rope_scaling is yarn).
std::vector<double> rope_inverse_frequencies(const MlaConfig& mla, int64_t max_position_embeddings);
// YaRN's attention factor multiplied into cos and sin (1 without scaling).
double rope_attention_factor(const MlaConfig& mla, int64_t max_position_embeddings);
RopeTables make_rope_tables(const MlaConfig& mla, int64_t max_position_embeddings, int64_t positions);
// qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set.
double mla_softmax_scale(const MlaConfig& mla);

}  // namespace moetrain
