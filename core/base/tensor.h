// A small tensor: a view (data pointer, dtype, device, row-major shape) and an owning Tensor
// that frees its memory through the allocator that made it. No strides: every tensor is
// contiguous, which is all the kernels need; slicing happens along the first dimension.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/base/dtype.h"
#include "core/base/error.h"

namespace moetrain {

class Shape {
 public:
  static constexpr int kMaxDims = 6;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  template <typename It>
  Shape(It begin, It end) {
    for (It it = begin; it != end; ++it) push_back(static_cast<int64_t>(*it));
  }

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  int64_t numel() const;
  void push_back(int64_t dim);
  const int64_t* begin() const { return dims_.data(); }
  const int64_t* end() const { return dims_.data() + ndim_; }
  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }
  std::string str() const;  // "[2, 3, 4]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCPU;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int ndim() const { return shape.ndim(); }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + shape.ndim() : dim]; }

  // Typed access; the element type must match the dtype (checked, never compiled away).
  template <typename T>
  T* ptr() const {
    MOETRAIN_ASSERT(DTypeOf<T>::value == dtype, std::string("tensor is ") + dtype_name(dtype));
    return static_cast<T*>(data);
  }
  // Raw 16-bit access for bf16/f16 tensors.
  uint16_t* ptr_u16() const {
    MOETRAIN_ASSERT(dtype_size(dtype) == 2, std::string("tensor is ") + dtype_name(dtype));
    return static_cast<uint16_t*>(data);
  }
  // Rows [begin, end) of the first dimension.
  TensorView slice_rows(int64_t begin, int64_t end) const;
  TensorView reshaped(Shape new_shape) const;
};

// Where tensor memory comes from. The host allocator lives here; the CUDA backend registers
// a device allocator so core code can allocate device tensors without CUDA headers.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
};

Allocator& host_allocator();

class Tensor {
 public:
  Tensor() = default;
  Tensor(Shape shape, DType dtype, Allocator& allocator = host_allocator());
  ~Tensor() { reset(); }
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // Host tensors only: a zero-filled tensor.
  static Tensor zeros(Shape shape, DType dtype);
  // A non-owning tensor over memory someone else owns (e.g. a weight inside an FSDP gathered
  // buffer): reset() and the destructor leave the memory alone. The owner must outlive it.
  // A view with a null data pointer keeps only the shape and dtype (an unmaterialised weight).
  static Tensor borrowed(const TensorView& view);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable as a view
  void* data() const { return view_.data; }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  const Shape& shape() const { return view_.shape; }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  int64_t size(int dim) const { return view_.size(dim); }
  template <typename T>
  T* ptr() const { return view_.ptr<T>(); }
  bool defined() const { return view_.data != nullptr || allocator_ != nullptr; }
  bool owns_memory() const { return allocator_ != nullptr; }  // false for borrowed()
  void reset();

 private:
  TensorView view_;
  Allocator* allocator_ = nullptr;
};

}  // namespace moetrain
