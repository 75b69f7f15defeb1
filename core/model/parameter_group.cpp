#include "core/model/parameter_group.h"

#include <algorithm>
#include <set>
#include <utility>

#include "core/base/error.h"

namespace moetrain {

namespace {

int64_t align_up(int64_t n, int64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

TensorView flat_range(const TensorView& flat, int64_t begin, int64_t count, const Shape& shape) {
  return flat.slice_rows(begin, begin + count).reshaped(shape);
}

}  // namespace

ParameterGroup::ParameterGroup(std::string name, std::vector<Parameter*> params, Communicator* comm,
                               Communicator* blocks, kernels::Backend& backend)
    : name_(std::move(name)), backend_(backend), params_(std::move(params)), comm_(comm), blocks_(blocks) {
  MOETRAIN_ASSERT(!params_.empty(), "parameter group " + name_ + " is empty");
  if (comm_ != nullptr && comm_->size() > 1) {
    ranks_ = comm_->size();
    rank_ = comm_->rank();
  }
  const DType dtype = params_.front()->value.dtype();
  std::set<std::string> names;
  int64_t total = 0;
  for (Parameter* p : params_) {
    MOETRAIN_ASSERT(p != nullptr, "null parameter in group " + name_);
    MOETRAIN_ASSERT(names.insert(p->name).second, "duplicate parameter name " + p->name);
    MOETRAIN_ASSERT(p->value.dtype() == dtype && p->value.device() == backend.device(),
                    "parameter " + p->name + " differs in dtype or device from the rest of group " + name_);
    offsets_.push_back(total);
    total = align_up(total + p->value.numel(), kAlignment);
  }
  shard_numel_ = align_up((total + ranks_ - 1) / ranks_, kAlignment);
  const int64_t flat = shard_numel_ * ranks_;

  values_ = Tensor({flat}, dtype, backend.allocator());
  grads_ = Tensor({flat}, dtype, backend.allocator());
  backend.fill(values_, 0.0);  // the padding stays zero
  backend.fill(grads_, 0.0);
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    const Shape shape = p.value.shape();
    TensorView value = flat_range(values_.view(), offsets_[i], p.value.numel(), shape);
    backend.copy(value, p.value);
    p.value = Tensor::borrowed(value);
    p.grad = Tensor::borrowed(flat_range(grads_.view(), offsets_[i], p.value.numel(), shape));
  }

  const int64_t shard_begin = rank_ * shard_numel_, shard_end = shard_begin + shard_numel_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = std::max(offsets_[i], shard_begin);
    const int64_t end = std::min(offsets_[i] + params_[i]->value.numel(), shard_end);
    if (begin < end) segments_.push_back(Segment{params_[i], begin - offsets_[i], begin - shard_begin, end - begin});
  }
}

void ParameterGroup::return_storage() {
  for (Parameter* p : params_) {
    Tensor value(p->value.shape(), p->value.dtype(), backend_.allocator());
    Tensor grad(p->grad.shape(), p->grad.dtype(), backend_.allocator());
    backend_.copy(value, p->value);
    backend_.copy(grad, p->grad);
    p->value = std::move(value);
    p->grad = std::move(grad);
  }
  backend_.synchronize();
}

double sum_over(Communicator* comm, kernels::Backend& backend, double local) {
  std::vector<double> values{local};
  sum_over(comm, backend, values);
  return values[0];
}

void sum_over(Communicator* comm, kernels::Backend& backend, std::vector<double>& values) {
  if (comm == nullptr || comm->size() == 1 || values.empty()) return;
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor host({n}, DType::kF64);
  std::copy(values.begin(), values.end(), host.ptr<double>());
  if (comm->device() == Device::kCPU) {
    comm->all_reduce(host.view());
  } else {
    Tensor device({n}, DType::kF64, backend.allocator());
    backend.copy(device, host);
    backend.synchronize();  // the values are on the device before the communicator's stream reads them
    comm->all_reduce(device.view());
    comm->synchronize();
    backend.copy(host, device);
    backend.synchronize();
  }
  std::copy(host.ptr<double>(), host.ptr<double>() + n, values.begin());
}

}  // namespace moetrain
