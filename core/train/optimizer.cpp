#include "core/train/optimizer.h"

#include <cmath>
#include <set>

#include "core/base/error.h"

namespace moetrain {

AdamW::AdamW(const std::vector<Parameter*>& params, const AdamWOptions& options,
             kernels::Backend& backend)
    : params_(params), options_(options), backend_(backend) {
  std::set<std::string> names;
  moments_.reserve(params_.size());
  for (Parameter* param : params_) {
    MOETRAIN_ASSERT(param != nullptr, "null parameter");
    MOETRAIN_ASSERT(names.insert(param->name).second, "duplicate parameter name " + param->name);
    MOETRAIN_ASSERT(param->grad.defined() && param->grad.shape() == param->value.shape() &&
                        param->grad.dtype() == param->value.dtype(),
                    "parameter " + param->name + " needs a grad of its value's shape and dtype");
    Moments moments{Tensor(param->value.shape(), param->value.dtype(), backend_.allocator()),
                    Tensor(param->value.shape(), param->value.dtype(), backend_.allocator())};
    backend_.fill(moments.exp_avg, 0.0);
    backend_.fill(moments.exp_avg_sq, 0.0);
    moments_.push_back(std::move(moments));
  }
}

double AdamW::global_grad_norm() {
  double replicated = 0.0, partitioned = 0.0;
  for (Parameter* param : params_) {
    (param->expert_partitioned ? partitioned : replicated) += backend_.sum_squares(param->grad);
  }
  // Under expert parallelism each rank holds one block of the expert adapters: their squares
  // add up over the blocks (the identity on one rank).
  if (sum_over_expert_blocks_) partitioned = sum_over_expert_blocks_(partitioned);
  return std::sqrt(replicated + partitioned);
}

double AdamW::clip_gradients(double max_norm) {
  const double norm = global_grad_norm();
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) {
    const double scale = max_norm / norm;
    for (Parameter* param : params_) backend_.axpby(param->grad, param->grad, scale, 0.0);
  }
  return norm;
}

void AdamW::step(double lr) {
  ++step_count_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& param = *params_[i];
    kernels::AdamWArgs args;
    args.param = param.value;
    args.grad = param.grad;
    args.exp_avg = moments_[i].exp_avg;
    args.exp_avg_sq = moments_[i].exp_avg_sq;
    args.lr = lr;
    args.beta1 = options_.beta1;
    args.beta2 = options_.beta2;
    args.eps = options_.eps;
    args.weight_decay = param.weight_decay ? options_.weight_decay : 0.0;
    args.step = step_count_;
    backend_.adamw(args);
  }
  zero_grad();
}

void AdamW::zero_grad() {
  for (Parameter* param : params_) backend_.fill(param->grad, 0.0);
}

std::vector<AdamWStateView> AdamW::state() {
  std::vector<AdamWStateView> views;
  views.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    views.push_back({params_[i]->name, moments_[i].exp_avg.view(), moments_[i].exp_avg_sq.view()});
  }
  return views;
}

}  // namespace moetrain
