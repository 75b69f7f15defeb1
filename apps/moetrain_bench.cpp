// moetrain-bench: times the CUDA backend's ops and whole training steps on one GPU and states
// each result against the H200 ceilings and peer baselines of docs/PERF.md:
//   ops      GEMM, the MoE expert block (grouped GEMM), attention, KDA, DSA, memory-bound kernels
//   step     forward + backward of a model config (tokens/s, MFU); --op-times: per-op breakdown
//   ep       expert-parallel dispatch + combine across GPUs against NCCL's all-to-all (mpirun)
// Each op timing is the median of `--reps` runs after warm-up, each run timed by CUDA events on
// the backend's stream (as the PyTorch baselines are); steps are timed on the host.
// Inputs are random (never zeros: zeros make matrix units run faster than real data).
//
//   moetrain-bench ops [--reps N] [--only gemm,experts,grouped,attention,kda,dsa,memory]
//   moetrain-bench step --config FILE [--set k=v]... [--steps N] [--op-times]
//   mpirun -np 2 moetrain-bench ep [--mib 256] [--reps N]
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "core/base/log.h"
#include "core/config/config.h"
#include "core/model/expert_dispatch.h"
#include "core/model/model.h"
#include "core/plan/model_flops.h"
#include "core/data/synthetic_data.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/dsa/dsa_indexer.h"
#include "kernels/cuda/gemm/grouped_gemm.h"
#include "kernels/cuda/common/device.h"
#include "kernels/ops.h"
#include "kernels/timing_backend.h"
#include "parallel/nccl_comm.h"
#include "parallel/runtime.h"

namespace moetrain {
namespace {

using kernels::Backend;

// Ceilings measured on one H200 (docs/PERF.md).
constexpr double kMatrixCeilingTflops = 771.0;
constexpr double kMemoryCeilingTbps = 4.2;
constexpr double kDatasheetBf16Tflops = 989.0;  // dense BF16, for MFU

struct Row {
  std::string name;
  double ms = 0;
  double tflops = 0;  // 0: not a matrix op
  double tbps = 0;    // 0: not a memory op
  std::string versus;  // the target or baseline, and our ratio to it
};

// `ops`: how long each timing runs its op untimed first (--heat-up-ms). An H200 running GEMMs
// back to back reaches its 700 W power cap within a second and lowers its SM clock from 1980
// MHz to 1245-1750 (nvidia-smi, 2026-12-01). Without the heat-up, a row ran at whatever clock the
// rows before it had left (the same launches differed by up to 25% between a cool GPU and a
// hot one): rows were compared at different clocks, and the first rows of a run timed at clocks
// a training step never sees. scripts/bench_torch_grouped_mm.py heats
// up the same way.
double heat_up_ms = 500;

// Median of `reps` runs after `warmup` runs and, past those, more runs until heat_up_ms have
// passed. Each run is timed by CUDA events recorded on the backend's stream around it: the GPU
// time of the launches, as `torch.cuda.Event` times the peer baselines, without the host's
// launch-and-synchronize round trip (10-20 us, a few percent of a short row).
double median_ms(Backend& backend, const std::function<void()>& op, int reps, int warmup = 3) {
  const auto heat_up_start = std::chrono::steady_clock::now();
  for (int i = 0; i < warmup; ++i) op();
  backend.synchronize();
  while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - heat_up_start).count() <
         heat_up_ms) {
    op();
    backend.synchronize();
  }
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    op();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A device tensor filled from a host buffer of uniform values in +-[0.1, 1] (random signs).
Tensor random_device(Backend& backend, Shape shape, DType dtype, uint64_t seed, double scale = 1.0) {
  Tensor host(shape, DType::kF32);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  float* p = host.ptr<float>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    double u = 0.1 + 0.9 * static_cast<double>(x >> 11) * 0x1.0p-53;
    p[i] = static_cast<float>((x & 1 ? u : -u) * scale);
  }
  Tensor staged(shape, DType::kF32, backend.allocator());
  backend.copy(staged, host);
  Tensor out(shape, dtype, backend.allocator());
  backend.convert(out, staged);
  return out;
}

Tensor int_device(Backend& backend, const std::vector<int32_t>& values) {
  Tensor host({static_cast<int64_t>(values.size())}, DType::kI32);
  std::copy(values.begin(), values.end(), host.ptr<int32_t>());
  Tensor out(host.shape(), DType::kI32, backend.allocator());
  backend.copy(out, host);
  return out;
}

std::string ratio(double value, double target, const char* what) {
  return fmt::format("{:.2f}x {}", value / target, what);
}

void bench_gemm(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t n = 8192;
  Tensor a = random_device(be, {n, n}, DType::kBF16, 1), b = random_device(be, {n, n}, DType::kBF16, 2);
  Tensor c({n, n}, DType::kBF16, be.allocator());
  double ms = median_ms(be, [&] { be.gemm({c, a, b, false, true, 1.0, 0.0}); }, reps);
  double tflops = 2.0 * n * n * n / (ms * 1e9);
  rows.push_back({"gemm bf16 8192^3 (x W^T)", ms, tflops, 0,
                  ratio(tflops, kMatrixCeilingTflops, "of the 771 TFLOP/s ceiling (target >= 0.90)")});
}

