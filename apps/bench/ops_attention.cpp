// `ops`, the attention rows: dense attention (FlashAttention's shapes), KDA (fla's), DSA's
// indexer and sparse attention (DeepSeek-V3.2's).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/bench/bench.h"
#include "apps/bench/common.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/dsa/dsa_indexer.h"

namespace moetrain::bench {

namespace {

// Attention: causal, 32 heads, BF16, against FlashAttention via PyTorch SDPA on one H200 (the peer
// baseline of docs/PERF.md: T 8192, D 128: 0.91 ms forward, 3.65 ms forward + backward). FLOPs: 2
// (qk + v) per head per visible (query, key) pair forward, 3.5x that forward + backward.
struct AttentionTimes {
  double fwd = 0, both = 0, flops = 0;  // flops: forward
};

AttentionTimes time_attention(Backend& be, int reps, const std::vector<int32_t>& cu_seqlens, int64_t qk_dim,
                              int64_t v_dim, bool with_backward, int64_t heads = 32) {
  const int64_t t = cu_seqlens.back();
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

}  // namespace

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
  // Long context against SDPA (scripts/bench_torch_attention.py --long times it on these shapes;
  // targets in docs/PERF.md), and Kimi K3's NoPE MLA dims with its 96 heads.
  const int long_reps = std::max(2, reps / 8);
  const AttentionTimes t128k = time_attention(be, long_reps, {0, 16 * t}, 128, 128, true);
  rows.push_back({"attention fwd causal T131072 H32 D128", t128k.fwd, t128k.flops / (t128k.fwd * 1e9), 0, ""});
  rows.push_back({"attention fwd+bwd causal T131072 H32 D128", t128k.both, 3.5 * t128k.flops / (t128k.both * 1e9), 0,
                  ""});
  const AttentionTimes k3 = time_attention(be, long_reps, {0, 4 * t}, 192, 128, true, 96);
  rows.push_back({"attention fwd causal T32768 H96 qk 192 / v 128 (K3 MLA)", k3.fwd, k3.flops / (k3.fwd * 1e9), 0,
                  ""});
  rows.push_back({"attention fwd+bwd, same", k3.both, 3.5 * k3.flops / (k3.both * 1e9), 0, ""});
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

namespace {

// KDA at a million tokens: T 1,048,576 in one segment, Kimi K3's 96 heads of 128. The 96-head
// tensors alone (q, k, v, dout, out and the gradients in BF16, g and dg in F32) take 300 GB, past
// one H200, so the row runs the heads as 6 calls of 16, each over the whole sequence, and times the
// six in a row (heads are independent and the kernels' grids are per head: six calls of 16 heads
// do the work of one of 96).
// Peak: the tensor memory of one call (its inputs, outputs and the kernels' scratch: chunk-local
// intermediates per token and the state entering each 64-token chunk). Inputs repeat a random
// block of 1,024 tokens (drawing 2e9 values on the host would take minutes).
void bench_kda_million(Backend& be, std::vector<Row>& rows) {
  const int64_t t = 1048576, heads = 16, groups = 6, dim = 128;
  const Shape shape{t, heads, dim};
  const std::string name = fmt::format("kda fwd+bwd T{} H96 D128 (6 x 16 heads)", t);
  if (be.stats().device_total_bytes < size_t{135} * 1000000000) {
    rows.push_back({name, 0, 0, 0, "(skipped: one 16-head call needs about 125 GB)"});
    return;
  }
  auto unit_rows = [&](uint64_t seed) {
    Tensor raw = tiled_device(be, t, heads, dim, 1024, seed);
    Tensor inv({t * heads}, DType::kF32, be.allocator());
    be.l2norm_forward({raw, inv, raw, 1e-6});
    return raw;
  };
  Tensor q = unit_rows(50), k = unit_rows(51), v = tiled_device(be, t, heads, dim, 1024, 52);
  Tensor g(shape, DType::kF32, be.allocator()), beta({t, heads}, DType::kF32, be.allocator());
  {
    Tensor f = tiled_device(be, t, heads, dim, 1024, 53);
    Tensor a_log = random_device(be, {heads}, DType::kF32, 54), dt_bias = random_device(be, {heads * dim}, DType::kF32, 55);
    be.kda_gate_forward({g, f.view().reshaped({t, heads * dim}), a_log, dt_bias, 0.0});
    Tensor b = random_device(be, {t, heads}, DType::kF32, 56);
    be.sigmoid_forward(beta, b);
  }
  Tensor cu = int_device(be, {0, static_cast<int32_t>(t)});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  Tensor out(shape, DType::kBF16, be.allocator()), dout = tiled_device(be, t, heads, dim, 1024, 57);
  Tensor dq(shape, DType::kBF16, be.allocator()), dk(shape, DType::kBF16, be.allocator()),
      dv(shape, DType::kBF16, be.allocator()), dg(shape, DType::kF32, be.allocator()),
      dbeta({t, heads}, DType::kF32, be.allocator());
  auto forward = [&] { be.kda_forward({out, q, k, v, g, beta, cu, scale}); };
  auto backward = [&] { be.kda_backward({dq, dk, dv, dg, dbeta, dout, q, k, v, g, beta, cu, scale}); };
  be.synchronize();
  be.reset_peak_memory();
  const double before_gb = static_cast<double>(be.stats().allocated_bytes) / 1e9;
  forward();
  backward();
  be.synchronize();
  const double peak_gb = static_cast<double>(be.stats().peak_bytes) / 1e9;
  const double fwd = median_ms(be, [&] { for (int64_t i = 0; i < groups; ++i) forward(); }, 1, /*warmup=*/1);
  rows.push_back({fmt::format("kda fwd T{} H96 D128 (6 x 16 heads)", t), fwd, 0, 0, "(no baseline)"});
  const double both = median_ms(be, [&] {
    for (int64_t i = 0; i < groups; ++i) {
      forward();
      backward();
    }
  }, 1, /*warmup=*/1);
  rows.push_back({name, both, 0, 0,
                  fmt::format("peak {:.1f} GB in tensors per 16-head call ({:.1f} GB inputs and outputs, {:.1f} GB "
                              "scratch)",
                              peak_gb, before_gb, peak_gb - before_gb)});
}

}  // namespace

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
  bench_kda_million(be, rows);
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

}  // namespace moetrain::bench
