"""The longest-first order of causal grids, shared by the portable and the Hopper kernels: how many (sequence, head)
pairs one chunk of the order spans, from the bytes each pair reads and the L2 cache size (the jit side is
:func:`streamkl._triton._helpers._longest_first` and its Gluon copy in :mod:`streamkl._hopper.forward`)."""

from __future__ import annotations

import functools

import torch

#: The share of L2 the keys of one chunk of (sequence, head) pairs may take (:func:`longest_first_chunk`).
L2_SHARE = 0.5


def longest_first_chunk(key_bytes_per_pair: int, l2_bytes: int, pairs: int) -> int:
    """How many of a grid's ``pairs`` (sequence, head) pairs one longest-first chunk spans
    (:func:`streamkl._triton._helpers._longest_first`): at most as many as have their keys (both sides) within
    :data:`L2_SHARE` of the L2 cache, at least one, and as narrow as the fewest chunks that hold them allow, so that
    the last chunk (the kernels take equal widths but the last) is about as wide as the rest. A chunk runs its pairs'
    longest tiles first, so a narrow last chunk starts its longest tiles as the grid drains: 16 pairs in chunks of 15
    and 1 kept some of an H200's multiprocessors (60 MiB of L2) busy a sixth longer than the average one in a causal
    training call's forward and key pass (B=1, H=16, N=8192), where 2 chunks of 8 balance them.

    Example:
        >>> longest_first_chunk(2 << 20, 60 << 20, 16)  # N = 8192, D = 64, bf16, both sides: 2 MiB per head; 15 fit
        8
        >>> longest_first_chunk(2 << 20, 50 << 20, 64), longest_first_chunk(2 << 20, 50 << 20, 6)
        (11, 6)
    """
    widest = max(1, int(l2_bytes * L2_SHARE) // max(key_bytes_per_pair, 1))
    pairs = max(pairs, 1)
    chunks = -(-pairs // widest)
    return -(-pairs // chunks)


def key_bytes_per_head(n_k: int, heads: int, *sides: tuple[int, torch.dtype, int]) -> int:
    """The bytes of keys one query head reads, over ``sides`` given as ``(head dim, dtype, key heads)``: a key head
    is shared by ``heads / key heads`` query heads, which a longest-first chunk runs together.

    Example:
        >>> key_bytes_per_head(8192, 16, (64, torch.bfloat16, 16), (64, torch.bfloat16, 16)) == 2 << 20
        True
    """
    return n_k * sum(d * dtype.itemsize * key_heads for d, dtype, key_heads in sides) // heads


@functools.lru_cache(maxsize=16)
def l2_cache_bytes(device_index: int) -> int:
    """The L2 cache size of CUDA device ``device_index`` (50 MiB for a CPU tensor: only the programs' order depends on
    it, and the interpreter runs them one at a time)."""
    if device_index < 0:
        return 50 << 20
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)