// The MoE expert block at Kimi-Linear-48B's expert shapes: 131072 routed rows, 64 experts, hidden 2304, width 1024.
void bench_experts(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t rows_total = 131072, experts = 64, d = 2304, f = 1024;
  std::vector<int32_t> offsets;
  for (int64_t e = 0; e <= experts; ++e) offsets.push_back(static_cast<int32_t>(e * rows_total / experts));
  Tensor group_offsets = int_device(be, offsets);
  Tensor x = random_device(be, {rows_total, d}, DType::kBF16, 3);
  Tensor w_gate_up = random_device(be, {experts, 2 * f, d}, DType::kBF16, 4, 0.02);
  Tensor w_down = random_device(be, {experts, d, f}, DType::kBF16, 5, 0.03);
  Tensor gate_up({rows_total, 2 * f}, DType::kBF16, be.allocator());
  Tensor h({rows_total, f}, DType::kBF16, be.allocator());
  Tensor out({rows_total, d}, DType::kBF16, be.allocator());
  Tensor dh({rows_total, f}, DType::kBF16, be.allocator());
  Tensor dgate_up({rows_total, 2 * f}, DType::kBF16, be.allocator());
  Tensor dx({rows_total, d}, DType::kBF16, be.allocator());
  auto mgrouped = [&](const Tensor& c, const Tensor& a, const Tensor& b, bool transpose_b) {
    kernels::GroupedGemmArgs args;
    args.c = c;
    args.a = a;
    args.b = b;
    args.group_offsets = group_offsets;
    args.host_group_offsets = offsets.data();  // as the model passes them: no read-back
    args.transpose_b = transpose_b;
    be.grouped_gemm(args);
  };
  auto forward = [&] {
    mgrouped(gate_up, x, w_gate_up, true);
    be.swiglu_forward(h, gate_up);
    mgrouped(out, h, w_down, true);
  };
  auto input_grad = [&] {
    mgrouped(dh, out, w_down, false);  // out stands in for dout: same shape, random-like values
    be.swiglu_backward({dgate_up, dh, gate_up});
    mgrouped(dx, dgate_up, w_gate_up, false);
  };
  const double flops = 6.0 * rows_total * d * f;
  double fwd = median_ms(be, forward, reps);
  rows.push_back({"experts fwd (131072 rows, 64 experts)", fwd, flops / (fwd * 1e9), 0,
                  ratio(3.43, fwd, "the speed of torch._grouped_mm (3.43 ms; target >= 1)")});
  double both = median_ms(be, [&] { forward(); input_grad(); }, reps);
  rows.push_back({"experts fwd + input-grad", both, 2 * flops / (both * 1e9), 0,
                  ratio(8.0, both, "the speed of torch._grouped_mm (8.0 ms; target >= 1)")});
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM at the Kimi-Linear-dims model's expert shapes: 65,536 routed rows (8192
// tokens x top-8) over 256 experts, one projection at a time. scripts/bench_torch_grouped_mm.py
// times torch._grouped_mm on the same shapes and counts (same generators).

// Per-expert row counts. uniform: 256 each. router: 8192 tokens, each to 8 distinct experts drawn
// by xorshift64 (seed 1). skewed: every 32nd expert at 7x the mean (1792 rows), the rest shared
// evenly (the first ones one row more).
std::vector<int32_t> expert_counts(const std::string& kind, int64_t rows, int64_t experts) {
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0);
  if (kind == "uniform") {
    for (auto& c : counts) c = static_cast<int32_t>(rows / experts);
  } else if (kind == "router") {
    const int64_t top_k = 8, tokens = rows / top_k;
    uint64_t x = 1;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int64_t> chosen;
      while (static_cast<int64_t>(chosen.size()) < top_k) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const int64_t e = static_cast<int64_t>(x % static_cast<uint64_t>(experts));
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int64_t e : chosen) ++counts[static_cast<size_t>(e)];
    }
  } else {
    const int64_t hot = experts / 32, hot_rows = 7 * rows / experts;
    const int64_t cold = experts - hot, cold_rows = rows - hot * hot_rows;
    for (int64_t e = 0, c = 0; e < experts; ++e) {
      if (e % 32 == 0) {
        counts[static_cast<size_t>(e)] = static_cast<int32_t>(hot_rows);
      } else {
        counts[static_cast<size_t>(e)] = static_cast<int32_t>(cold_rows / cold + (c < cold_rows % cold ? 1 : 0));
        ++c;
      }
    }
  }
  return counts;
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> offsets{0};
  for (int32_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

// A [G, n, k] weight of random values without drawing G x n x k of them on the host: the first
// slice's values copied into every slice (the GEMM's speed does not depend on which values).
Tensor expert_weight(Backend& be, int64_t experts, int64_t n, int64_t k, uint64_t seed) {
  const int64_t distinct = std::min<int64_t>(experts, 8);
  Tensor first = random_device(be, {distinct, n, k}, DType::kBF16, seed, 0.02);
  Tensor w({experts, n, k}, DType::kBF16, be.allocator());
  for (int64_t e = 0; e < experts; e += distinct) {
    const int64_t count = std::min(distinct, experts - e);
    be.copy(w.view().slice_rows(e, e + count), first.view().slice_rows(0, count));
  }
  return w;
}

// cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx, one problem per non-empty expert) on the
// same operands: c[rows_g] = x[rows_g] . op(w[g]), BF16 in and out, F32 compute.
class CublasGrouped {
 public:
  CublasGrouped(Backend& be, const std::vector<int32_t>& offsets, const Tensor& c, const Tensor& x, const Tensor& w,
                bool transpose_w) {
    CUBLAS_CHECK(cublasCreate(&handle_));
    CUBLAS_CHECK(cublasSetStream(handle_, static_cast<cudaStream_t>(be.stream())));
    const int64_t k = x.size(1), n = c.size(1);
    std::vector<int64_t> pointers[3];
    for (size_t g = 0; g + 1 < offsets.size(); ++g) {
      const int rows = offsets[g + 1] - offsets[g];
      if (rows == 0) continue;
      // Column-major: c_g^T [n, rows] = op(w_g)^T [n, k] . x_g^T [k, rows].
      trans_w_.push_back(transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N);
      trans_x_.push_back(CUBLAS_OP_N);
      m_.push_back(static_cast<int>(n));
      n_.push_back(rows);
      k_.push_back(static_cast<int>(k));
      ld_w_.push_back(static_cast<int>(transpose_w ? k : n));
      ld_x_.push_back(static_cast<int>(k));
      ld_c_.push_back(static_cast<int>(n));
      alpha_.push_back(1.0f);
      beta_.push_back(0.0f);
      sizes_.push_back(1);
      const int64_t row0 = offsets[g];
      pointers[0].push_back(reinterpret_cast<int64_t>(static_cast<const Bf16Bits*>(w.data()) + g * n * k));
      pointers[1].push_back(reinterpret_cast<int64_t>(static_cast<const Bf16Bits*>(x.data()) + row0 * k));
      pointers[2].push_back(reinterpret_cast<int64_t>(static_cast<Bf16Bits*>(c.data()) + row0 * n));
    }
    std::vector<int64_t> all;
    for (const auto& p : pointers) all.insert(all.end(), p.begin(), p.end());
    Tensor host({static_cast<int64_t>(all.size())}, DType::kI64);
    std::copy(all.begin(), all.end(), host.ptr<int64_t>());
    pointers_ = Tensor(host.shape(), DType::kI64, be.allocator());
    be.copy(pointers_, host);
  }
  ~CublasGrouped() { cublasDestroy(handle_); }
  CublasGrouped(const CublasGrouped&) = delete;
  CublasGrouped& operator=(const CublasGrouped&) = delete;

  cublasStatus_t run() const {
    const int problems = static_cast<int>(m_.size());
    auto* p = static_cast<void**>(pointers_.data());
    return cublasGemmGroupedBatchedEx(handle_, trans_w_.data(), trans_x_.data(), m_.data(), n_.data(), k_.data(),
                                      alpha_.data(), p, CUDA_R_16BF, ld_w_.data(), p + problems, CUDA_R_16BF,
                                      ld_x_.data(), beta_.data(), p + 2 * problems, CUDA_R_16BF, ld_c_.data(),
                                      problems, sizes_.data(), CUBLAS_COMPUTE_32F);
  }

 private:
  cublasHandle_t handle_ = nullptr;
  std::vector<cublasOperation_t> trans_w_, trans_x_;
  std::vector<int> m_, n_, k_, ld_w_, ld_x_, ld_c_, sizes_;
  std::vector<float> alpha_, beta_;
  Tensor pointers_;  // device: the w, x and c pointers of every problem, in three runs
};

// torch._grouped_mm on one H200 (uniform counts, the peer baseline of docs/PERF.md): forward and forward + input-grad ms.
struct TorchGroupedMs {
  double forward, both;
};

void bench_grouped_gemm(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t routed = 65536, experts = 256;
  struct Projection {
    const char* name;
    int64_t k, n;
    TorchGroupedMs uniform, skewed;
  };
  const Projection projections[] = {{"gate_up 2304->2048", 2304, 2048, {1.275, 2.757}, {1.131, 2.612}},
                                    {"down 1024->2304", 1024, 2304, {0.774, 1.717}, {0.704, 1.461}}};
  for (const Projection& proj : projections) {
    Tensor x = random_device(be, {routed, proj.k}, DType::kBF16, 30);
    Tensor dy = random_device(be, {routed, proj.n}, DType::kBF16, 31);
    Tensor w = expert_weight(be, experts, proj.n, proj.k, 32);
    Tensor y({routed, proj.n}, DType::kBF16, be.allocator());
    Tensor dx({routed, proj.k}, DType::kBF16, be.allocator());
    for (const char* counts_kind : {"uniform", "router", "skewed"}) {
      const std::vector<int32_t> offsets = offsets_of(expert_counts(counts_kind, routed, experts));
      Tensor group_offsets = int_device(be, offsets);
      auto grouped = [&](const Tensor& c, const Tensor& a, bool transpose_b) {
        kernels::GroupedGemmArgs args;
        args.c = c;
        args.a = a;
        args.b = w;
        args.group_offsets = group_offsets;  // the device copy only, as the kernel reads them
        args.transpose_b = transpose_b;
        be.grouped_gemm(args);
      };
      auto forward = [&] { grouped(y, x, true); };
      auto both = [&] {
        grouped(y, x, true);
        grouped(dx, dy, false);
      };
      const TorchGroupedMs torch = std::string(counts_kind) == "skewed" ? proj.skewed : proj.uniform;
      const char* torch_counts = std::string(counts_kind) == "skewed" ? "skewed" : "uniform";
      CublasGrouped cublas_forward(be, offsets, y, x, w, true), cublas_input_grad(be, offsets, dx, dy, w, false);
      const double flops = 2.0 * static_cast<double>(routed) * proj.n * proj.k;
      for (bool with_input_grad : {false, true}) {
        const double ms = median_ms(be, with_input_grad ? std::function<void()>(both) : forward, reps);
        const double torch_ms = with_input_grad ? torch.both : torch.forward;
        std::string versus = fmt::format("{:.2f}x torch._grouped_mm ({} counts {:.3f} ms; target >= 1.15)",
                                         torch_ms / ms, torch_counts, torch_ms);
        if (with_input_grad) {  // the input gradient alone, to tell its cost from the pair's
          versus += fmt::format("; igrad alone {:.3f} ms", median_ms(be, [&] { grouped(dx, dy, false); }, reps));
        }
        // Each tiling of the wgmma kernel forced (the row's time is that of the one chosen by shape).
        for (const auto tiling : {kernels::cuda_ops::GroupedGemmTiling::kRowsAsM,
                                  kernels::cuda_ops::GroupedGemmTiling::kRowsAsN}) {
          kernels::cuda_ops::set_grouped_gemm_tiling(tiling);
          const double tiled_ms = median_ms(be, with_input_grad ? std::function<void()>(both) : forward, reps);
          versus += fmt::format("; rows as {} {:.3f} ms",
                                tiling == kernels::cuda_ops::GroupedGemmTiling::kRowsAsM ? "M" : "N", tiled_ms);
        }
        kernels::cuda_ops::set_grouped_gemm_tiling(kernels::cuda_ops::GroupedGemmTiling::kAuto);
        const cublasStatus_t status = with_input_grad ? cublas_input_grad.run() : cublas_forward.run();
        if (status == CUBLAS_STATUS_SUCCESS) {
          const double cublas_ms = median_ms(be, [&] {
            CUBLAS_CHECK(cublas_forward.run());
            if (with_input_grad) CUBLAS_CHECK(cublas_input_grad.run());
          }, reps);
          versus += fmt::format("; {:.2f}x cuBLAS grouped ({:.3f} ms)", cublas_ms / ms, cublas_ms);
        } else {
          versus += fmt::format("; cuBLAS grouped: {}", cublasGetStatusString(status));
        }
        rows.push_back({fmt::format("grouped {} {} {}", proj.name, counts_kind, with_input_grad ? "fwd+igrad" : "fwd"),
                        ms, (with_input_grad ? 2 : 1) * flops / (ms * 1e9), 0, versus});
      }
    }
  }
}

// Attention: causal, 32 heads, BF16, against FlashAttention via PyTorch SDPA on one H200 (the peer
// baseline of docs/PERF.md: T 8192, D 128: 0.91 ms forward, 3.65 ms forward + backward). FLOPs: 2
// (qk + v) per head per visible (query, key) pair forward, 3.5x that forward + backward.
struct AttentionTimes {
  double fwd = 0, both = 0, flops = 0;  // flops: forward
};

AttentionTimes time_attention(Backend& be, int reps, const std::vector<int32_t>& cu_seqlens, int64_t qk_dim,
                              int64_t v_dim, bool with_backward) {
  const int64_t t = cu_seqlens.back(), heads = 32;
  Tensor q = random_device(be, {t, heads, qk_dim}, DType::kBF16, 6);
  Tensor k = random_device(be, {t, heads, qk_dim}, DType::kBF16, 7);
  Tensor v = random_device(be, {t, heads, v_dim}, DType::kBF16, 8);
  Tensor out({t, heads, v_dim}, DType::kBF16, be.allocator());
  Tensor lse({t, heads}, DType::kF32, be.allocator());
  Tensor dout = random_device(be, {t, heads, v_dim}, DType::kBF16, 9);
  Tensor dq({t, heads, qk_dim}, DType::kBF16, be.allocator()), dk({t, heads, qk_dim}, DType::kBF16, be.allocator()),
      dv({t, heads, v_dim}, DType::kBF16, be.allocator());
  Tensor cu = int_device(be, cu_seqlens);
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk_dim));
  auto forward = [&] { be.attention_forward({out, lse, q, k, v, cu, scale}); };
  auto backward = [&] { be.attention_backward({dq, dk, dv, dout, q, k, v, out, lse, cu, scale}); };
  AttentionTimes times;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    const double length = cu_seqlens[i + 1] - cu_seqlens[i];
    times.flops += 2.0 * (qk_dim + v_dim) * heads * length * (length + 1) / 2;
  }
  times.fwd = median_ms(be, forward, reps);
  if (with_backward) times.both = median_ms(be, [&] { forward(); backward(); }, reps);
  return times;
}

