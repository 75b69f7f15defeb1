#include "core/base/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "core/base/error.h"

namespace moetrain {

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

void Shape::push_back(int64_t dim) {
  MOETRAIN_ASSERT(ndim_ < kMaxDims, "too many dimensions");
  MOETRAIN_ASSERT(dim >= 0, "negative dimension " + std::to_string(dim));
  dims_[ndim_++] = dim;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim_ != other.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + "]";
}

TensorView TensorView::slice_rows(int64_t begin, int64_t end) const {
  MOETRAIN_ASSERT(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape[0],
                  "row slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + shape.str());
  TensorView v = *this;
  size_t row_bytes = shape[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape[0]);
  v.data = static_cast<char*>(data) + static_cast<size_t>(begin) * row_bytes;
  v.shape[0] = end - begin;
  return v;
}

TensorView TensorView::reshaped(Shape new_shape) const {
  MOETRAIN_ASSERT(new_shape.numel() == numel(), "reshape " + shape.str() + " -> " + new_shape.str());
  TensorView v = *this;
  v.shape = new_shape;
  return v;
}

namespace {

class HostAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override {
    // 64-byte alignment: cache lines, and any SIMD width the compiler picks.
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr) override { std::free(ptr); }
};

}  // namespace

Allocator& host_allocator() {
  static HostAllocator allocator;
  return allocator;
}

Tensor::Tensor(Shape shape, DType dtype, Allocator& allocator) : allocator_(&allocator) {
  view_.shape = shape;
  view_.dtype = dtype;
  view_.device = allocator.device();
  // An allocation that fails names the tensor it was for (its shape and dtype) in front of the
  // allocator's own account (what was asked, what was free, what moetrain holds).
  const auto what = [&] {
    const size_t bytes = view_.nbytes();
    const std::string size = bytes >= (size_t{1} << 20) ? std::to_string(bytes >> 20) + " MiB"
                                                        : std::to_string(bytes) + " bytes";
    return std::string(dtype_name(dtype)) + " tensor " + shape.str() + " (" + size + ") on the " +
           device_name(view_.device) + ": ";
  };
  try {
    view_.data = allocator.allocate(view_.nbytes());
  } catch (const Error& error) {
    throw Error(error.code(), what() + error.what());
  } catch (const std::bad_alloc&) {
    throw Error(ExitCode::kInternal, what() + "out of host memory");
  }
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t(shape, dtype, host_allocator());
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::borrowed(const TensorView& view) {
  Tensor t;
  t.view_ = view;  // allocator_ stays null: nothing to free
  return t;
}

Tensor::Tensor(Tensor&& other) noexcept
    : view_(std::exchange(other.view_, TensorView{})), allocator_(std::exchange(other.allocator_, nullptr)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    reset();
    view_ = std::exchange(other.view_, TensorView{});
    allocator_ = std::exchange(other.allocator_, nullptr);
  }
  return *this;
}

void Tensor::reset() {
  if (allocator_ && view_.data) allocator_->deallocate(view_.data);
  view_ = TensorView{};
  allocator_ = nullptr;
}

}  // namespace moetrain
