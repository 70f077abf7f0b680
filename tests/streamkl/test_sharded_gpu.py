"""Context-parallel attention KL on 2 GPUs (NCCL, Triton kernels) against the single-GPU op.

Run (needs 2 CUDA devices; no network; under a minute)::

    python -m pytest -m gpu tests/streamkl/test_sharded_gpu.py

Each process holds half of a causal, padded sequence (N = 4096, bf16 and fp32); its per-row KL and the gradients of
its local queries and keys (teacher and student) are compared with one GPU computing the whole sequence. A one-line
summary (relative errors) is printed per dtype.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from streamkl import attention_kl
from streamkl.sharded import context_parallel_attention_kl
from tests._helpers import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
]

WORLD, N, DTYPES = 2, 4096, (torch.float32, torch.bfloat16)


def _problem(dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 8, N, 64), (2, 2, N, 64), (2, 8, N, 32), (2, 8, N, 32)]
    tensors = [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(True) for s in shapes]
    kpm = torch.rand(2, N, generator=g) > 0.1
    kpm[1, N // 2 + 100:] = False  # batch row 1: the second rank's keys mostly padding
    weights = torch.rand(2, 8, N, generator=g)
    return tensors, kpm.to(device), weights.to(device)


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = {}
        n = N // WORLD
        for dtype in DTYPES:
            tensors, kpm, weights = _problem(dtype, f"cuda:{rank}")
            local = [x.detach()[:, :, rank * n:(rank + 1) * n].clone().requires_grad_(True) for x in tensors]
            kl = context_parallel_attention_kl(*local, causal=True, key_padding_mask=kpm[:, rank * n:(rank + 1) * n],
                                               reduction="none")
            (kl * weights[:, :, rank * n:(rank + 1) * n]).sum().backward()
            results[str(dtype)] = {"kl": kl.detach().cpu(), "grads": [x.grad.cpu() for x in local]}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_context_parallel_on_two_gpus_matches_one_gpu(capsys):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]
    for dtype in DTYPES:
        tensors, kpm, weights = _problem(dtype, "cuda:0")
        full = attention_kl(*tensors, causal=True, key_padding_mask=kpm, reduction="none")
        (full * weights).sum().backward()
        errors = {"kl": relative_error(torch.cat([r[str(dtype)]["kl"] for r in ranks], 2), full)}
        for i, name in enumerate(("q_t", "k_t", "q_s", "k_s")):
            got = torch.cat([r[str(dtype)]["grads"][i] for r in ranks], 2)
            errors[name] = relative_error(got, tensors[i].grad)
        with capsys.disabled():
            print(f"\ncontext parallel, 2 GPUs vs 1, {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: per-shard gradients are rounded to bf16 once each
        assert max(errors.values()) < tol, errors
