"""Launch configurations of the attention-KL kernels: tile sizes, warps and pipeline stages.

Every kernel gets one configuration from a heuristic keyed by the padded head dims and the mode. Under
Triton's CPU interpreter (``TRITON_INTERPRET=1``) the tiles are the smallest ``tl.dot`` accepts, so
small test shapes still span several tiles (online rescaling, tails and the causal band are exercised).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

#: Smallest tile edge accepted by ``tl.dot``; also the smallest padded head dim.
MIN_BLOCK = 16
#: Largest supported head dim (per side): D_t and D_s may each be anything in 1..MAX_HEAD_DIM.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and launch parameters of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    """True under Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two (>= 16) inside the kernels; the padding is masked."""
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def _width(d_a: int, d_b: int, element_size: int) -> int:
    """Widest padded head dim in bf16-equivalent units (fp32 tiles take twice the registers and SRAM)."""
    return max(padded_head_dim(d_a), padded_head_dim(d_b)) * element_size // 2


def forward_config(d_a: int, d_b: int, causal: bool, element_size: int = 2) -> LaunchConfig:
    """Tiles for the forward kernel (query tile x key tile); chosen spill-free on sm_90 (see
    benchmarks/kernel_resources.py and docs/perf-notes.md)."""
    if interpreting():
        return LaunchConfig(MIN_BLOCK, MIN_BLOCK, 1, 1)
    w = _width(d_a, d_b, element_size)
    if w <= 64:
        return LaunchConfig(128, 64, 8, 3)
    if w <= 128:
        return LaunchConfig(128, 64, 8, 2)
    if w <= 256:
        return LaunchConfig(64, 32, 4, 2)
    return LaunchConfig(32, 32, 4, 1)


def backward_config(d_a: int, d_b: int, causal: bool, element_size: int = 2) -> LaunchConfig:
    """Tiles for the backward kernels (the same shape serves the key- and the query-stationary pass)."""
    if interpreting():
        return LaunchConfig(MIN_BLOCK, MIN_BLOCK, 1, 1)
    w = _width(d_a, d_b, element_size)
    if w <= 128:
        return LaunchConfig(64, 64, 8, 2)
    return LaunchConfig(32, 32, 4, 1)
