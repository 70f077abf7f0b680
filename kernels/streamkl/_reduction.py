"""The reductions of the per-row KL, shared by every backend and the oracle."""

from __future__ import annotations

import torch


def reduce_per_row_kl(kl: torch.Tensor, row_counted: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply ``reduction`` to a per-row KL ``[B, H, N_q]``.

    ``"none"`` returns ``kl``; ``"sum"`` its sum; ``"mean"`` divides the sum by the number of counted
    rows (``row_counted``: rows with at least one allowed key that ``query_mask`` keeps), and is 0, not
    NaN, when no row is counted.

    Example:
        >>> kl = torch.tensor([[[1.0, 3.0, 0.0]]])
        >>> float(reduce_per_row_kl(kl, torch.tensor([[[True, True, False]]]), "mean"))
        2.0
    """
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    return total / row_counted.sum().clamp_min(1).to(kl.dtype)