void bench_attention(Backend& be, int reps, std::vector<Row>& rows) {
  const int32_t t = 8192;
  const AttentionTimes d128 = time_attention(be, reps, {0, t}, 128, 128, true);
  rows.push_back({"attention fwd causal T8192 H32 D128", d128.fwd, d128.flops / (d128.fwd * 1e9), 0,
                  ratio(0.91, d128.fwd, "the speed of FlashAttention (0.91 ms; target >= 1)")});
  rows.push_back({"attention fwd+bwd", d128.both, 3.5 * d128.flops / (d128.both * 1e9), 0,
                  ratio(3.65, d128.both, "the speed of FlashAttention (3.65 ms; target >= 1)")});
  const AttentionTimes t32k = time_attention(be, reps, {0, 4 * t}, 128, 128, true);
  rows.push_back({"attention fwd+bwd causal T32768 H32 D128", t32k.both, 3.5 * t32k.flops / (t32k.both * 1e9), 0,
                  fmt::format("fwd {:.3f} ms; {}", t32k.fwd, ratio(55.5, t32k.both, "the target 55.5 ms (>= 1)"))});
  {
    // The mma.sync path these replace on Hopper (attention_sm80.cu), for comparison.
    setenv("MOETRAIN_ATTENTION", "mma", 1);
    const AttentionTimes mma = time_attention(be, reps, {0, t}, 128, 128, true);
    unsetenv("MOETRAIN_ATTENTION");
    rows.push_back({"attention fwd+bwd, mma.sync path (MOETRAIN_ATTENTION=mma)", mma.both,
                    3.5 * mma.flops / (mma.both * 1e9), 0,
                    fmt::format("fwd {:.3f} ms; the Hopper path is {:.2f}x faster fwd, {:.2f}x fwd+bwd", mma.fwd,
                                mma.fwd / d128.fwd, mma.both / d128.both)});
  }
  const AttentionTimes mla = time_attention(be, reps, {0, t}, 192, 128, true);
  rows.push_back({"attention fwd MLA dims qk 192 / v 128", mla.fwd, mla.flops / (mla.fwd * 1e9), 0, ""});
  rows.push_back({"attention fwd+bwd MLA dims", mla.both, 3.5 * mla.flops / (mla.both * 1e9), 0,
                  ratio(mla.both, d128.both, "the D128 time (target <= 1.3)")});
  const AttentionTimes d64 = time_attention(be, reps, {0, t}, 64, 64, true);
  rows.push_back({"attention fwd+bwd D64", d64.both, 3.5 * d64.flops / (d64.both * 1e9), 0,
                  fmt::format("fwd {:.3f} ms", d64.fwd)});
  // Packed documents: 8 x 1024 tokens in one call against one 1024-token document, 8 times.
  std::vector<int32_t> packed;
  for (int32_t i = 0; i <= 8; ++i) packed.push_back(i * 1024);
  const AttentionTimes docs = time_attention(be, reps, packed, 128, 128, true);
  const AttentionTimes one_doc = time_attention(be, reps, {0, 1024}, 128, 128, true);
  rows.push_back({"attention fwd+bwd D128, 8 packed documents of 1024", docs.both, 3.5 * docs.flops / (docs.both * 1e9),
                  0, ratio(docs.both, 8 * one_doc.both,
                           fmt::format("8 separate documents ({:.3f} ms; target <= 1); fwd {:.3f} ms vs {:.3f} ms",
                                       8 * one_doc.both, docs.fwd, 8 * one_doc.fwd).c_str())});
}

