// TimingBackend: a Backend decorator that says where a training step's time goes, op by op.
//
// It forwards every op to the backend it wraps and, while enabled, charges each call with the
// host wall time from entry until the inner backend's synchronize() returns after it: the
// device time plus launch and host overhead (argument checks, library planning, host syncs and
// allocations made inside the op). Before starting the clock it synchronizes too, so work
// queued earlier is never charged to the op. Synchronizing after every op stops the host from
// running ahead of the device, so the sum over ops is a little more than an unprofiled step:
// time the step with timing disabled and profile a separate one.
//
// Two ops get one row per variant, because their variants cost differently: grouped_gemm by
// kind ("grouped_gemm (m-grouped)", "(k-grouped)": weight gradients), and copy by direction
// ("copy (to host)", "copy (to device)": each is a host sync on CUDA unless it is a copy_async;
// plain "copy" otherwise).
//
// Tensors that callers allocate through allocator() (the model's temporaries between ops) are
// timed too, as the rows "allocate" and "deallocate" (host time only: on CUDA, cudaMalloc and
// cudaFree block the host, and every op before them has already been synchronized). Such
// tensors hold a pointer to this decorator's allocator, so they must be freed before it dies.
//
// The rows are backend-neutral: no CUDA here, so it builds into the CPU kernel library.
// Not thread-safe (neither is a Backend's stream).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/op_list.h"
#include "kernels/ops.h"

namespace moetrain::kernels {

struct OpTime {
  std::string op;
  int64_t calls = 0;
  double seconds = 0;
};

// Not final: disabled, it is a plain forwarding decorator that always has every op, so a test
// probe (tests/cuda/dsa_golden_probe.h) derives from it and overrides only the ops it observes.
class TimingBackend : public Backend {
 public:
  // `inner` is not owned and must outlive this decorator.
  explicit TimingBackend(Backend& inner);

  // Every op so far (since construction or reset()), largest total time first.
  std::vector<OpTime> times() const;
  void reset() { totals_.clear(); }
  // While disabled, ops are forwarded without synchronizing and nothing is recorded.
  void enable() { enabled_ = true; }
  void disable() { enabled_ = false; }
  bool enabled() const { return enabled_; }

  Device device() const override { return inner_.device(); }
  const char* name() const override { return inner_.name(); }
  Allocator& allocator() override { return allocator_; }
  void synchronize() override { inner_.synchronize(); }
  BackendStats stats() override { return inner_.stats(); }
  void reset_peak_memory() override { inner_.reset_peak_memory(); }
  void* stream() override { return inner_.stream(); }

  // Every op is forwarded, timed under its own name (the row names of the file comment).
  void copy(const TensorView& dst, const TensorView& src) override;
  Allocator& pinned_allocator() override { return inner_.pinned_allocator(); }
  void copy_async(const TensorView& dst, const TensorView& src) override;
  std::unique_ptr<QueueEvent> record_event() override { return inner_.record_event(); }
  // The side queue's copies overlap the ops: forwarded untimed.
  void side_copy_async(const TensorView& dst, const TensorView& src) override { inner_.side_copy_async(dst, src); }
  void side_wait(QueueEvent& ops_event) override { inner_.side_wait(ops_event); }
  std::unique_ptr<QueueEvent> record_side_event() override { return inner_.record_side_event(); }
  void ops_wait(QueueEvent& side_event) override { inner_.ops_wait(side_event); }
  void embedding_forward_checked_ids(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    timed("embedding_forward", [&] { inner_.embedding_forward_checked_ids(out, table, ids); });
  }
#define MOETRAIN_TIMED_STRUCT_OP(op, Args) \
  void op(const Args& args) override { timed(row_name(#op, args), [&] { inner_.op(args); }); }
#define MOETRAIN_TIMED_PLAIN_OP(Return, op, parameters, arguments) \
  Return op parameters override { return timed(#op, [&] { return inner_.op arguments; }); }
  MOETRAIN_STRUCT_OPS(MOETRAIN_TIMED_STRUCT_OP)
  MOETRAIN_PLAIN_OPS(MOETRAIN_TIMED_PLAIN_OP)
#undef MOETRAIN_TIMED_STRUCT_OP
#undef MOETRAIN_TIMED_PLAIN_OP

 private:
  struct Total {
    int64_t calls = 0;
    double seconds = 0;
  };

  // Forwards allocations to the inner backend's allocator, timing each while enabled.
  class TimingAllocator final : public Allocator {
   public:
    explicit TimingAllocator(TimingBackend& owner) : owner_(owner) {}
    Device device() const override { return owner_.inner_.allocator().device(); }
    void* allocate(size_t bytes) override;
    void deallocate(void* ptr) override;

   private:
    TimingBackend& owner_;
  };

  void record(const char* op, std::chrono::steady_clock::time_point start);

  // The row an op's call is charged to: the op's name, or its variant's (the file comment).
  template <typename Args>
  static const char* row_name(const char* op, const Args&) {
    return op;
  }
  static const char* row_name(const char*, const GroupedGemmArgs& args) {
    return args.kind == GroupedGemmKind::kMGrouped ? "grouped_gemm (m-grouped)" : "grouped_gemm (k-grouped)";
  }

  // Runs `call` (a forwarding lambda) and charges it to `op`; returns what it returns.
  template <typename Call>
  auto timed(const char* op, Call&& call) -> decltype(call()) {
    if (!enabled_) return call();
    inner_.synchronize();
    const auto start = std::chrono::steady_clock::now();
    if constexpr (std::is_void_v<decltype(call())>) {
      call();
      inner_.synchronize();
      record(op, start);
    } else {
      auto result = call();
      inner_.synchronize();
      record(op, start);
      return result;
    }
  }

  Backend& inner_;
  TimingAllocator allocator_{*this};
  bool enabled_ = true;
  std::unordered_map<std::string, Total> totals_;
};

// A table of `times` as given (times() sorts them): op, calls, total ms, ms per call, share of
// the total. When `wall_seconds` is larger than their sum (the wall time of the profiled span),
// a row "(outside ops)" shows the rest: host code between ops, untimed synchronizes.
// Totals are divided by `steps` (>= 1), so the table reads per step.
std::string format_op_times(const std::vector<OpTime>& times, int64_t steps = 1, double wall_seconds = 0);

}  // namespace moetrain::kernels
