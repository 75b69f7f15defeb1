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

  void copy(const TensorView& dst, const TensorView& src) override;
  Allocator& pinned_allocator() override { return inner_.pinned_allocator(); }
  void copy_async(const TensorView& dst, const TensorView& src) override;
  std::unique_ptr<QueueEvent> record_event() override { return inner_.record_event(); }
  void convert(const TensorView& dst, const TensorView& src) override;
  void fill(const TensorView& dst, double value) override;
  void random_mxfp4(const RandomMxfp4Args& args) override;
  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override;
  double sum_squares(const TensorView& x) override;
  void copy_columns(const CopyColumnsArgs& args) override;
  void copy_block(const CopyBlockArgs& args) override;
  void sum_over_heads(const TensorView& dst, const TensorView& src) override;
  void gemm(const GemmArgs& args) override;
  void grouped_gemm(const GroupedGemmArgs& args) override;
  void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) override;
  void embedding_forward_checked_ids(const TensorView& out, const TensorView& table, const TensorView& ids) override;
  void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) override;
  void rmsnorm_forward(const RmsNormArgs& args) override;
  void rmsnorm_backward(const RmsNormBackwardArgs& args) override;
  void rope(const RopeArgs& args) override;
  void attention_forward(const AttentionArgs& args) override;
  void attention_backward(const AttentionBackwardArgs& args) override;
  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override;
  void swiglu_backward(const SwigluBackwardArgs& args) override;
  void attn_res_forward(const AttnResArgs& args) override;
  void attn_res_backward(const AttnResBackwardArgs& args) override;
  void situ_forward(const SituArgs& args) override;
  void situ_backward(const SituBackwardArgs& args) override;
  void router_forward(const RouterArgs& args) override;
  void router_backward(const RouterBackwardArgs& args) override;
  void aux_loss(const AuxLossArgs& args) override;
  void moe_permutation(const MoePermutationArgs& args) override;
  void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                   int64_t top_k) override;
  void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                         bool accumulate) override;
  void moe_combine(const MoeCombineArgs& args) override;
  void moe_combine_backward(const MoeCombineBackwardArgs& args) override;
  void cross_entropy(const CrossEntropyArgs& args) override;
  void adamw(const AdamWArgs& args) override;
  void short_conv_forward(const ShortConvArgs& args) override;
  void short_conv_backward(const ShortConvBackwardArgs& args) override;
  void l2norm_forward(const L2NormArgs& args) override;
  void l2norm_backward(const L2NormBackwardArgs& args) override;
  void kda_gate_forward(const KdaGateArgs& args) override;
  void kda_gate_backward(const KdaGateBackwardArgs& args) override;
  void kda_forward(const KdaArgs& args) override;
  void kda_backward(const KdaBackwardArgs& args) override;
  void gated_rmsnorm_forward(const GatedRmsNormArgs& args) override;
  void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) override;
  void sigmoid_forward(const TensorView& y, const TensorView& x) override;
  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override;
  void layernorm_forward(const LayerNormArgs& args) override;
  void dsa_indexer_topk(const DsaIndexerArgs& args) override;
  void sparse_attention_forward(const SparseAttentionArgs& args) override;
  void sparse_attention_backward(const SparseAttentionBackwardArgs& args) override;
  void attention_gate_forward(const AttentionGateArgs& args) override;
  void attention_gate_backward(const AttentionGateBackwardArgs& args) override;

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