// KDA: B1, one segment, 32 heads of 128, BF16, against fla's chunk_kda on one H200 (the peer
// baseline of docs/PERF.md): fwd 1.44 / 4.29 ms and fwd+bwd 6.05 / 21.6 ms at T 8192 / 32768; T 131072
// forward has no baseline. Inputs as the layer makes them: q, k through l2norm, g through the
// gate, beta through sigmoid.
void bench_kda(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t heads = 32, dim = 128;
  struct Case {
    int64_t tokens;
    double fla_fwd_ms, fla_both_ms;  // 0: no baseline, and no backward timed
  };
  for (const Case c : {Case{8192, 1.44, 6.05}, Case{32768, 4.29, 21.6}, Case{131072, 0.0, 0.0}}) {
    const int64_t t = c.tokens;
    const Shape shape{t, heads, dim};
    auto unit_rows = [&](uint64_t seed) {
      Tensor raw = random_device(be, shape, DType::kBF16, seed);
      Tensor unit(shape, DType::kBF16, be.allocator()), inv({t * heads}, DType::kF32, be.allocator());
      be.l2norm_forward({unit, inv, raw, 1e-6});
      return unit;
    };
    Tensor q = unit_rows(30), k = unit_rows(31);
    Tensor v = random_device(be, shape, DType::kBF16, 32);
    Tensor g(shape, DType::kF32, be.allocator()), beta({t, heads}, DType::kF32, be.allocator());
    {
      Tensor f = random_device(be, {t, heads * dim}, DType::kBF16, 33);
      Tensor a_log = random_device(be, {heads}, DType::kF32, 34), dt_bias = random_device(be, {heads * dim}, DType::kF32, 35);
      be.kda_gate_forward({g, f, a_log, dt_bias, 0.0});
      Tensor b = random_device(be, {t, heads}, DType::kF32, 36);
      be.sigmoid_forward(beta, b);
    }
    Tensor cu = int_device(be, {0, static_cast<int32_t>(t)});
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    Tensor out(shape, DType::kBF16, be.allocator());
    auto forward = [&] { be.kda_forward({out, q, k, v, g, beta, cu, scale}); };
    const std::string name = fmt::format("kda fwd T{} H32 D128", t);
    double fwd = median_ms(be, forward, reps);
    rows.push_back({name, fwd, 0, 0,
                    c.fla_fwd_ms > 0 ? ratio(c.fla_fwd_ms, fwd, fmt::format("the speed of fla chunk_kda ({} ms)", c.fla_fwd_ms).c_str())
                                     : std::string("(no baseline)")});
    if (c.fla_both_ms <= 0) continue;
    Tensor dout = random_device(be, shape, DType::kBF16, 37);
    Tensor dq(shape, DType::kBF16, be.allocator()), dk(shape, DType::kBF16, be.allocator()),
        dv(shape, DType::kBF16, be.allocator()), dg(shape, DType::kF32, be.allocator()),
        dbeta({t, heads}, DType::kF32, be.allocator());
    auto backward = [&] { be.kda_backward({dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, cu, scale}); };
    double both = median_ms(be, [&] { forward(); backward(); }, reps);
    rows.push_back({fmt::format("kda fwd+bwd T{} H32 D128", t), both, 0, 0,
                    ratio(c.fla_both_ms, both, fmt::format("the speed of fla chunk_kda ({} ms; target >= 1)", c.fla_both_ms).c_str())});
  }
}

Tensor tiled_device(Backend& be, int64_t rows, int64_t d1, int64_t d2, int64_t block_rows, uint64_t seed) {
  Tensor block = random_device(be, {block_rows, d1, d2}, DType::kBF16, seed);
  Tensor out({rows, d1, d2}, DType::kBF16, be.allocator());
  for (int64_t r = 0; r < rows; r += block_rows) {
    const int64_t count = std::min(block_rows, rows - r);
    be.copy(out.view().slice_rows(r, r + count), block.view().slice_rows(0, count));
  }
  return out;
}

