#include "core/model/fsdp_bucket.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace moetrain {

namespace {

TensorView flat(const TensorView& v) { return v.reshaped(Shape{v.numel()}); }

// A placeholder keeping a weight's shape and dtype but no memory.
Tensor placeholder(const Shape& shape, DType dtype, Device device) {
  TensorView view;
  view.dtype = dtype;
  view.device = device;
  view.shape = shape;
  return Tensor::borrowed(view);
}

}  // namespace

FsdpBucket::FsdpBucket(std::string name, const std::vector<Tensor*>& members, Communicator& comm,
                       kernels::Backend& backend)
    : name_(std::move(name)), comm_(comm), backend_(backend) {
  MOETRAIN_ASSERT(!members.empty(), "FSDP bucket " + name_ + " has no members");
  auto aligned = [](int64_t bytes, int64_t unit) { return (bytes + unit - 1) / unit * unit; };
  int64_t unit = 1;  // the widest element: every shard boundary falls between elements of every member
  for (Tensor* t : members) {
    const int64_t size = dtype_size(t->dtype());
    unit = std::max(unit, size);
    full_bytes_ = aligned(full_bytes_, size);
    members_.push_back(Member{t, t->shape(), t->dtype(), full_bytes_, {}});
    full_bytes_ += static_cast<int64_t>(t->nbytes());
  }
  const int64_t ranks = comm_.size();
  shard_bytes_ = aligned((full_bytes_ + ranks - 1) / ranks, unit);
  const int64_t lo = shard_bytes_ * comm_.rank();
  const int64_t hi = lo + shard_bytes_;

  // Zero, padding included (never read, but deterministic), until the loader fills it.
  Tensor zeros = Tensor::zeros(Shape{shard_bytes_}, DType::kU8);
  shard_ = Tensor(Shape{shard_bytes_}, DType::kU8, backend_.allocator());
  backend_.copy(shard_, zeros);
  backend_.synchronize();
  for (Member& m : members_) {
    const int64_t size = dtype_size(m.dtype);
    const int64_t end_of_member = m.offset + m.shape.numel() * size;
    const int64_t begin = std::clamp(lo, m.offset, end_of_member);
    const int64_t end = std::clamp(hi, begin, end_of_member);
    m.part.begin = (begin - m.offset) / size;
    m.part.end = (end - m.offset) / size;
    TensorView dst = begin < end ? flat(shard_).slice_rows(begin - lo, end - lo) : flat(shard_).slice_rows(0, 0);
    dst.dtype = m.dtype;
    dst.shape = Shape{m.part.end - m.part.begin};
    m.part.dst = dst;
    *m.tensor = placeholder(m.shape, m.dtype, shard_.device());  // frees the full allocation
  }
}

const FsdpBucket::OwnedPart* FsdpBucket::owned_part(const Tensor* tensor) const {
  for (const Member& m : members_)
    if (m.tensor == tensor) return &m.part;
  return nullptr;
}

void FsdpBucket::point_members(void* base) {
  for (const Member& m : members_) {
    TensorView view;
    view.data = static_cast<char*>(base) + static_cast<size_t>(m.offset);
    view.dtype = m.dtype;
    view.device = shard_.device();
    view.shape = m.shape;
    *m.tensor = Tensor::borrowed(view);
  }
}

void FsdpBucket::gather() {
  if (gathered()) return;
  gathered_ = Tensor(Shape{shard_bytes_ * comm_.size()}, DType::kU8, backend_.allocator());
  // Queued, no host wait: the gather starts after the compute queued so far (the buffer may be
  // memory that queued work has just released). Compute waits for it from ready() on.
  comm_.wait_for(backend_.stream());
  comm_.all_gather(gathered_.view(), shard_.view());
  awaiting_ready_ = true;
  point_members(gathered_.data());
}

void FsdpBucket::ready() {
  MOETRAIN_ASSERT(gathered(), "FSDP bucket " + name_ + ": ready() before gather()");
  if (!awaiting_ready_) return;
  comm_.release_to(backend_.stream());
  awaiting_ready_ = false;
}

void FsdpBucket::release() {
  if (!gathered()) return;
  ready();  // a prefetched bucket never used: its gather must finish before the buffer goes
  // Queued kernels may still read the weights; the compute queue also waited for the gather
  // (release_to), so after this nothing touches the buffer.
  backend_.synchronize();
  for (const Member& m : members_) *m.tensor = placeholder(m.shape, m.dtype, shard_.device());
  gathered_.reset();
}

}  // namespace moetrain
