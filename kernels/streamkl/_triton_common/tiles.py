"""One kernel's tile shape and launch parameters, as the tile heuristics of the portable and the Hopper kernels
return them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and launch parameters of one kernel.

    Example:
        >>> LaunchConfig(64, 64, 4, 3).block_m
        64
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
