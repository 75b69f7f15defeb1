#include "kernels/timing_backend.h"

#include <algorithm>
#include <cstdio>

namespace moetrain::kernels {

TimingBackend::TimingBackend(Backend& inner) : inner_(inner) {}

void TimingBackend::record(const char* op, std::chrono::steady_clock::time_point start) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Total& total = totals_[op];
  ++total.calls;
  total.seconds += seconds;
}

std::vector<OpTime> TimingBackend::times() const {
  std::vector<OpTime> rows;
  rows.reserve(totals_.size());
  for (const auto& [op, total] : totals_) rows.push_back({op, total.calls, total.seconds});
  std::sort(rows.begin(), rows.end(), [](const OpTime& a, const OpTime& b) {
    return a.seconds != b.seconds ? a.seconds > b.seconds : a.op < b.op;
  });
  return rows;
}

// No synchronize around allocations: cudaMalloc/cudaFree are host calls, and the ops before
// them have already been waited for.
void* TimingBackend::TimingAllocator::allocate(size_t bytes) {
  Allocator& inner = owner_.inner_.allocator();
  if (!owner_.enabled_) return inner.allocate(bytes);
  const auto start = std::chrono::steady_clock::now();
  void* ptr = inner.allocate(bytes);
  owner_.record("allocate", start);
  return ptr;
}

void TimingBackend::TimingAllocator::deallocate(void* ptr) {
  Allocator& inner = owner_.inner_.allocator();
  if (!owner_.enabled_) return inner.deallocate(ptr);
  const auto start = std::chrono::steady_clock::now();
  inner.deallocate(ptr);
  owner_.record("deallocate", start);
}

namespace {

const char* copy_label(const TensorView& dst, const TensorView& src) {
  if (dst.device == src.device) return "copy";
  return dst.device == Device::kCPU ? "copy (to host)" : "copy (to device)";
}

}  // namespace

