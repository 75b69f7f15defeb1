// The backend-independent part of Communicator: argument checks, all-to-all layouts and the
// tensor forms of the collectives.
#include "parallel/comm.h"

#include <algorithm>
#include <string>

#include "core/base/error.h"

namespace moetrain {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

AllToAllLayout AllToAllLayout::packed(const std::vector<int64_t>& send_counts,
                                      const std::vector<int64_t>& recv_counts, int64_t unit) {
  AllToAllLayout layout;
  auto pack = [unit](const std::vector<int64_t>& counts, std::vector<int64_t>& scaled, std::vector<int64_t>& offsets) {
    int64_t offset = 0;
    for (int64_t c : counts) {
      scaled.push_back(c * unit);
      offsets.push_back(offset);
      offset += c * unit;
    }
  };
  pack(send_counts, layout.send_counts, layout.send_offsets);
  pack(recv_counts, layout.recv_counts, layout.recv_offsets);
  return layout;
}

namespace {

int64_t extent(const std::vector<int64_t>& counts, const std::vector<int64_t>& offsets) {
  int64_t end = 0;
  for (size_t i = 0; i < counts.size() && i < offsets.size(); ++i) {
    if (counts[i] > 0) end = std::max(end, offsets[i] + counts[i]);
  }
  return end;
}

}  // namespace

int64_t AllToAllLayout::send_extent() const { return extent(send_counts, send_offsets); }
int64_t AllToAllLayout::recv_extent() const { return extent(recv_counts, recv_offsets); }

void Communicator::check_layout(const AllToAllLayout& layout) const {
  const size_t n = static_cast<size_t>(size());
  MOETRAIN_ASSERT(layout.send_counts.size() == n && layout.send_offsets.size() == n &&
                      layout.recv_counts.size() == n && layout.recv_offsets.size() == n,
                  "all_to_all_v layout needs one count and offset per rank of a group of " + std::to_string(n));
  for (size_t i = 0; i < n; ++i) {
    MOETRAIN_ASSERT(layout.send_counts[i] >= 0 && layout.recv_counts[i] >= 0 && layout.send_offsets[i] >= 0 &&
                        layout.recv_offsets[i] >= 0,
                    "all_to_all_v layout has a negative count or offset for rank " + std::to_string(i));
  }
}

AllToAllLayout Communicator::uniform_layout(int64_t count_per_rank) const {
  std::vector<int64_t> counts(static_cast<size_t>(size()), count_per_rank);
  return AllToAllLayout::packed(counts, counts);
}

void Communicator::check_tensor(const TensorView& t, const char* what) const {
  MOETRAIN_ASSERT(t.device == device() || t.numel() == 0,
                  std::string(what) + " is a " + device_name(t.device) + " tensor but this communicator works on " +
                      device_name(device()) + " memory");
}

void Communicator::all_gather(const TensorView& out, const TensorView& in) {
  check_tensor(out, "all_gather out");
  check_tensor(in, "all_gather in");
  MOETRAIN_ASSERT(out.dtype == in.dtype && out.numel() == in.numel() * size(),
                  "all_gather: out " + out.shape.str() + " must hold " + std::to_string(size()) + " x in " +
                      in.shape.str() + " of the same dtype");
  all_gather_elements(out.data, in.data, in.numel(), in.dtype);
}

void Communicator::reduce_scatter(const TensorView& out, const TensorView& in) {
  check_tensor(out, "reduce_scatter out");
  check_tensor(in, "reduce_scatter in");
  MOETRAIN_ASSERT(out.dtype == in.dtype && in.numel() == out.numel() * size(),
                  "reduce_scatter: in " + in.shape.str() + " must hold " + std::to_string(size()) + " x out " +
                      out.shape.str() + " of the same dtype");
  reduce_scatter_elements(out.data, in.data, out.numel(), out.dtype);
}

void Communicator::all_reduce(const TensorView& data, ReduceOp op) {
  check_tensor(data, "all_reduce data");
  all_reduce_elements(data.data, data.numel(), data.dtype, op);
}

void Communicator::all_to_all_v(const TensorView& out, const TensorView& in, const AllToAllLayout& layout) {
  check_tensor(out, "all_to_all_v out");
  check_tensor(in, "all_to_all_v in");
  check_layout(layout);
  MOETRAIN_ASSERT(out.dtype == in.dtype, "all_to_all_v: out and in differ in dtype");
  MOETRAIN_ASSERT(layout.send_extent() <= in.numel() && layout.recv_extent() <= out.numel(),
                  "all_to_all_v: the layout reaches element " + std::to_string(layout.send_extent()) + " of in (" +
                      std::to_string(in.numel()) + ") or " + std::to_string(layout.recv_extent()) + " of out (" +
                      std::to_string(out.numel()) + ")");
  all_to_all_v_elements(out.data, in.data, layout, in.dtype);
}

void Communicator::broadcast(const TensorView& data, int root) {
  check_tensor(data, "broadcast data");
  broadcast_elements(data.data, data.numel(), data.dtype, root);
}

}  // namespace moetrain
