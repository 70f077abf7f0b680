"""Host (CPU) overhead of one attention_kl forward and forward+backward at a tiny N, where the GPU work is
negligible and the wall time per call is the launch path: validation, autograd, allocations, Triton launch.

    python benchmarks/overhead.py            # prints µs per call and the top cProfile entries
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

from streamkl import attention_kl


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    q_t, k_t, q_s, k_s = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    v = torch.randn_like(q_t)

    def fwd():
        with torch.no_grad():
            attention_kl(q_t, k_t, q_s, k_s, causal=True)

    def fwd_bwd():
        attention_kl(q_t, k_t, q_s, k_s, causal=True).backward()

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True).sum().backward()

    for name, fn in (("streamkl fwd", fwd), ("streamkl fwd+bwd", fwd_bwd), ("sdpa fwd+bwd (+sum)", sdpa_fwd_bwd)):
        print(f"{name}: {per_call_us(fn):.0f} us per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fwd_bwd()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