void TimingBackend::copy(const TensorView& dst, const TensorView& src) {
  timed(copy_label(dst, src), [&] { inner_.copy(dst, src); });
}
void TimingBackend::copy_async(const TensorView& dst, const TensorView& src) {
  timed(copy_label(dst, src), [&] { inner_.copy_async(dst, src); });
}
void TimingBackend::convert(const TensorView& dst, const TensorView& src) {
  timed("convert", [&] { inner_.convert(dst, src); });
}
void TimingBackend::fill(const TensorView& dst, double value) {
  timed("fill", [&] { inner_.fill(dst, value); });
}
void TimingBackend::random_mxfp4(const RandomMxfp4Args& args) {
  timed("random_mxfp4", [&] { inner_.random_mxfp4(args); });
}
void TimingBackend::axpby(const TensorView& y, const TensorView& x, double alpha, double beta) {
  timed("axpby", [&] { inner_.axpby(y, x, alpha, beta); });
}
double TimingBackend::sum_squares(const TensorView& x) {
  return timed("sum_squares", [&] { return inner_.sum_squares(x); });
}
void TimingBackend::copy_columns(const CopyColumnsArgs& args) {
  timed("copy_columns", [&] { inner_.copy_columns(args); });
}
void TimingBackend::copy_block(const CopyBlockArgs& args) {
  timed("copy_block", [&] { inner_.copy_block(args); });
}
void TimingBackend::sum_over_heads(const TensorView& dst, const TensorView& src) {
  timed("sum_over_heads", [&] { inner_.sum_over_heads(dst, src); });
}
void TimingBackend::gemm(const GemmArgs& args) {
  timed("gemm", [&] { inner_.gemm(args); });
}
void TimingBackend::grouped_gemm(const GroupedGemmArgs& args) {
  const char* op =
      args.kind == GroupedGemmKind::kMGrouped ? "grouped_gemm (m-grouped)" : "grouped_gemm (k-grouped)";
  timed(op, [&] { inner_.grouped_gemm(args); });
}
void TimingBackend::embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) {
  timed("embedding_forward", [&] { inner_.embedding_forward(out, table, ids); });
}
void TimingBackend::embedding_forward_checked_ids(const TensorView& out, const TensorView& table,
                                                  const TensorView& ids) {
  timed("embedding_forward", [&] { inner_.embedding_forward_checked_ids(out, table, ids); });
}
void TimingBackend::embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) {
  timed("embedding_backward", [&] { inner_.embedding_backward(dtable, dout, ids); });
}
void TimingBackend::rmsnorm_forward(const RmsNormArgs& args) {
  timed("rmsnorm_forward", [&] { inner_.rmsnorm_forward(args); });
}
void TimingBackend::rmsnorm_backward(const RmsNormBackwardArgs& args) {
  timed("rmsnorm_backward", [&] { inner_.rmsnorm_backward(args); });
}
void TimingBackend::rope(const RopeArgs& args) {
  timed("rope", [&] { inner_.rope(args); });
}
void TimingBackend::attention_forward(const AttentionArgs& args) {
  timed("attention_forward", [&] { inner_.attention_forward(args); });
}
void TimingBackend::attention_backward(const AttentionBackwardArgs& args) {
  timed("attention_backward", [&] { inner_.attention_backward(args); });
}
void TimingBackend::swiglu_forward(const TensorView& h, const TensorView& gate_up) {
  timed("swiglu_forward", [&] { inner_.swiglu_forward(h, gate_up); });
}
void TimingBackend::swiglu_backward(const SwigluBackwardArgs& args) {
  timed("swiglu_backward", [&] { inner_.swiglu_backward(args); });
}
void TimingBackend::attn_res_forward(const AttnResArgs& args) {
  timed("attn_res_forward", [&] { inner_.attn_res_forward(args); });
}
void TimingBackend::attn_res_backward(const AttnResBackwardArgs& args) {
  timed("attn_res_backward", [&] { inner_.attn_res_backward(args); });
}
void TimingBackend::situ_forward(const SituArgs& args) {
  timed("situ_forward", [&] { inner_.situ_forward(args); });
}
void TimingBackend::situ_backward(const SituBackwardArgs& args) {
  timed("situ_backward", [&] { inner_.situ_backward(args); });
}
void TimingBackend::router_forward(const RouterArgs& args) {
  timed("router_forward", [&] { inner_.router_forward(args); });
}
void TimingBackend::router_backward(const RouterBackwardArgs& args) {
  timed("router_backward", [&] { inner_.router_backward(args); });
}
void TimingBackend::aux_loss(const AuxLossArgs& args) {
  timed("aux_loss", [&] { inner_.aux_loss(args); });
}
void TimingBackend::moe_permutation(const MoePermutationArgs& args) {
  timed("moe_permutation", [&] { inner_.moe_permutation(args); });
}
void TimingBackend::moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                                int64_t top_k) {
  timed("moe_permute", [&] { inner_.moe_permute(out, x, sorted_pair, top_k); });
}
void TimingBackend::moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row,
                                      int64_t top_k, bool accumulate) {
  timed("moe_unpermute_sum", [&] { inner_.moe_unpermute_sum(dx, drows, pair_row, top_k, accumulate); });
}
void TimingBackend::moe_combine(const MoeCombineArgs& args) {
  timed("moe_combine", [&] { inner_.moe_combine(args); });
}
void TimingBackend::moe_combine_backward(const MoeCombineBackwardArgs& args) {
  timed("moe_combine_backward", [&] { inner_.moe_combine_backward(args); });
}
void TimingBackend::cross_entropy(const CrossEntropyArgs& args) {
  timed("cross_entropy", [&] { inner_.cross_entropy(args); });
}
void TimingBackend::adamw(const AdamWArgs& args) {
  timed("adamw", [&] { inner_.adamw(args); });
}
void TimingBackend::short_conv_forward(const ShortConvArgs& args) {
  timed("short_conv_forward", [&] { inner_.short_conv_forward(args); });
}
void TimingBackend::short_conv_backward(const ShortConvBackwardArgs& args) {
  timed("short_conv_backward", [&] { inner_.short_conv_backward(args); });
}
void TimingBackend::l2norm_forward(const L2NormArgs& args) {
  timed("l2norm_forward", [&] { inner_.l2norm_forward(args); });
}
void TimingBackend::l2norm_backward(const L2NormBackwardArgs& args) {
  timed("l2norm_backward", [&] { inner_.l2norm_backward(args); });
}
void TimingBackend::kda_gate_forward(const KdaGateArgs& args) {
  timed("kda_gate_forward", [&] { inner_.kda_gate_forward(args); });
}
void TimingBackend::kda_gate_backward(const KdaGateBackwardArgs& args) {
  timed("kda_gate_backward", [&] { inner_.kda_gate_backward(args); });
}
void TimingBackend::kda_forward(const KdaArgs& args) {
  timed("kda_forward", [&] { inner_.kda_forward(args); });
}
void TimingBackend::kda_backward(const KdaBackwardArgs& args) {
  timed("kda_backward", [&] { inner_.kda_backward(args); });
}
void TimingBackend::gated_rmsnorm_forward(const GatedRmsNormArgs& args) {
  timed("gated_rmsnorm_forward", [&] { inner_.gated_rmsnorm_forward(args); });
}
void TimingBackend::gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) {
  timed("gated_rmsnorm_backward", [&] { inner_.gated_rmsnorm_backward(args); });
}
void TimingBackend::sigmoid_forward(const TensorView& y, const TensorView& x) {
  timed("sigmoid_forward", [&] { inner_.sigmoid_forward(y, x); });
}
void TimingBackend::sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) {
  timed("sigmoid_backward", [&] { inner_.sigmoid_backward(dx, dy, y); });
}
void TimingBackend::layernorm_forward(const LayerNormArgs& args) {
  timed("layernorm_forward", [&] { inner_.layernorm_forward(args); });
}
void TimingBackend::dsa_indexer_topk(const DsaIndexerArgs& args) {
  timed("dsa_indexer_topk", [&] { inner_.dsa_indexer_topk(args); });
}
void TimingBackend::sparse_attention_forward(const SparseAttentionArgs& args) {
  timed("sparse_attention_forward", [&] { inner_.sparse_attention_forward(args); });
}
void TimingBackend::sparse_attention_backward(const SparseAttentionBackwardArgs& args) {
  timed("sparse_attention_backward", [&] { inner_.sparse_attention_backward(args); });
}
void TimingBackend::attention_gate_forward(const AttentionGateArgs& args) {
  timed("attention_gate_forward", [&] { inner_.attention_gate_forward(args); });
}
void TimingBackend::attention_gate_backward(const AttentionGateBackwardArgs& args) {
  timed("attention_gate_backward", [&] { inner_.attention_gate_backward(args); });
}