// DSA at DeepSeek-V3.2's shape: T 4096 (one document), 64 heads, q/k dim 576, v dim
// 512 (the latent), top-2048 as the lightning indexer (64 heads of 128) picks them from random
// inputs. Sparse attention forward and forward + backward against the small-op PyTorch baseline
// of docs/PERF.md (17.1 / 98.7 ms; target >= 5x each) and FlashMLA's published 640 TFLOP/s
// sparse forward (H800), the forward's SIMT kernel (MOETRAIN_SPARSE_ATTENTION=simt) beside it.
// TFLOP/s count the selected (query, key) pairs: 2 (576 + 512) per head and pair forward, 3x that
// forward + backward (GPU.md's baseline counts all 2048 slots of every query, -1s included).
// Then the indexer + top-k alone at T 4096, 32768, 131072: time, and the scratch one call takes
// (on a fresh scratch, so that all of it shows) beside its [T, 2048] int32 output.
// Big inputs repeat a random block of rows (drawing every value on the host takes seconds); the
// indexer's keys are all distinct, so its scores do not tie. One warm-up, few repetitions: a
// SIMT forward + backward or a T=131072 indexer call takes a good part of a second.
void bench_dsa(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t top_k = 2048, index_heads = 64, index_dim = 128;
  Tensor selection;  // T 4096's, for the sparse attention
  for (const int64_t t : {int64_t{4096}, int64_t{32768}, int64_t{131072}}) {
    Tensor q = tiled_device(be, t, index_heads, index_dim, 1024, 40);
    Tensor k = random_device(be, {t, index_dim}, DType::kBF16, 41);
    Tensor w = random_device(be, {t, index_heads}, DType::kF32, 42);
    Tensor cu = int_device(be, {0, static_cast<int32_t>(t)});
    Tensor index({t, top_k}, DType::kI32, be.allocator());
    const kernels::DsaIndexerArgs args{index, q, k, w, cu, top_k, 1.0 / std::sqrt(double(index_heads * index_dim))};
    be.synchronize();
    be.reset_peak_memory();
    const size_t before = be.stats().allocated_bytes;
    {
      kernels::cuda_ops::DeviceScratch scratch;
      kernels::cuda_ops::dsa_indexer_topk(args, scratch, static_cast<cudaStream_t>(be.stream()));
      be.synchronize();
    }
    const double scratch_mib = static_cast<double>(be.stats().peak_bytes - before) / 1048576.0;
    const double ms = median_ms(be, [&] { be.dsa_indexer_topk(args); }, t >= 131072 ? 1 : t >= 32768 ? 3 : reps, /*warmup=*/1);
    const double flops = 2.0 * index_heads * index_dim * static_cast<double>(t) * static_cast<double>(t + 1) / 2.0;
    rows.push_back({fmt::format("dsa indexer+top-2048 T{} (64 heads x 128)", t), ms, flops / (ms * 1e9), 0,
                    fmt::format("scratch {:.0f} MiB + index {:.0f} MiB{}", scratch_mib,
                                static_cast<double>(index.nbytes()) / 1048576.0,
                                t == 4096 ? "; " + ratio(2.9, ms, "the speed of the small ops (2.9 ms)") : "")});
    if (t == 4096) selection = std::move(index);
  }
  const int64_t tokens = 4096, heads = 64, qk = 576, v = 512;
  Tensor q = tiled_device(be, tokens, heads, qk, 256, 43);
  Tensor kv = random_device(be, {tokens, qk}, DType::kBF16, 44);
  Tensor dout = tiled_device(be, tokens, heads, v, 256, 45);
  Tensor out({tokens, heads, v}, DType::kBF16, be.allocator()), lse({tokens, heads}, DType::kF32, be.allocator());
  Tensor dq({tokens, heads, qk}, DType::kBF16, be.allocator()), dkv({tokens, qk}, DType::kBF16, be.allocator());
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  const kernels::SparseAttentionArgs fwd{out, lse, q, kv, selection, scale};
  const kernels::SparseAttentionBackwardArgs bwd{dq, dkv, dout, q, kv, out, lse, selection, scale};
  double pairs = 0;
  for (int64_t t = 0; t < tokens; ++t) pairs += static_cast<double>(std::min(t + 1, top_k));
  const double flops = 2.0 * heads * pairs * (qk + v);
  const double fwd_ms = median_ms(be, [&] { be.sparse_attention_forward(fwd); }, reps, /*warmup=*/1);
  const double both_ms = median_ms(be, [&] {
    be.sparse_attention_forward(fwd);
    be.sparse_attention_backward(bwd);
  }, 3, /*warmup=*/1);
  setenv("MOETRAIN_SPARSE_ATTENTION", "simt", 1);
  const double simt_ms = median_ms(be, [&] { be.sparse_attention_forward(fwd); }, 3, /*warmup=*/1);
  const double simt_both_ms = median_ms(be, [&] {
    be.sparse_attention_forward(fwd);
    be.sparse_attention_backward(bwd);
  }, 1, /*warmup=*/1);
  unsetenv("MOETRAIN_SPARSE_ATTENTION");
  const double tflops = flops / (fwd_ms * 1e9);
  rows.push_back({"dsa sparse attention fwd T4096 H64 576/512 top-2048", fwd_ms, tflops, 0,
                  fmt::format("{}; {:.2f}x FlashMLA's 640 TFLOP/s",
                              ratio(17.1, fwd_ms, "the speed of the small ops (17.1 ms; target >= 5)"), tflops / 640.0)});
  rows.push_back({"dsa sparse attention fwd+bwd", both_ms, 3 * flops / (both_ms * 1e9), 0,
                  ratio(98.7, both_ms, "the speed of the small ops (98.7 ms; target >= 5)")});
  rows.push_back({"dsa sparse attention fwd, SIMT kernel (MOETRAIN_SPARSE_ATTENTION=simt)", simt_ms,
                  flops / (simt_ms * 1e9), 0,
                  fmt::format("{}; the default path is {:.2f}x faster",
                              ratio(17.1, simt_ms, "the speed of the small ops"), simt_ms / fwd_ms)});
  rows.push_back({"dsa sparse attention fwd+bwd, SIMT kernels", simt_both_ms, 3 * flops / (simt_both_ms * 1e9), 0,
                  fmt::format("one run; the default path is {:.2f}x faster", simt_both_ms / both_ms)});
}

