// `ops`, the matrix rows: the dense GEMM, the MoE expert block, the grouped GEMM against
// torch._grouped_mm and cuBLAS's grouped GEMM.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/gemm/grouped_gemm.h"
#include "parallel/comm.h"

namespace moetrain::bench {

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

namespace {

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

}  // namespace

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

}  // namespace moetrain::bench
