#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on the shapes of `moetrain-bench ops --only
attention`, for the attention comparison of issue 14 (run both in the same session on the GPU
machine).

Causal, BF16, 32 heads: T 8192 with head dims 128 and 64, T 32768 with 128 (with --long also T
131072 with 128, and Kimi K3's MLA: 96 heads, q/k 192, v 128 at T 32768); forward and forward +
backward (autograd into q, k, v). Each of SDPA's backends is timed alone (FlashAttention, cuDNN,
memory-efficient) and SDPA's own choice beside them; a backend that refuses the shape prints
'n/a'. With --deterministic, under torch.use_deterministic_algorithms(True): the peer of our
backward, which is deterministic (SDPA's default backward, cuDNN's, is not: PyTorch then refuses
cuDNN and takes the deterministic backward of the others). FLOPs as the C++
benchmark counts them: 2 (d_qk + d_v) per visible (query, key) pair forward, 2.5x that backward.

Median of CUDA-event timings after warm-up and a heat-up (bench_torch_grouped_mm.median_ms, as
moetrain-bench times); inputs random (never zeros).

    python3 scripts/bench_torch_attention.py [--reps 20] [--long] [--deterministic]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_torch_grouped_mm import median_ms

BACKENDS = (("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def bench(tokens, heads, dim, reps, prefix, v_dim=None):
    # [batch 1, heads, tokens, dim], as SDPA takes them.
    v_dim = v_dim or dim
    q, k, v = (torch.randn(1, heads, tokens, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for d in (dim, dim, v_dim))
    dout = torch.randn(1, heads, tokens, v_dim, device="cuda", dtype=torch.bfloat16)
    pairs = tokens * (tokens + 1) / 2
    flops = 2.0 * (dim + v_dim) * pairs * heads
    for name, backend in BACKENDS:
        def forward():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), dout)

        label = f"{prefix} {name:<9} causal T{tokens} H{heads} D{dim}" + (f"/{v_dim}" if v_dim != dim else "")
        try:
            if backend is None:
                fwd_ms, both_ms = median_ms(forward, reps), median_ms(both, reps)
            else:
                with sdpa_kernel(backend):
                    fwd_ms, both_ms = median_ms(forward, reps), median_ms(both, reps)
        except RuntimeError as error:
            print(f"{label:<44} n/a ({str(error).splitlines()[0][:60]})")
            continue
        print(f"{label:<44} fwd {fwd_ms:8.3f} ms {flops / fwd_ms / 1e9:6.1f} TFLOP/s   "
              f"fwd+bwd {both_ms:8.3f} ms {3.5 * flops / both_ms / 1e9:6.1f} TFLOP/s")
    del q, k, v, dout
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--long", action="store_true",
                        help="also T 131072 (H32 D128) and Kimi K3's MLA dims (T 32768, H96, qk 192 / v 128)")
    parser.add_argument("--deterministic", action="store_true",
                        help="time under torch.use_deterministic_algorithms(True)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    prefix = "sdpa"
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        prefix = "sdpa det"
    bench(8192, 32, 128, args.reps, prefix)
    bench(8192, 32, 64, args.reps, prefix)
    bench(32768, 32, 128, max(3, args.reps // 4), prefix)
    if args.long:
        bench(131072, 32, 128, max(2, args.reps // 8), prefix)
        bench(32768, 96, 192, max(2, args.reps // 8), prefix, v_dim=128)


if __name__ == "__main__":
    main()
