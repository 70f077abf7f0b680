"""Sequence-sharded attention KL: a sequence whose tokens are split over processes gets its exact KL and gradients.

    python examples/context_parallel_kl.py                          # 2 CPU processes (gloo), about 10 seconds
    torchrun --nproc-per-node 2 examples/context_parallel_kl.py     # 2 GPUs (NCCL), N = 65536

Every process holds one contiguous chunk of the sequence (its queries and keys, teacher and student). The loss and
the gradients of each chunk's student queries and keys are compared with ``attention_kl`` on the whole sequence
in one process. ``parts()`` shows the lower level, shard by shard in one process (what a ring implementation
runs): partial statistics per key shard, their exact merge, and each shard's backward from the merged statistics.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamkl import attention_kl
from streamkl.sharded import (
    attention_kl_partial,
    attention_kl_partial_backward,
    context_parallel_attention_kl,
    merge_partials,
)


def whole_sequence(n: int, device: torch.device, dtype: torch.dtype):
    """The same teacher/student queries and keys in every process (seeded), and a padding mask."""
    g = torch.Generator(device=device).manual_seed(0)
    q_t = torch.randn(1, 8, n, 64, generator=g, device=device, dtype=dtype)
    k_t = torch.randn(1, 2, n, 64, generator=g, device=device, dtype=dtype)
    q_s = torch.randn(1, 8, n, 32, generator=g, device=device, dtype=dtype)
    k_s = torch.randn(1, 2, n, 32, generator=g, device=device, dtype=dtype)
    padding = torch.ones(1, n, dtype=torch.bool, device=device)
    padding[:, -n // 8:] = False  # the last tokens are padding
    return q_t, k_t, q_s, k_s, padding


def context_parallel(rank: int, world: int, n: int, device: torch.device, dtype: torch.dtype) -> float:
    """This rank's chunk: the loss and gradients of the whole sequence's KL, checked against one process."""
    q_t, k_t, q_s, k_s, padding = whole_sequence(n, device, dtype)
    chunk = slice(rank * n // world, (rank + 1) * n // world)
    my_q_s = q_s[:, :, chunk].clone().requires_grad_(True)
    my_k_s = k_s[:, :, chunk].clone().requires_grad_(True)
    loss = context_parallel_attention_kl(q_t[:, :, chunk], k_t[:, :, chunk], my_q_s, my_k_s, causal=True,
                                         key_padding_mask=padding[:, chunk], reduction="sum")
    loss.backward()  # my_k_s.grad holds what every rank's queries contribute to these keys

    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    whole = attention_kl(q_t, k_t, q_s, k_s, causal=True, key_padding_mask=padding, reduction="none")
    assert torch.allclose(loss, whole[:, :, chunk].sum(), rtol=1e-4)  # the rows this rank owns: its share
    (dq_s,) = torch.autograd.grad(whole[:, :, chunk].sum(), q_s, retain_graph=True)
    assert torch.allclose(my_q_s.grad, dq_s[:, :, chunk], rtol=1e-3, atol=1e-5)
    (dk_s,) = torch.autograd.grad(whole.sum(), k_s)  # every row's contribution: the keys' whole gradient
    error = (my_k_s.grad - dk_s[:, :, chunk]).abs().max().item()
    assert error < 1e-4, error
    return error


def parts(n: int = 48, shards: int = 3) -> float:
    """The same in one process, shard by shard: partials, the merge, and each shard's backward."""
    q_t, k_t, q_s, k_s, _ = whole_sequence(n, torch.device("cpu"), torch.float64)
    bounds = [(i * n // shards, (i + 1) * n // shards) for i in range(shards)]
    positions = dict(total_q=n, total_k=n, causal=True)  # every shard sees all queries: query_start = 0
    partials = [attention_kl_partial(q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], key_start=a, **positions)
                for a, b in bounds]
    merged = merge_partials(partials)  # the statistics over all keys
    grad = torch.ones_like(merged.kl)  # d(sum of the per-row KL)
    grads = [attention_kl_partial_backward(grad, q_t, k_t[:, :, a:b], q_s, k_s[:, :, a:b], merged, key_start=a,
                                           **positions) for a, b in bounds]
    dq_s = sum(g[2] for g in grads)  # the queries' gradient is the sum over shards
    dk_s = torch.cat([g[3] for g in grads], dim=2)  # each shard's keys get theirs

    q_s.requires_grad_(True)
    k_s.requires_grad_(True)
    attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="sum").backward()
    assert torch.allclose(merged.kl.sum(), attention_kl(q_t, k_t, q_s, k_s, causal=True, reduction="sum"))
    assert torch.allclose(dq_s, q_s.grad) and torch.allclose(dk_s, k_s.grad)
    return (dk_s - k_s.grad).abs().max().item()


def _process(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        n, dtype = (65536, torch.float32) if cuda else (256, torch.float64)
        error = context_parallel(rank, world, n, device, dtype)
        print(f"rank {rank}: N = {n} over {world} processes, max |dk - dk(one process)| = {error:.1e}")
    finally:
        dist.destroy_process_group()


def main(world: int = 2) -> None:
    print(f"shard by shard in one process: max |dk - dk(op)| = {parts():.1e}")
    if "RANK" in os.environ:  # started by torchrun
        _process(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_process, args=(world, port), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
