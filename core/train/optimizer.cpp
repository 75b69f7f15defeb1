#include "core/train/optimizer.h"

#include <cmath>

#include "core/base/error.h"

namespace moetrain {

namespace {

TensorView range(const TensorView& flat, int64_t begin, int64_t count) { return flat.slice_rows(begin, begin + count); }

}  // namespace

AdamW::AdamW(const std::vector<ParameterGroup*>& groups, const AdamWOptions& options, kernels::Backend& backend)
    : options_(options), backend_(backend) {
  init_groups(groups);
}

AdamW::AdamW(const std::vector<Parameter*>& params, const AdamWOptions& options, kernels::Backend& backend)
    : options_(options), backend_(backend) {
  if (params.empty()) return;
  owned_group_ = std::make_unique<ParameterGroup>("parameters", params, nullptr, nullptr, backend);
  init_groups({owned_group_.get()});
}

AdamW::~AdamW() {
  if (owned_group_) owned_group_->return_storage();  // the loose parameters outlive this optimizer
}

void AdamW::init_groups(const std::vector<ParameterGroup*>& groups) {
  for (ParameterGroup* group : groups) {
    MOETRAIN_ASSERT(group != nullptr, "null parameter group");
    GroupState state;
    state.group = group;
    const Shape shard({group->shard_numel()});
    const DType dtype = group->values().dtype;
    state.exp_avg = Tensor(shard, dtype, backend_.allocator());
    state.exp_avg_sq = Tensor(shard, dtype, backend_.allocator());
    backend_.fill(state.exp_avg, 0.0);
    backend_.fill(state.exp_avg_sq, 0.0);
    if (group->sharded()) {
      state.reduced = Tensor(shard, dtype, backend_.allocator());
      state.send = Tensor(shard, dtype, backend_.allocator());
      backend_.fill(state.reduced, 0.0);
    }
    groups_.push_back(std::move(state));
  }
}

std::vector<Parameter*> AdamW::parameters() const {
  std::vector<Parameter*> params;
  for (const GroupState& g : groups_) params.insert(params.end(), g.group->params().begin(), g.group->params().end());
  return params;
}

int64_t AdamW::moment_numel() const {
  int64_t numel = 0;
  for (const GroupState& g : groups_) numel += g.exp_avg.numel();
  return numel;
}

void AdamW::reduce_gradients() {
  bool synchronized = false;
  for (GroupState& g : groups_) {
    if (!g.group->sharded()) continue;
    if (!synchronized) {  // the backward's gradients are final before a communicator reads them
      backend_.synchronize();
      synchronized = true;
    }
    g.group->comm()->reduce_scatter(g.reduced.view(), g.group->grads());
    g.group->comm()->synchronize();
    backend_.fill(g.group->grads(), 0.0);  // ready for the next step's accumulation
  }
}

double AdamW::global_grad_norm() {
  double total = 0.0;
  for (GroupState& g : groups_) {
    // The padding between and after parameters is zero: it adds nothing.
    double squares = sum_over(g.group->comm(), backend_, backend_.sum_squares(g.reduced_grads()));
    // A block-partitioned group's other blocks live on other ranks (expert parallelism).
    total += sum_over(g.group->blocks(), backend_, squares);
  }
  return std::sqrt(total);
}

double AdamW::clip_gradients(double max_norm) {
  const double norm = global_grad_norm();
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) {
    const double scale = max_norm / norm;
    for (GroupState& g : groups_) backend_.axpby(g.reduced_grads(), g.reduced_grads(), scale, 0.0);
  }
  return norm;
}

void AdamW::step(double lr) {
  ++step_count_;
  for (GroupState& g : groups_) {
    // Unsharded, the reduced grads are the whole flat buffer, which is the shard.
    const TensorView values = g.group->value_shard(), grads = g.reduced_grads();
    // One update per run of parameters with the same weight decay, the alignment padding
    // between them included: its value, gradient and moments are zero and stay zero.
    const std::vector<ParameterGroup::Segment>& segments = g.group->segments();
    for (size_t first = 0, last = 0; first < segments.size(); first = last) {
      const bool decay = segments[first].param->weight_decay;
      while (last < segments.size() && segments[last].param->weight_decay == decay) ++last;
      const int64_t begin = segments[first].shard_offset;
      const int64_t count = segments[last - 1].shard_offset + segments[last - 1].count - begin;
      kernels::AdamWArgs args;
      args.param = range(values, begin, count);
      args.grad = range(grads, begin, count);
      args.exp_avg = range(g.exp_avg.view(), begin, count);
      args.exp_avg_sq = range(g.exp_avg_sq.view(), begin, count);
      args.lr = lr;
      args.beta1 = options_.beta1;
      args.beta2 = options_.beta2;
      args.eps = options_.eps;
      args.weight_decay = decay ? options_.weight_decay : 0.0;
      args.step = step_count_;
      backend_.adamw(args);
    }
    if (g.group->sharded()) {
      backend_.copy(g.send, values);
      backend_.synchronize();
      g.group->comm()->all_gather(g.group->values(), g.send.view());
      g.group->comm()->synchronize();
    }
  }
  zero_grad();
}

void AdamW::zero_grad() {
  for (GroupState& g : groups_) {
    backend_.fill(g.group->grads(), 0.0);
    if (g.group->sharded()) backend_.fill(g.reduced, 0.0);
  }
}

std::vector<AdamWStateView> AdamW::gather_state() {
  std::vector<AdamWStateView> views;
  for (GroupState& g : groups_) {
    TensorView avg = g.exp_avg.view(), avg_sq = g.exp_avg_sq.view();
    if (g.group->sharded()) {
      const Shape whole({g.group->values().numel()});
      g.whole_avg = Tensor(whole, avg.dtype, backend_.allocator());
      g.whole_avg_sq = Tensor(whole, avg.dtype, backend_.allocator());
      backend_.synchronize();
      g.group->comm()->all_gather(g.whole_avg.view(), avg);
      g.group->comm()->all_gather(g.whole_avg_sq.view(), avg_sq);
      g.group->comm()->synchronize();
      avg = g.whole_avg.view();
      avg_sq = g.whole_avg_sq.view();
    }
    const std::vector<Parameter*>& params = g.group->params();
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t offset = g.group->offsets()[i], numel = params[i]->value.numel();
      const Shape& shape = params[i]->value.shape();
      views.push_back({params[i]->name, range(avg, offset, numel).reshaped(shape),
                       range(avg_sq, offset, numel).reshaped(shape)});
    }
  }
  return views;
}

void AdamW::scatter_state() {
  for (GroupState& g : groups_) {
    if (!g.group->sharded()) continue;
    MOETRAIN_ASSERT(g.whole_avg.defined(), "scatter_state without gather_state");
    const int64_t shard = g.group->shard_numel(), begin = g.group->rank() * shard;
    backend_.copy(g.exp_avg, range(g.whole_avg.view(), begin, shard));
    backend_.copy(g.exp_avg_sq, range(g.whole_avg_sq.view(), begin, shard));
  }
  release_state();
}

void AdamW::release_state() {
  backend_.synchronize();  // copies out of the staging buffers are done before they are freed
  for (GroupState& g : groups_) {
    g.whole_avg.reset();
    g.whole_avg_sq.reset();
  }
}

void AdamW::gather_gradients() {
  backend_.synchronize();
  for (GroupState& g : groups_) {
    if (!g.group->sharded()) continue;
    g.group->comm()->all_gather(g.group->grads(), g.reduced.view());
    g.group->comm()->synchronize();
  }
}

}  // namespace moetrain