void bench_memory(Backend& be, int reps, std::vector<Row>& rows) {
  auto add = [&](const std::string& name, double bytes, const std::function<void()>& op) {
    double ms = median_ms(be, op, reps);
    double tbps = bytes / (ms * 1e9);
    rows.push_back({name, ms, 0, tbps, ratio(tbps, kMemoryCeilingTbps, "of 4.2 TB/s (target >= 0.70)")});
  };
  const int64_t copy_elems = int64_t{1} << 29;  // 1 GiB of bf16
  Tensor src = random_device(be, {copy_elems}, DType::kBF16, 10), dst({copy_elems}, DType::kBF16, be.allocator());
  add("copy 1 GiB (device to device)", 2.0 * src.nbytes(), [&] { be.copy(dst, src); });

  const int64_t n = 65536, d = 4096;  // 512 MiB of bf16 rows
  Tensor x = random_device(be, {n, d}, DType::kBF16, 11), y({n, d}, DType::kBF16, be.allocator());
  Tensor w = random_device(be, {d}, DType::kBF16, 12), rstd({n}, DType::kF32, be.allocator());
  Tensor dx({n, d}, DType::kBF16, be.allocator()), dw({d}, DType::kF32, be.allocator());
  // The norm and rope rows time kLaunches back-to-back launches per sample, as a step runs them
  // (each launch's start overlapping the previous one's tail). Bytes: what must move per launch
  // (rows read and written, rstd, rope's tables once per token; not the dweight partials), times
  // kLaunches.
  constexpr int kLaunches = 8;
  auto launches = [](const std::function<void()>& op) {
    return [op] {
      for (int i = 0; i < kLaunches; ++i) op();
    };
  };
  add("rmsnorm fwd [65536, 4096]", kLaunches * (2.0 * x.nbytes() + rstd.nbytes()),
      launches([&] { be.rmsnorm_forward({y, rstd, x, w, 1e-6}); }));
  add("rmsnorm bwd (dx only)", kLaunches * (3.0 * x.nbytes() + rstd.nbytes()),
      launches([&] { be.rmsnorm_backward({dx, {}, y, x, w, rstd, false}); }));
  add("rmsnorm bwd (dx +=, residual)", kLaunches * (4.0 * x.nbytes() + rstd.nbytes()),
      launches([&] { be.rmsnorm_backward({dx, {}, y, x, w, rstd, true}); }));
  add("rmsnorm bwd (dx and dweight)", kLaunches * (3.0 * x.nbytes() + rstd.nbytes()),
      launches([&] { be.rmsnorm_backward({dx, dw, y, x, w, rstd, false}); }));
  Tensor gate_up = random_device(be, {n, 2 * 2048}, DType::kBF16, 13), h({n, 2048}, DType::kBF16, be.allocator());
  add("swiglu fwd [65536, 2x2048]", 1.5 * gate_up.nbytes(), [&] { be.swiglu_forward(h, gate_up); });
  // RoPE over the rope part of MLA queries: [tokens*heads, 192] with 64 rotated columns. Each of
  // the kLaunches rotates its own copy of q, so that no launch finds another's rows in L2.
  const int64_t tokens = 16384, heads = 32;
  Tensor q_values = random_device(be, {tokens * heads, 192}, DType::kBF16, 14);
  Tensor q({kLaunches * tokens * heads, 192}, DType::kBF16, be.allocator());
  auto q_part = [&](int64_t i) { return q.view().slice_rows(i * tokens * heads, (i + 1) * tokens * heads); };
  for (int64_t i = 0; i < kLaunches; ++i) be.copy(q_part(i), q_values);
  std::vector<int32_t> positions(tokens);
  for (int64_t i = 0; i < tokens; ++i) positions[i] = static_cast<int32_t>(i);
  Tensor pos = int_device(be, positions);
  Tensor cos = random_device(be, {tokens, 32}, DType::kF32, 15), sin = random_device(be, {tokens, 32}, DType::kF32, 16);
  add("rope in place (64 of 192 columns, 16384 tok x 32 heads)",
      kLaunches * (2.0 * tokens * heads * 64 * 2 + cos.nbytes() + sin.nbytes() + pos.nbytes()), [&] {
        for (int64_t i = 0; i < kLaunches; ++i) be.rope({q_part(i), q_part(i), pos, cos, sin, heads, 128, 64});
      });
  // The same columns copied by the general column copy, no arithmetic, from each copy of q into
  // the next: the same bytes as the row above (128 of every 384 read and written): what any kernel
  // on this layout is compared with (docs/PERF.md has a copy written for this one layout).
  add("  copy_columns of those columns (no arithmetic)", kLaunches * 2.0 * tokens * heads * 64 * 2, [&] {
    for (int64_t i = 0; i < kLaunches; ++i) be.copy_columns({q_part((i + 1) % kLaunches), q_part(i), 128, 128, 64});
  });
  // RoPE over whole heads: each row of 192 read as 3 heads of 64, all rotated (a contiguous
  // stream, as a rope that covers the head).
  add("rope in place (whole heads of 64, 16384 tok x 96 heads)",
      kLaunches * (2.0 * tokens * heads * 192 * 2 + cos.nbytes() + sin.nbytes() + pos.nbytes()), [&] {
        for (int64_t i = 0; i < kLaunches; ++i) {
          const TensorView heads_of_64 = q_part(i).reshaped({tokens * heads * 3, 64});
          be.rope({heads_of_64, heads_of_64, pos, cos, sin, 3 * heads, 0, 64});
        }
      });
  // Permute: gather 8 copies of each of 16384 tokens of 4096 bf16.
  const int64_t top_k = 8;
  Tensor tok = random_device(be, {tokens, d}, DType::kBF16, 17), routed({tokens * top_k, d}, DType::kBF16, be.allocator());
  std::vector<int32_t> pairs(tokens * top_k);
  for (int64_t p = 0; p < tokens * top_k; ++p) pairs[p] = static_cast<int32_t>((p * 7919) % (tokens * top_k));
  Tensor sorted_pair = int_device(be, pairs);
  add("moe_permute (16384 tok x top-8, 4096)", 2.0 * routed.nbytes(), [&] { be.moe_permute(routed, tok, sorted_pair, top_k); });
  const int64_t params = int64_t{1} << 26;  // 64M fp32 adapter values
  Tensor p = random_device(be, {params}, DType::kF32, 18, 0.01), g = random_device(be, {params}, DType::kF32, 19, 0.001);
  Tensor m = random_device(be, {params}, DType::kF32, 20, 0.001), v = random_device(be, {params}, DType::kF32, 21, 1e-6);
  be.fill(v, 1e-6);  // a second moment is positive
  add("adamw (64M fp32 parameters)", 28.0 * params,
      [&] { be.adamw({p, g, m, v, 1e-4, 0.9, 0.999, 1e-8, 0.0, 10}); });
}

void print_rows(const std::vector<Row>& rows) {
  std::printf("\n%-58s %10s %10s %9s  %s\n", "benchmark", "ms", "TFLOP/s", "TB/s", "versus");
  for (const Row& r : rows) {
    std::printf("%-58s %10.3f %10s %9s  %s\n", r.name.c_str(), r.ms,
                r.tflops > 0 ? fmt::format("{:.1f}", r.tflops).c_str() : "-",
                r.tbps > 0 ? fmt::format("{:.2f}", r.tbps).c_str() : "-", r.versus.c_str());
  }
}

