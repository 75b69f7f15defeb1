// MoE routing on the CPU (see RouterArgs, RouterBackwardArgs and AuxLossArgs in kernels/ops.h):
// scores, group-limited top-k selection with the score-correction bias, normalised and scaled
// weights, their backward, and the auxiliary load-balancing loss. It matches transformers'
// DeepseekV3MoE.route_tokens_to_experts (transformers 5.x) and Kimi-Linear's gate, with two
// deliberate, documented differences:
//
// 1. Group scores are the sum of the two best selection scores in the group for sigmoid AND
//    softmax scoring. transformers' DeepSeek-V3 only has sigmoid; Kimi-Linear's gate (the one
//    model here with a softmax option) uses the same top-2 sum for both. (DeepSeek-V2's
//    "group_limited_greedy" took the group max with softmax; we do not follow it.)
// 2. Experts of dropped groups are excluded from the top-k outright (as if their selection
//    score were -inf). transformers masks them with 0.0, which picks a dropped expert over a
//    kept one only when a kept expert's selection score (score + bias) is negative, something
//    a negative correction bias can cause; excluding them is what group-limited routing means.
//
// Ties (equal selection or group scores) go to the lower expert or group index; torch.topk
// leaves that order unspecified. topk_index is written in descending selection score (HF calls
// topk with sorted=False, so its order is arbitrary; the set is what must match).
//
// Arithmetic: scores are computed in double and rounded to T; selection scores and group sums
// are formed in T, as the reference does in fp32, so near-ties resolve the same way.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace moetrain::kernels::cpu {
namespace {

struct RoutingDims {
  int64_t tokens, experts, top_k;
};

// The sizes of scores [tokens, experts] and of a selection topk_index [tokens, top_k] of them.
RoutingDims routing_dims(const char* op, const TensorView& scores, const TensorView& topk_index) {
  MOETRAIN_ASSERT(scores.ndim() == 2, std::string(op) + ": scores must be [tokens, experts], got " + scores.shape.str());
  const int64_t tokens = scores.size(0);
  MOETRAIN_ASSERT(topk_index.ndim() == 2 && topk_index.size(0) == tokens,
                  std::string(op) + ": topk_index is " + topk_index.shape.str());
  return {tokens, scores.size(1), topk_index.size(1)};
}

constexpr double kNormalizeEpsilon = 1e-20;  // transformers adds it to the top-k sum

// An optional operand left out: a default (null) view, or one with no elements.
bool is_absent(const TensorView& t) { return t.data == nullptr || t.numel() == 0; }

void expect_shape(const TensorView& t, const Shape& shape, const char* op, const char* name) {
  MOETRAIN_ASSERT(t.shape == shape, std::string(op) + ": " + name + " is " + t.shape.str() + ", expected " +
                                        shape.str());
}

// Scores of one token's logits: sigmoid per expert, or a softmax over the experts.
template <typename T>
void score_row(T* scores, const T* logits, int64_t experts, RouterScoring scoring) {
  if (scoring == RouterScoring::kSigmoid) {
    for (int64_t e = 0; e < experts; ++e) scores[e] = static_cast<T>(1.0 / (1.0 + std::exp(-static_cast<double>(logits[e]))));
    return;
  }
  double max_logit = logits[0];
  for (int64_t e = 1; e < experts; ++e) max_logit = std::max(max_logit, static_cast<double>(logits[e]));
  double denom = 0.0;
  for (int64_t e = 0; e < experts; ++e) denom += std::exp(static_cast<double>(logits[e]) - max_logit);
  for (int64_t e = 0; e < experts; ++e) scores[e] = static_cast<T>(std::exp(static_cast<double>(logits[e]) - max_logit) / denom);
}

// Index of the largest eligible value; ties go to the lowest index (strict `>` in index order).
// A NaN never wins against a number but is still returned when nothing else is eligible.
template <typename T>
int64_t best_eligible(const T* values, const std::vector<char>& eligible) {
  int64_t best = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(eligible.size()); ++i) {
    if (!eligible[i]) continue;
    if (best < 0 || values[i] > values[best] || (std::isnan(values[best]) && !std::isnan(values[i]))) best = i;
  }
  return best;
}