namespace {

// printf into a std::string (kernels link no formatting library).
template <typename... Args>
void append(std::string& out, const char* format, Args... args) {
  char line[256];
  std::snprintf(line, sizeof(line), format, args...);
  out += line;
}

}  // namespace

std::string format_op_times(const std::vector<OpTime>& times, int64_t steps, double wall_seconds) {
  const double per_step = 1.0 / static_cast<double>(std::max<int64_t>(1, steps));
  double op_seconds = 0;
  int64_t calls = 0;
  for (const OpTime& t : times) {
    op_seconds += t.seconds;
    calls += t.calls;
  }
  const double outside = wall_seconds > op_seconds ? wall_seconds - op_seconds : 0;
  const double whole = op_seconds + outside;
  const auto share = [&](double seconds) { return whole > 0 ? 100.0 * seconds / whole : 0.0; };

  std::string out;
  append(out, "%-28s %10s %12s %12s %8s\n", "op", "calls", "total ms", "ms/call", "share");
  for (const OpTime& t : times) {
    const double per_call_ms = t.calls > 0 ? 1e3 * t.seconds / static_cast<double>(t.calls) : 0.0;
    append(out, "%-28s %10.6g %12.3f %12.4f %7.1f%%\n", t.op.c_str(), static_cast<double>(t.calls) * per_step,
           1e3 * t.seconds * per_step, per_call_ms, share(t.seconds));
  }
  if (outside > 0) {
    append(out, "%-28s %10s %12.3f %12s %7.1f%%\n", "(outside ops)", "-", 1e3 * outside * per_step, "-",
           share(outside));
  }
  append(out, "%-28s %10.6g %12.3f %12s %7.1f%%\n", "total", static_cast<double>(calls) * per_step,
         1e3 * whole * per_step, "-", whole > 0 ? 100.0 : 0.0);
  return out;
}

}  // namespace moetrain::kernels