// Where one step's time goes, op by op: one extra step after the timed ones, each op (and each
// allocation between ops) timed with a synchronize after it, so the timed steps stay unprofiled.
void print_op_times(kernels::TimingBackend& timing, Model& model, SyntheticData& data, double median_seconds) {
  Batch batch = data.next();
  timing.reset();
  timing.enable();
  auto start = std::chrono::steady_clock::now();
  model.forward_backward(batch, 1.0 / std::max<int64_t>(1, batch.num_targets()));
  timing.synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  timing.disable();
  std::printf("\nop times of one more step (a synchronize after every op: %.1f ms in all, against the median "
              "%.1f ms unsynchronized):\n%s",
              seconds * 1e3, median_seconds * 1e3, kernels::format_op_times(timing.times(), 1, seconds).c_str());
}

struct StepBenchOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // --set key.path=value
  int steps = 5;                       // timed, after 2 warm-up steps
  bool op_times = false;               // then one more step, timed op by op
};

int bench_step(Runtime& runtime, const StepBenchOptions& bench) {
  const int steps = bench.steps;
  Config config = load_config(bench.config_path, bench.overrides);
  validate_for_world(config, 1);
  ModelSpec spec = resolve_model_spec(config);
  auto cuda_backend = kernels::make_cuda_backend();
  // Declared before the model, which allocates through it: it must outlive the model's tensors.
  kernels::TimingBackend timing(*cuda_backend);
  timing.disable();
  Backend* backend = bench.op_times ? static_cast<Backend*>(&timing) : cuda_backend.get();
  ModelOptions options = model_options_for(config);
  options.dtype = DType::kBF16;
  auto build_start = std::chrono::steady_clock::now();
  Model model(spec, *backend, options);
  model.init_random_weights();
  backend->synchronize();
  log::info(fmt::format("model built and initialised in {:.1f} s", std::chrono::duration<double>(
                                                                       std::chrono::steady_clock::now() - build_start)
                                                                       .count()));
  SyntheticData data(config.data, spec.config.vocab_size, 0, 1);
  Batch last_batch;
  std::vector<double> times;
  double loss = 0;
  kernels::BackendStats before;  // at the first timed step: what the timed steps cost is the difference
  int64_t bench_waits = 0;       // the timing's own synchronize, one per timed step
  for (int s = 0; s < steps + 2; ++s) {
    Batch batch = data.next();
    if (s == 2) before = backend->stats();
    auto start = std::chrono::steady_clock::now();
    // As the trainer runs a micro-batch: the adapters held (packed once per optimizer step; here
    // every step is one), the result read after the work is queued.
    model.hold_parameters(true);
    PendingStep pending = model.forward_backward_async(batch, 1.0 / std::max<int64_t>(1, batch.num_targets()));
    model.hold_parameters(false);
    backend->synchronize();
    if (s >= 2) {
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      ++bench_waits;
    }
    const StepResult& r = pending.get();  // done by now: no wait
    loss = r.loss_sum / std::max<int64_t>(1, r.targets);
    last_batch = std::move(batch);
  }
  std::sort(times.begin(), times.end());
  const double seconds = times[times.size() / 2];
  const int64_t tokens = config.data.micro_batch * config.data.seq_len;
  // Model FLOPs as docs/PERF.md defines them (core/plan/model_flops.h), as the trainer's `mfu`.
  const double flops = ModelFlops(spec, config.lora).step(last_batch.num_tokens(), last_batch.cu_seqlens).total();
  const int64_t rerun = config.parallel.recompute_layers;
  const std::string recompute = !config.parallel.recompute ? "off"
                                : rerun < 0 || rerun >= spec.config.num_layers
                                    ? "on"
                                    : fmt::format("on, first {} of {} layers", rerun, spec.config.num_layers);
  std::printf("\nstep: %lld layers, hidden %lld, %lld experts top-%lld, %lld tokens (seq %lld), recompute %s\n",
              static_cast<long long>(spec.config.num_layers), static_cast<long long>(spec.config.hidden_size),
              static_cast<long long>(spec.config.moe.num_experts), static_cast<long long>(spec.config.moe.top_k),
              static_cast<long long>(tokens), static_cast<long long>(config.data.seq_len), recompute.c_str());
  std::printf("step: median %.1f ms, %.0f tokens/s, %.1f model TFLOP/s, MFU %.1f%% of %.0f (%.1f%% of the measured "
              "771), last loss %.4f\n",
              seconds * 1e3, tokens / seconds, flops / seconds / 1e12, 100.0 * flops / seconds / 1e12 / kDatasheetBf16Tflops,
              kDatasheetBf16Tflops, 100.0 * flops / seconds / 1e12 / kMatrixCeilingTflops, loss);
  const kernels::BackendStats after = backend->stats();
  const char* allocator = std::getenv("MOETRAIN_CUDA_ALLOCATOR");
  // Host waits inside the step: every wait of the timed steps but the timing's own synchronize
  // after each (counted apart); the step's result is read after that, when it is done. Any wait
  // left stops the host from running ahead of the device.
  // The bench builds no optimizer: a training run on one rank also holds AdamW's two moments per
  // adapter parameter (core/train/optimizer.h), which `moetrain plan` counts.
  int64_t adapter_parameters = 0;
  for (const Parameter* p : model.parameters()) adapter_parameters += p->value.numel();
  std::printf("memory: peak %.2f GB in tensors (training adds %.2f GB of Adam moments); per timed step: %.1f "
              "cudaMalloc calls, %.1f host waits inside the step (+ 1 the timing's synchronize) "
              "(MOETRAIN_CUDA_ALLOCATOR=%s)\n",
              static_cast<double>(after.peak_bytes) / 1e9, 2.0 * 4 * static_cast<double>(adapter_parameters) / 1e9,
              static_cast<double>(after.device_allocations - before.device_allocations) / static_cast<double>(steps),
              static_cast<double>(after.host_waits - before.host_waits - bench_waits) / static_cast<double>(steps),
              allocator ? allocator : "caching");
  if (bench.op_times) print_op_times(timing, model, data, seconds);
  (void)runtime;
  return 0;
}