// Marks the experts of the best `topk_groups` groups eligible (all of them when every group is kept).
template <typename T>
void keep_best_groups(std::vector<char>& eligible, const T* choice, const RouterArgs& args, int64_t experts) {
  const int64_t group_size = experts / args.num_groups;
  if (args.topk_groups >= args.num_groups) {
    std::fill(eligible.begin(), eligible.end(), 1);
    return;
  }
  std::vector<T> group_score(static_cast<size_t>(args.num_groups));
  for (int64_t g = 0; g < args.num_groups; ++g) {
    const T* c = choice + g * group_size;
    // The two best of the group (one when the group has a single expert), summed in T.
    int64_t first = 0;
    for (int64_t i = 1; i < group_size; ++i)
      if (c[i] > c[first]) first = i;
    T sum = c[first];
    if (group_size > 1) {
      int64_t second = first == 0 ? 1 : 0;
      for (int64_t i = 0; i < group_size; ++i)
        if (i != first && c[i] > c[second]) second = i;
      sum = static_cast<T>(sum + c[second]);
    }
    group_score[g] = sum;
  }
  std::vector<char> group_open(static_cast<size_t>(args.num_groups), 1);
  std::fill(eligible.begin(), eligible.end(), 0);
  for (int64_t n = 0; n < args.topk_groups; ++n) {
    const int64_t g = best_eligible(group_score.data(), group_open);
    group_open[g] = 0;
    std::fill(eligible.begin() + g * group_size, eligible.begin() + (g + 1) * group_size, 1);
  }
}

}  // namespace

// scores, topk_index and topk_weight are overwritten.
template <typename T>
void router_forward(const RouterArgs& args) {
  MOETRAIN_ASSERT(args.logits.ndim() == 2, "router_forward: logits must be [tokens, experts], got " +
                                               args.logits.shape.str());
  const int64_t tokens = args.logits.size(0), experts = args.logits.size(1);
  MOETRAIN_ASSERT(experts > 0 && args.num_groups > 0 && experts % args.num_groups == 0,
                  "router_forward: " + std::to_string(experts) + " experts do not split into " +
                      std::to_string(args.num_groups) + " groups");
  MOETRAIN_ASSERT(args.topk_groups >= 1 && args.topk_groups <= args.num_groups,
                  "router_forward: topk_groups " + std::to_string(args.topk_groups) + " of " +
                      std::to_string(args.num_groups) + " groups");
  MOETRAIN_ASSERT(args.top_k >= 1 && args.top_k <= args.topk_groups * (experts / args.num_groups),
                  "router_forward: top_k " + std::to_string(args.top_k) + " exceeds the " +
                      std::to_string(args.topk_groups * (experts / args.num_groups)) + " experts of the kept groups");
  expect_shape(args.scores, args.logits.shape, "router_forward", "scores");
  expect_shape(args.topk_index, Shape({tokens, args.top_k}), "router_forward", "topk_index");
  expect_shape(args.topk_weight, Shape({tokens, args.top_k}), "router_forward", "topk_weight");
  const bool has_bias = !is_absent(args.bias), has_noise = !is_absent(args.noise);
  if (has_bias) {
    MOETRAIN_ASSERT(args.bias.numel() == experts, "router_forward: bias is " + args.bias.shape.str() + " for " +
                                                      std::to_string(experts) + " experts");
  }
  if (has_noise) expect_shape(args.noise, args.logits.shape, "router_forward", "noise");

  const T* logits = args.logits.ptr<T>();
  const T* bias = has_bias ? args.bias.ptr<T>() : nullptr;
  const T* noise = has_noise ? args.noise.ptr<T>() : nullptr;
  T* scores = args.scores.ptr<T>();
  int32_t* topk_index = args.topk_index.ptr<int32_t>();
  T* topk_weight = args.topk_weight.ptr<T>();

  std::vector<T> choice(static_cast<size_t>(experts));
  std::vector<char> eligible(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    T* s = scores + t * experts;
    score_row(s, logits + t * experts, experts, args.scoring);
    for (int64_t e = 0; e < experts; ++e) {
      T c = s[e];
      if (bias) c = static_cast<T>(c + bias[e]);
      if (noise) c = static_cast<T>(c + noise[t * experts + e]);
      choice[e] = c;
    }
    keep_best_groups(eligible, choice.data(), args, experts);

    int32_t* index = topk_index + t * args.top_k;
    double sum = 0.0;
    for (int64_t j = 0; j < args.top_k; ++j) {
      const int64_t e = best_eligible(choice.data(), eligible);
      eligible[e] = 0;
      index[j] = static_cast<int32_t>(e);
      sum += static_cast<double>(s[e]);
    }
    const double factor = args.normalize ? args.scaling / (sum + kNormalizeEpsilon) : args.scaling;
    for (int64_t j = 0; j < args.top_k; ++j) {
      topk_weight[t * args.top_k + j] = static_cast<T>(static_cast<double>(s[index[j]]) * factor);
    }
  }
}

