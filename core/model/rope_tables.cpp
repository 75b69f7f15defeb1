#include "core/model/rope_tables.h"

#include <algorithm>
#include <cmath>

namespace moetrain {
namespace {

constexpr double kPi = 3.14159265358979323846;

// YaRN's magnitude correction for a context stretched by `scale`.
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

bool uses_yarn(const MlaConfig& mla) { return mla.rope_scaling.type == "yarn"; }

// The dimension index at which a wavelength makes `rotations` turns over the original context.
double correction_dim(double rotations, double dim, double base, double original_context) {
  return dim * std::log(original_context / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
}

}  // namespace

std::vector<double> rope_inverse_frequencies(const MlaConfig& mla, int64_t max_position_embeddings) {
  const double dim = static_cast<double>(mla.qk_rope_head_dim);
  const int64_t half = mla.qk_rope_head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = 1.0 / std::pow(mla.rope_theta, 2.0 * i / dim);
  if (!uses_yarn(mla)) return inv_freq;

  const RopeScalingConfig& s = mla.rope_scaling;
  double original = static_cast<double>(s.original_max_position_embeddings);
  // Low-frequency pairs (long wavelengths) are interpolated by `factor`, high-frequency ones
  // kept, with a linear ramp between the two correction dimensions.
  double low = std::max(std::floor(correction_dim(s.beta_fast, dim, mla.rope_theta, original)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow, dim, mla.rope_theta, original)), dim - 1);
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    double extrapolation_weight = 1.0 - ramp;
    double interpolated = inv_freq[i] / s.factor;
    inv_freq[i] = interpolated * (1.0 - extrapolation_weight) + inv_freq[i] * extrapolation_weight;
  }
  (void)max_position_embeddings;
  return inv_freq;
}

double rope_attention_factor(const MlaConfig& mla, int64_t max_position_embeddings) {
  if (!uses_yarn(mla)) return 1.0;
  const RopeScalingConfig& s = mla.rope_scaling;
  (void)max_position_embeddings;
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) {
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  }
  return yarn_mscale(s.factor, 1.0);
}

RopeTables make_rope_tables(const MlaConfig& mla, int64_t max_position_embeddings, int64_t positions) {
  RopeTables t;
  t.positions = positions;
  t.half_dim = mla.qk_rope_head_dim / 2;
  std::vector<double> inv_freq = rope_inverse_frequencies(mla, max_position_embeddings);
  double factor = rope_attention_factor(mla, max_position_embeddings);
  t.cos.resize(static_cast<size_t>(positions * t.half_dim));
  t.sin.resize(t.cos.size());
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < t.half_dim; ++i) {
      double angle = static_cast<double>(p) * inv_freq[i];
      t.cos[p * t.half_dim + i] = std::cos(angle) * factor;
      t.sin[p * t.half_dim + i] = std::sin(angle) * factor;
    }
  }
  return t;
}

double mla_softmax_scale(const MlaConfig& mla) {
  double scale = 1.0 / std::sqrt(static_cast<double>(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
  if (uses_yarn(mla) && mla.rope_scaling.mscale_all_dim != 0.0) {
    double m = yarn_mscale(mla.rope_scaling.factor, mla.rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

}  // namespace moetrain
