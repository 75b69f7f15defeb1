// Typed collectives over one process group (docs/ARCHITECTURE.md §5).
//
// The element type comes from the C++ type (or the tensor's dtype) and every count is a count
// of elements, never of bytes: `comm.all_gather(out, in, count)` with float pointers moves
// `count` floats per rank. Underneath, one type-erased virtual core takes (pointers, element
// counts, DType); the template wrappers are the only way in.
//
// Implementations:
//   MpiCommunicator  (parallel/mpi_comm.cpp)   host buffers, blocking, for the CPU backend.
//   NcclCommunicator (parallel/nccl_comm.h)    device buffers, queued on its own CUDA stream.
//   HostStagedCommunicator (parallel/host_staged_comm.h)  device buffers through host memory
//                    over MPI, blocking: for tests of several ranks sharing one GPU.
// Completion: a collective's results are ready once `synchronize()` returns (MPI: already when
// the call returns). Buffers of one call must not overlap, except all_reduce's single buffer.
//
// Determinism: every float sum is bitwise reproducible and identical on every rank. The MPI
// implementation sums in rank order (0 + 1 + 2 + ...) itself instead of trusting the library's
// reduction tree; NCCL's ring order is fixed for a given communicator size and topology.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <mpi.h>

#include "core/base/dtype.h"
#include "core/base/tensor.h"

namespace moetrain {

enum class ReduceOp { kSum, kMax };
const char* reduce_op_name(ReduceOp op);

// A bfloat16 value as raw bits, for moving BF16 buffers through typed collectives on the host
// (gathers, all-to-all, broadcast). Sums of BF16 are NCCL-only (MPI has no bf16 type).
struct Bf16Bits {
  uint16_t bits;
};

// The DType of each element type a collective accepts.
template <typename T> struct CommDType;
template <> struct CommDType<float> { static constexpr DType value = DType::kF32; };
template <> struct CommDType<double> { static constexpr DType value = DType::kF64; };
template <> struct CommDType<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct CommDType<int64_t> { static constexpr DType value = DType::kI64; };
template <> struct CommDType<uint8_t> { static constexpr DType value = DType::kU8; };
template <> struct CommDType<Bf16Bits> { static constexpr DType value = DType::kBF16; };

// Where each peer's part of an all_to_all_v lies, in elements. Entry i is about the group's
// rank i: send_counts[i] elements from in + send_offsets[i] go to rank i, recv_counts[i]
// elements from rank i land at out + recv_offsets[i]. Zero counts are legal (a rank that routes
// no tokens to a peer). recv_counts[i] on this rank must equal send_counts[me] on rank i:
// exchange the counts first (all_to_all with one count per rank).
struct AllToAllLayout {
  std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;

  // Counts in `unit`s (e.g. rows of `unit` = hidden elements), packed back to back in rank order.
  static AllToAllLayout packed(const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts,
                               int64_t unit = 1);
  int64_t send_extent() const;  // elements of `in` the layout touches: max(offset + count)
  int64_t recv_extent() const;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;  // this process's rank in the group
  virtual int size() const = 0;
  virtual Device device() const = 0;  // where buffers must live
  virtual void barrier() = 0;
  // Waits until every collective issued so far has completed (MPI: nothing to wait for).
  virtual void synchronize() = 0;
  // Ordering against a device queue (Backend::stream()) without a host wait: collectives issued
  // after wait_for(s) start after the work queued on s so far; work queued on s after
  // release_to(s) starts after the collectives issued so far. No-ops where collectives complete
  // before returning (MPI) or for a null stream.
  virtual void wait_for(void* producer_stream) { (void)producer_stream; }
  virtual void release_to(void* consumer_stream) { (void)consumer_stream; }

  // out [size * count] = the `in` [count] of every rank, in rank order.
  template <typename T>
  void all_gather(T* out, const T* in, int64_t count_per_rank) {
    all_gather_elements(out, in, count_per_rank, CommDType<T>::value);
  }
  // out [count] = sum over ranks of their in[rank() * count, (rank() + 1) * count).
  template <typename T>
  void reduce_scatter(T* out, const T* in, int64_t count_per_rank) {
    reduce_scatter_elements(out, in, count_per_rank, CommDType<T>::value);
  }
  // data [count] = op over ranks of data, in place, identical on every rank.
  template <typename T>
  void all_reduce(T* data, int64_t count, ReduceOp op = ReduceOp::kSum) {
    all_reduce_elements(data, count, CommDType<T>::value, op);
  }
  template <typename T>
  void all_to_all_v(T* out, const T* in, const AllToAllLayout& layout) {
    check_layout(layout);
    all_to_all_v_elements(out, in, layout, CommDType<T>::value);
  }
  // The same count to and from every rank: out [size * count], in [size * count].
  template <typename T>
  void all_to_all(T* out, const T* in, int64_t count_per_rank) {
    all_to_all_v(out, in, uniform_layout(count_per_rank));
  }
  // data [count] = root's data.
  template <typename T>
  void broadcast(T* data, int64_t count, int root) {
    broadcast_elements(data, count, CommDType<T>::value, root);
  }

  // Tensor forms: the element type is the tensor's dtype and counts are element counts derived
  // from the shapes (checked: out.numel() == size() * in.numel() for all_gather, and so on);
  // dtypes must match and the tensors must live on device().
  void all_gather(const TensorView& out, const TensorView& in);
  void reduce_scatter(const TensorView& out, const TensorView& in);
  void all_reduce(const TensorView& data, ReduceOp op = ReduceOp::kSum);
  void all_to_all_v(const TensorView& out, const TensorView& in, const AllToAllLayout& layout);
  void broadcast(const TensorView& data, int root);

 protected:
  // The type-erased core. Counts are elements of `dtype`; implementations turn them into
  // their library's (count, datatype) pairs.
  virtual void all_gather_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) = 0;
  virtual void reduce_scatter_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) = 0;
  virtual void all_reduce_elements(void* data, int64_t count, DType dtype, ReduceOp op) = 0;
  virtual void all_to_all_v_elements(void* out, const void* in, const AllToAllLayout& layout, DType dtype) = 0;
  virtual void broadcast_elements(void* data, int64_t count, DType dtype, int root) = 0;

 private:
  void check_layout(const AllToAllLayout& layout) const;
  void check_tensor(const TensorView& t, const char* what) const;
  AllToAllLayout uniform_layout(int64_t count_per_rank) const;
};

// The type-erased core above, as each implementation (MPI below, NCCL, host-staged) declares it:
// one list, so that a new collective reaches every communicator at once.
#define MOETRAIN_COMMUNICATOR_TRANSPORT_OVERRIDES                                                          \
  void all_gather_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) override;       \
  void reduce_scatter_elements(void* out, const void* in, int64_t count_per_rank, DType dtype) override;   \
  void all_reduce_elements(void* data, int64_t count, DType dtype, ReduceOp op) override;                  \
  void all_to_all_v_elements(void* out, const void* in, const AllToAllLayout& layout, DType dtype) override; \
  void broadcast_elements(void* data, int64_t count, DType dtype, int root) override;

// Collectives over an MPI communicator on host memory. `comm` is not owned and must outlive
// this object (e.g. one of DeviceMesh's communicators).

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::kCPU; }
  void barrier() override;
  void synchronize() override {}
  MPI_Comm comm() const { return comm_; }

 protected:
  MOETRAIN_COMMUNICATOR_TRANSPORT_OVERRIDES

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace moetrain