// dlogits is overwritten. The selection (topk_index) is a constant.
template <typename T>
void router_backward(const RouterBackwardArgs& args) {
  const auto [tokens, experts, top_k] = routing_dims("router_backward", args.scores, args.topk_index);
  expect_shape(args.dlogits, args.scores.shape, "router_backward", "dlogits");
  expect_shape(args.dtopk_weight, args.topk_index.shape, "router_backward", "dtopk_weight");
  const bool has_extra = !is_absent(args.dscores_extra);
  if (has_extra) expect_shape(args.dscores_extra, args.scores.shape, "router_backward", "dscores_extra");

  const T* scores = args.scores.ptr<T>();
  const int32_t* topk_index = args.topk_index.ptr<int32_t>();
  const T* dweight = args.dtopk_weight.ptr<T>();
  const T* extra = has_extra ? args.dscores_extra.ptr<T>() : nullptr;
  T* dlogits = args.dlogits.ptr<T>();

  std::vector<double> dscores(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* s = scores + t * experts;
    const int32_t* index = topk_index + t * top_k;
    const T* dw = dweight + t * top_k;
    for (int64_t e = 0; e < experts; ++e) dscores[e] = extra ? static_cast<double>(extra[t * experts + e]) : 0.0;
    for (int64_t j = 0; j < top_k; ++j) {
      MOETRAIN_ASSERT(index[j] >= 0 && index[j] < experts, "router_backward: token " + std::to_string(t) +
                                                               " slot " + std::to_string(j) + " has expert " +
                                                               std::to_string(index[j]));
    }
    // w_j = c * s_j / S with S = sum_k s_k + eps:  dL/ds_m = c * (dw_m / S - sum_j dw_j s_j / S^2),
    // the second term being the gradient through the sum. Without normalisation w_j = c * s_j.
    if (args.normalize) {
      double sum = 0.0, weighted = 0.0;
      for (int64_t j = 0; j < top_k; ++j) {
        sum += static_cast<double>(s[index[j]]);
        weighted += static_cast<double>(dw[j]) * static_cast<double>(s[index[j]]);
      }
      sum += kNormalizeEpsilon;
      const double through_sum = weighted / (sum * sum);
      for (int64_t j = 0; j < top_k; ++j) {
        dscores[index[j]] += args.scaling * (static_cast<double>(dw[j]) / sum - through_sum);
      }
    } else {
      for (int64_t j = 0; j < top_k; ++j) dscores[index[j]] += args.scaling * static_cast<double>(dw[j]);
    }

    T* dl = dlogits + t * experts;
    if (args.scoring == RouterScoring::kSigmoid) {
      for (int64_t e = 0; e < experts; ++e) {
        const double se = static_cast<double>(s[e]);
        dl[e] = static_cast<T>(dscores[e] * se * (1.0 - se));
      }
    } else {
      // Softmax Jacobian: dl_e = s_e * (ds_e - sum_f ds_f s_f).
      double mean = 0.0;
      for (int64_t e = 0; e < experts; ++e) mean += dscores[e] * static_cast<double>(s[e]);
      for (int64_t e = 0; e < experts; ++e) dl[e] = static_cast<T>(static_cast<double>(s[e]) * (dscores[e] - mean));
    }
  }
}

