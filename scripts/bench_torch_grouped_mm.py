#!/usr/bin/env python3
"""Times torch._grouped_mm on the shapes of `moetrain-bench ops --only grouped,experts`, for the
grouped-GEMM comparison of issue 10 (run both in the same session on the GPU machine).

Grouped GEMM: 65,536 routed rows (8192 tokens x top-8) over 256 experts, gate_up 2304 -> 2048 and
down 1024 -> 2304, forward (x W^T) and forward + input-grad (+ dy W), with the same per-expert
counts as the C++ benchmark (uniform, router-like, skewed: the generators below are the same).
Expert block of issue 4: 131,072 rows over 64 experts, hidden 2304, width 1024: gate_up, SwiGLU,
down; forward and forward + input-grad (autograd, weights frozen).

Median of CUDA-event timings after warm-up and a heat-up of HEAT_UP_MS (as moetrain-bench: the
GPU settles at its power-capped clock first); inputs random (never zeros).

    python3 scripts/bench_torch_grouped_mm.py [--reps 20]
"""
import argparse
import time

import torch

MASK64 = (1 << 64) - 1


def expert_counts(kind, rows, experts):
    """Per-expert row counts, exactly as expert_counts() in apps/bench/ops_matrix.cpp."""
    if kind == "uniform":
        return [rows // experts] * experts
    counts = [0] * experts
    if kind == "router":
        top_k = 8
        x = 1
        for _ in range(rows // top_k):
            chosen = []
            while len(chosen) < top_k:
                x ^= (x << 13) & MASK64
                x ^= x >> 7
                x ^= (x << 17) & MASK64
                e = x % experts
                if e not in chosen:
                    chosen.append(e)
            for e in chosen:
                counts[e] += 1
        return counts
    hot = experts // 32
    hot_rows = 7 * rows // experts
    cold = experts - hot
    cold_rows = rows - hot * hot_rows
    c = 0
    for e in range(experts):
        if e % 32 == 0:
            counts[e] = hot_rows
        else:
            counts[e] = cold_rows // cold + (1 if c < cold_rows % cold else 0)
            c += 1
    return counts


HEAT_UP_MS = 500  # moetrain-bench's --heat-up-ms default


def median_ms(fn, reps, warmup=3):
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    while (time.perf_counter() - start) * 1e3 < HEAT_UP_MS:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def random_bf16(shape, scale=1.0):
    """Uniform magnitudes in [0.1, 1] with random signs, like the C++ benchmark's inputs."""
    u = torch.rand(shape, device="cuda") * 0.9 + 0.1
    sign = torch.where(torch.rand(shape, device="cuda") < 0.5, -1.0, 1.0)
    return (u * sign * scale).to(torch.bfloat16)


def bench_projections(reps):
    rows, experts = 65536, 256
    print(f"\ntorch._grouped_mm, {rows} routed rows over {experts} experts (torch {torch.__version__})")
    print(f"{'benchmark':<48} {'ms':>8} {'TFLOP/s':>8}")
    for name, k, n in (("gate_up 2304->2048", 2304, 2048), ("down 1024->2304", 1024, 2304)):
        x = random_bf16((rows, k))
        dy = random_bf16((rows, n))
        w = random_bf16((experts, n, k), 0.02)  # [G, out, in], as the experts store it
        for kind in ("uniform", "router", "skewed"):
            counts = expert_counts(kind, rows, experts)
            assert sum(counts) == rows
            offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)

            def forward():
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

            def both():
                forward()
                return torch._grouped_mm(dy, w, offs=offs)

            flops = 2.0 * rows * n * k
            for label, fn, f in (("fwd", forward, flops), ("fwd+igrad", both, 2 * flops)):
                ms = median_ms(fn, reps)
                line = f"{'grouped ' + name + ' ' + kind + ' ' + label:<48} {ms:8.3f} {f / ms / 1e9:8.1f}"
                if label == "fwd":
                    line += f"   (counts min {min(counts)}, max {max(counts)})"
                print(line)
        del x, dy, w
        torch.cuda.empty_cache()


def bench_expert_block(reps):
    rows, experts, d, f = 131072, 64, 2304, 1024
    x = random_bf16((rows, d)).requires_grad_(True)
    w_gate_up = random_bf16((experts, 2 * f, d), 0.02)
    w_down = random_bf16((experts, d, f), 0.03)
    dout = random_bf16((rows, d))
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)

    def forward():
        gate_up = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        return torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs)

    def both():
        out = forward()
        torch.autograd.grad(out, x, dout)

    flops = 6.0 * rows * d * f
    print(f"\nexpert block of issue 4: {rows} rows, {experts} experts, hidden {d}, width {f}")
    with torch.no_grad():
        ms = median_ms(forward, reps)
    print(f"{'experts fwd':<48} {ms:8.3f} {flops / ms / 1e9:8.1f}")
    ms = median_ms(both, reps)
    print(f"{'experts fwd + input-grad':<48} {ms:8.3f} {2 * flops / ms / 1e9:8.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(f"device: {torch.cuda.get_device_name()}")
    bench_projections(args.reps)
    bench_expert_block(args.reps)


if __name__ == "__main__":
    main()
