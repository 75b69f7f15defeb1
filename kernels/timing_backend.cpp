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