// loss [1] and dscores [tokens, experts] are overwritten.
template <typename T>
void aux_loss(const AuxLossArgs& args) {
  const auto [tokens, experts, top_k] = routing_dims("aux_loss", args.scores, args.topk_index);
  const int64_t seg_len = args.tokens_per_segment;
  MOETRAIN_ASSERT(seg_len > 0 && tokens % seg_len == 0, "aux_loss: " + std::to_string(tokens) +
                                                            " tokens are not whole segments of " +
                                                            std::to_string(seg_len));
  expect_shape(args.dscores, args.scores.shape, "aux_loss", "dscores");
  MOETRAIN_ASSERT(args.loss.numel() == 1, "aux_loss: loss must have one element, got " + args.loss.shape.str());

  const T* scores = args.scores.ptr<T>();
  const int32_t* topk_index = args.topk_index.ptr<int32_t>();
  T* dscores = args.dscores.ptr<T>();
  const int64_t segments = tokens / seg_len;

  // L = coef / G * sum_g sum_e f_e P_e with P_e = 1/T sum_t s'[t, e], s' = s / sum_e s.
  // dL/ds'[t, e] = coef * f_e / (G T); through the per-token normalisation,
  // dL/ds[t, e] = coef / (G T sum_t) * (f_e - sum_e' f_e' s'[t, e']).
  double loss = 0.0;
  std::vector<double> f(static_cast<size_t>(experts));
  for (int64_t g = 0; g < segments; ++g) {
    std::fill(f.begin(), f.end(), 0.0);
    for (int64_t t = g * seg_len; t < (g + 1) * seg_len; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t e = topk_index[t * top_k + j];
        MOETRAIN_ASSERT(e >= 0 && e < experts, "aux_loss: token " + std::to_string(t) + " slot " +
                                                   std::to_string(j) + " has expert " + std::to_string(e));
        f[e] += 1.0;
      }
    }
    const double count_scale = static_cast<double>(experts) / static_cast<double>(top_k * seg_len);
    for (double& fe : f) fe *= count_scale;

    const double grad_scale = args.coef / static_cast<double>(segments * seg_len);
    for (int64_t t = g * seg_len; t < (g + 1) * seg_len; ++t) {
      const T* s = scores + t * experts;
      double row_sum = 0.0;
      for (int64_t e = 0; e < experts; ++e) row_sum += static_cast<double>(s[e]);
      double f_dot_normalized = 0.0;
      for (int64_t e = 0; e < experts; ++e) f_dot_normalized += f[e] * static_cast<double>(s[e]) / row_sum;
      loss += grad_scale * f_dot_normalized;
      for (int64_t e = 0; e < experts; ++e) {
        dscores[t * experts + e] = static_cast<T>(grad_scale / row_sum * (f[e] - f_dot_normalized));
      }
    }
  }
  args.loss.ptr<T>()[0] = static_cast<T>(loss);
}

MOETRAIN_CPU_INSTANTIATE(router_forward, const RouterArgs&)
MOETRAIN_CPU_INSTANTIATE(router_backward, const RouterBackwardArgs&)
MOETRAIN_CPU_INSTANTIATE(aux_loss, const AuxLossArgs&)

}  // namespace moetrain::kernels::cpu
