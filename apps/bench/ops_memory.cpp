// `ops`, the memory-bound rows against the 4.2 TB/s ceiling: copy, RMSNorm, SwiGLU, RoPE, the
// MoE permute, AdamW.
#include <functional>
#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"

namespace moetrain::bench {

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

}  // namespace moetrain::bench
