"""Launch configurations of the attention-KL kernels: tile sizes, warps and pipeline stages.

Every kernel gets one configuration from a heuristic keyed by the padded head dims and the mode. Under
Triton's CPU interpreter (``TRITON_INTERPRET=1``) the tiles are the smallest ``tl.dot`` accepts, so
small test shapes still span several tiles (online rescaling, tails and the window band are exercised). ``banded``
is true when some key lies outside some query's window (causal included).
"""

from __future__ import annotations

import triton

from .._triton_common.interpreter import triton_interpreter_enabled
from .._triton_common.tiles import LaunchConfig

#: Smallest tile edge accepted by ``tl.dot``; also the smallest padded head dim.
MIN_BLOCK = 16
#: Largest supported head dim (per side): D_t and D_s may each be anything in 1..MAX_HEAD_DIM.
MAX_HEAD_DIM = 256


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two (>= 16) inside the kernels; the padding is masked."""
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def _width(d_a: int, d_b: int, element_size: int) -> int:
    """Widest padded head dim in bf16-equivalent units (fp32 tiles take twice the registers and SRAM)."""
    return max(padded_head_dim(d_a), padded_head_dim(d_b)) * element_size // 2


# Measured on an H100 (bf16, B=1, H=16, N=8192) by benchmarks/tune_kernels.py over the candidates that
# benchmarks/kernel_resources.py finds spill-free; see docs/concepts/kernels.md. Wider tiles (fp32, D > 128)
# use the smallest spill-free shapes.


def forward_config(d_a: int, d_b: int, element_size: int = 2, fused_dq: bool = False) -> LaunchConfig:
    """Tiles for the forward kernel (query tile x key tile); ``fused_dq``: the forward that also accumulates
    side b's query gradient (two more products and two ``[BLOCK_M, D_b]`` fp32 accumulators)."""
    if triton_interpreter_enabled():
        return LaunchConfig(MIN_BLOCK, MIN_BLOCK, 1, 1)
    w = _width(d_a, d_b, element_size)
    if fused_dq:
        return _fused_forward_config(w, element_size)
    if w <= 64:
        return LaunchConfig(64, 64, 4, 3)
    if w <= 128:
        return LaunchConfig(128, 128, 8, 2) if element_size == 2 else LaunchConfig(128, 64, 8, 2)
    if w <= 256:
        return LaunchConfig(64, 32, 4, 2)
    return LaunchConfig(32, 32, 4, 1)


def _fused_forward_config(w: int, element_size: int) -> LaunchConfig:
    """Fastest tiles of the training forward's sweep (bf16, H100, N=8192; commit 3850ba8); wider tiles: the smallest."""
    if w <= 64:
        return LaunchConfig(64, 64, 4, 3)
    if w <= 128 and element_size == 2:
        return LaunchConfig(128, 64, 8, 3)
    if w <= 128:
        return LaunchConfig(64, 32, 4, 2)
    return LaunchConfig(32, 32, 4, 1)


def dk_config(d_a: int, d_b: int, banded: bool, element_size: int = 2, atomic_dq: bool = False) -> LaunchConfig:
    """Tiles of the key-stationary backward pass (``BLOCK_N`` keys per program, ``BLOCK_M`` rows per step)."""
    if triton_interpreter_enabled():
        return LaunchConfig(MIN_BLOCK, MIN_BLOCK, 1, 1)
    w = _width(d_a, d_b, element_size)
    if w <= 64:
        if atomic_dq:
            return LaunchConfig(64, 128, 8, 3)
        return LaunchConfig(32, 64, 4, 3) if banded else LaunchConfig(64, 64, 4, 2)
    if w <= 128 and element_size == 2:
        return LaunchConfig(32, 128, 8, 3)
    return LaunchConfig(32, 32, 4, 1)


def dq_config(d_a: int, d_b: int, banded: bool, element_size: int = 2) -> LaunchConfig:
    """Tiles of the query-stationary dQ pass of the deterministic backward."""
    if triton_interpreter_enabled():
        return LaunchConfig(MIN_BLOCK, MIN_BLOCK, 1, 1)
    w = _width(d_a, d_b, element_size)
    if w <= 64:
        return LaunchConfig(64, 64, 4, 3) if banded else LaunchConfig(128, 64, 8, 3)
    if w <= 128:
        return LaunchConfig(64, 64, 4, 2)
    return LaunchConfig(32, 32, 4, 1)
