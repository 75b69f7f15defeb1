// `ops`, the fp8 rows: the GEMMs on FP8 block-scaled weights (ops.h gemm_fp8, grouped_gemm with an
// F32 b_scale; model.weight_format: fp8) against the same GEMMs on BF16 weights, at DeepSeek-V3's
// shapes (hidden 7168): q_b_proj 1536 -> 24576, kv_b_proj 512 -> 32768, o_proj 16384 -> 7168, and
// 32 local routed experts of 7168 x 2048 (256 experts over 8 ranks). Each row's ratio is the FP8
// speed over the BF16 speed (the target is in docs/PERF.md). Correctness is tests/cuda/test_cuda_gemm_fp8.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "kernels/cuda/gemm/gemm.h"
#include "kernels/fp8_format.h"

namespace moetrain::bench {
namespace {

using kernels::fp8_blocks;

// An FP8 weight [groups, rows, cols] on the device: random E4M3 codes (no NaN) and scales near 2^-8.
struct Fp8DeviceWeight {
  Tensor codes, scales;
};

Fp8DeviceWeight fp8_device(Backend& be, int64_t groups, int64_t rows, int64_t cols, uint64_t seed) {
  Tensor codes_host({groups, rows, cols}, DType::kU8);
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  auto* codes = static_cast<uint8_t*>(codes_host.data());
  for (int64_t i = 0; i < codes_host.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto code = static_cast<uint8_t>(state >> 56);
    codes[i] = (code & 0x7F) == 0x7F ? 0x7E : code;
  }
  Tensor scales_host({groups, fp8_blocks(rows), fp8_blocks(cols)}, DType::kF32);
  for (int64_t i = 0; i < scales_host.numel(); ++i) scales_host.ptr<float>()[i] = (1 + i % 7) * 0x1p-9f;
  Fp8DeviceWeight w{Tensor(codes_host.shape(), DType::kU8, be.allocator()),
                    Tensor(scales_host.shape(), DType::kF32, be.allocator())};
  be.copy(w.codes, codes_host);
  be.copy(w.scales, scales_host);
  return w;
}

TensorView matrix(const Tensor& t) { return t.view().reshaped({t.size(1), t.size(2)}); }

// The FP8 row's note names the kernel that ran: the mainloop decode, or the decode to scratch.
void row_pair(std::vector<Row>& rows, const std::string& name, double flops, double bf16_ms, double fp8_ms,
              kernels::cuda_ops::Fp8GemmPath path) {
  rows.push_back({name + " bf16", bf16_ms, flops / (bf16_ms * 1e9), 0, ""});
  const char* kernel = path == kernels::cuda_ops::Fp8GemmPath::kMainloop ? "mainloop decode" : "decode to scratch";
  rows.push_back({name + " fp8 weight", fp8_ms, flops / (fp8_ms * 1e9), 0,
                  fmt::format("{}; {}", ratio(bf16_ms, fp8_ms, "the bf16 speed (target >= 0.95)"), kernel)});
}

// x W^T and dy W for a frozen W [out, in] at `tokens` rows.
void bench_dense(Backend& be, int reps, std::vector<Row>& rows, const char* name, int64_t in, int64_t out,
                 int64_t tokens, uint64_t seed) {
  const Fp8DeviceWeight fp8 = fp8_device(be, 1, out, in, seed);
  const Tensor bf16 = random_device(be, {out, in}, DType::kBF16, seed + 1, 0.02);
  const Tensor x = random_device(be, {tokens, in}, DType::kBF16, seed + 2);
  const Tensor dy = random_device(be, {tokens, out}, DType::kBF16, seed + 3);
  Tensor y({tokens, out}, DType::kBF16, be.allocator());
  Tensor dx({tokens, in}, DType::kBF16, be.allocator());
  const double flops = 2.0 * tokens * in * out;
  for (bool forward : {true, false}) {
    const kernels::GemmArgs args = forward ? kernels::GemmArgs{y, x, bf16, false, true, 1.0, 0.0}
                                           : kernels::GemmArgs{dx, dy, bf16, false, false, 1.0, 0.0};
    kernels::GemmArgs fp8_args = args;
    fp8_args.b = matrix(fp8.codes);
    const double bf16_ms = median_ms(be, [&] { be.gemm(args); }, reps);
    const kernels::GemmFp8Args fp8_call{fp8_args, matrix(fp8.scales)};
    const double fp8_ms = median_ms(be, [&] { be.gemm_fp8(fp8_call); }, reps);
    row_pair(rows, fmt::format("{} {} -> {} {} ({} rows)", name, in, out, forward ? "x.W^T" : "dy.W", tokens), flops,
             bf16_ms, fp8_ms, kernels::cuda_ops::fp8_gemm_path(fp8_call));
  }
}

// The routed experts' gate_up [E, 2F, D] and down [E, D, F], forward (x W^T) and input gradient.
void bench_fp8_experts(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t experts = 32, d = 7168, f = 2048, rows_total = 65536;
  std::vector<int32_t> offsets;
  for (int64_t e = 0; e <= experts; ++e) offsets.push_back(static_cast<int32_t>(e * rows_total / experts));
  const Tensor group_offsets = int_device(be, offsets);
  struct Projection {
    const char* name;
    int64_t out, in;
  };
  for (const Projection& p : {Projection{"gate_up", 2 * f, d}, Projection{"down", d, f}}) {
    const Fp8DeviceWeight fp8 = fp8_device(be, experts, p.out, p.in, 40 + p.out);
    const Tensor bf16 = random_device(be, {experts, p.out, p.in}, DType::kBF16, 50 + p.out, 0.02);
    for (bool forward : {true, false}) {
      const int64_t k = forward ? p.in : p.out, n = forward ? p.out : p.in;
      const Tensor a = random_device(be, {rows_total, k}, DType::kBF16, 60 + k);
      Tensor c({rows_total, n}, DType::kBF16, be.allocator());
      kernels::GroupedGemmArgs args;
      args.c = c;
      args.a = a;
      args.b = bf16;
      args.group_offsets = group_offsets;
      args.host_group_offsets = offsets.data();
      args.transpose_b = forward;
      kernels::GroupedGemmArgs fp8_args = args;
      fp8_args.b = fp8.codes;
      fp8_args.b_scale = fp8.scales;
      const double bf16_ms = median_ms(be, [&] { be.grouped_gemm(args); }, reps);
      const double fp8_ms = median_ms(be, [&] { be.grouped_gemm(fp8_args); }, reps);
      row_pair(rows, fmt::format("experts {} {} x {} {} ({} rows, {} experts)", p.name, p.out, p.in,
                                 forward ? "x.W^T" : "dy.W", rows_total, experts),
               2.0 * rows_total * p.in * p.out, bf16_ms, fp8_ms, kernels::cuda_ops::fp8_gemm_path(fp8_args));
    }
  }
}

}  // namespace

void bench_fp8(Backend& be, int reps, std::vector<Row>& rows) {
  const int64_t tokens = 8192;
  bench_dense(be, reps, rows, "q_b_proj", 1536, 24576, tokens, 10);
  bench_dense(be, reps, rows, "kv_b_proj", 512, 32768, tokens, 20);
  bench_dense(be, reps, rows, "o_proj", 16384, 7168, tokens, 30);
  bench_fp8_experts(be, reps, rows);
}

}  // namespace moetrain::bench