// Expert-parallel token exchange across the job's GPUs (run under mpirun, one rank per GPU):
// ExpertDispatch's dispatch (to_experts) + combine (from_experts) of `mib` MiB of bf16 rows per
// rank and direction, routed evenly over every rank's experts, against NCCL's own all-to-all of
// the same bytes timed in the same run. Bandwidth as nccl-tests' bus bandwidth: bytes per rank
// x (ranks - 1) / ranks / time, per direction.
int bench_ep(Runtime& runtime, int mib, int reps) {
  MOETRAIN_CHECK(runtime.world() >= 2, ExitCode::kBadConfig,
                 "moetrain-bench ep needs 2 or more ranks, one per GPU: mpirun -np 2 moetrain-bench ep");
  auto backend = kernels::make_cuda_backend();
  NcclCommunicator ep(MPI_COMM_WORLD);
  const int ranks = ep.size();
  constexpr int64_t kHidden = 7168;  // Kimi K3 / DeepSeek-V3's hidden size: 14 KiB bf16 rows
  constexpr int64_t kExpertsPerRank = 8;
  const int64_t rows = (int64_t{mib} << 20) / (kHidden * 2) / (ranks * kExpertsPerRank) * (ranks * kExpertsPerRank);
  const int64_t experts = kExpertsPerRank * ranks;
  // Every expert gets the same share of this rank's rows (sorted by expert, as MoeFfn sends them).
  std::vector<int32_t> offsets(static_cast<size_t>(experts + 1));
  for (int64_t e = 0; e <= experts; ++e) offsets[e] = static_cast<int32_t>(rows / experts * e);

  BatchTensors no_batch;
  LayerContext ctx{*backend, DType::kBF16, no_batch};
  ExpertDispatch dispatch(ep, experts, kExpertsPerRank);
  Tensor local_offsets = dispatch.plan(ctx, offsets.data());
  Tensor routed({rows, kHidden}, DType::kBF16, backend->allocator());
  Tensor back({rows, kHidden}, DType::kBF16, backend->allocator());
  Tensor local({dispatch.local_rows(), kHidden}, DType::kBF16, backend->allocator());
  backend->fill(routed, 0.5);
  Tensor received({rows, kHidden}, DType::kBF16, backend->allocator());

  const double bytes = static_cast<double>(rows * kHidden * 2);
  const double bus_bytes = bytes * (ranks - 1) / ranks;
  const double nccl_ms = median_ms(*backend, [&] {
    ep.all_to_all(static_cast<Bf16Bits*>(received.data()), static_cast<const Bf16Bits*>(routed.data()),
                  rows * kHidden / ranks);
    ep.synchronize();
  }, reps);
  const double dispatch_ms = median_ms(*backend, [&] { dispatch.to_experts(ctx, local, routed); }, reps);
  const double combine_ms = median_ms(*backend, [&] { dispatch.from_experts(ctx, back, local); }, reps);
  const double nccl_busbw = bus_bytes / (nccl_ms * 1e-3) / 1e9;
  const double ours_busbw = 2 * bus_bytes / ((dispatch_ms + combine_ms) * 1e-3) / 1e9;
  if (runtime.is_root()) {
    std::printf("\nep: %d ranks, %.0f MiB per rank and direction (%lld rows x %lld bf16), %lld experts per rank\n",
                ranks, bytes / (1 << 20), static_cast<long long>(rows), static_cast<long long>(kHidden),
                static_cast<long long>(kExpertsPerRank));
    std::printf("ep: NCCL all-to-all %.3f ms, %.1f GB/s bus bandwidth (GPU.md: 243 GB/s at 256 MiB on 2 x H200)\n",
                nccl_ms, nccl_busbw);
    std::printf("ep: dispatch %.3f ms + combine %.3f ms, %.1f GB/s bus bandwidth per direction: %.2fx NCCL's "
                "(target >= 0.80)\n",
                dispatch_ms, combine_ms, ours_busbw, ours_busbw / nccl_busbw);
  }
  (void)local_offsets;
  return 0;
}

int run(Runtime& runtime, int argc, char** argv) {
  cxxopts::Options options("moetrain-bench", "time the CUDA backend against the H200 ceilings");
  options.add_options()("mode", "ops | step | ep", cxxopts::value<std::string>()->default_value("ops"))(
      "mib", "MiB per rank and direction for `ep`", cxxopts::value<int>()->default_value("256"))(
      "config", "model config for `step`", cxxopts::value<std::string>())(
      "set", "config override key.path=value", cxxopts::value<std::vector<std::string>>())(
      "steps", "timed steps", cxxopts::value<int>()->default_value("5"))(
      "reps", "timed repetitions per op", cxxopts::value<int>()->default_value("10"))(
      "heat-up-ms", "`ops`: run each op this long before timing it (the GPU settles at its power-capped clock)",
      cxxopts::value<double>()->default_value("500"))(
      "only", "`ops`: these groups only (comma-separated: gemm, experts, grouped, attention, kda, dsa, memory)",
      cxxopts::value<std::string>()->default_value(""))(
      "op-times", "`step`: after the timed steps, time one more step op by op")("h,help", "print this usage");
  options.parse_positional({"mode"});
  options.positional_help("ops | step | ep");
  cxxopts::ParseResult result;
  try {
    result = options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    if (runtime.is_root()) std::fprintf(stderr, "%s\n", options.help().c_str());
    throw Error(ExitCode::kBadConfig, std::string("command line: ") + e.what() + " (see the usage above)");
  }
  if (result.count("help")) {
    if (runtime.is_root()) std::printf("%s\n", options.help().c_str());
    return 0;
  }
  MOETRAIN_CHECK(cuda::device_count() > 0, ExitCode::kBadConfig, "moetrain-bench needs a CUDA device");
  const std::string mode = result["mode"].as<std::string>();
  if (mode == "step") {
    MOETRAIN_CHECK(result.count("config"), ExitCode::kBadConfig, "moetrain-bench step needs --config FILE");
    StepBenchOptions bench;
    bench.config_path = result["config"].as<std::string>();
    if (result.count("set")) bench.overrides = result["set"].as<std::vector<std::string>>();
    bench.steps = result["steps"].as<int>();
    MOETRAIN_CHECK(bench.steps >= 1, ExitCode::kBadConfig, "moetrain-bench step needs --steps 1 or more");
    bench.op_times = result.count("op-times") > 0;
    return bench_step(runtime, bench);
  }
  if (mode == "ep") return bench_ep(runtime, result["mib"].as<int>(), result["reps"].as<int>());
  MOETRAIN_CHECK(mode == "ops", ExitCode::kBadConfig, "unknown mode " + mode + " (ops | step | ep)");
  auto backend = kernels::make_cuda_backend();
  const int reps = result["reps"].as<int>();
  heat_up_ms = result["heat-up-ms"].as<double>();
  MOETRAIN_CHECK(heat_up_ms >= 0, ExitCode::kBadConfig, "moetrain-bench: --heat-up-ms must be 0 or more");
  std::vector<Row> rows;
  const std::string only = result["only"].as<std::string>();
  auto wanted = [&only](const char* group) { return only.empty() || only.find(group) != std::string::npos; };
  if (wanted("gemm")) bench_gemm(*backend, reps, rows);
  if (wanted("experts")) bench_experts(*backend, reps, rows);
  if (wanted("grouped")) bench_grouped_gemm(*backend, reps, rows);
  if (wanted("attention")) bench_attention(*backend, reps, rows);
  if (wanted("kda")) bench_kda(*backend, reps, rows);
  if (wanted("dsa")) bench_dsa(*backend, reps, rows);
  if (wanted("memory")) bench_memory(*backend, reps, rows);
  print_rows(rows);
  return 0;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run); }
