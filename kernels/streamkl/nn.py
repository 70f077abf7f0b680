"""Module interface: :class:`AttentionKLLoss` holds the options of :func:`streamkl.attention_kl`."""

from __future__ import annotations

import torch
from torch import nn

from ._validation import check_options
from .api import attention_kl


class AttentionKLLoss(nn.Module):
    r"""KL divergence between teacher and student attention distributions, as an ``nn.Module``.

    The constructor takes the options of :func:`streamkl.attention_kl` (checked immediately, so a bad
    value fails where it is written); ``forward`` takes the tensors and the per-batch masks.

    Args:
        causal, scale_t, scale_s, temperature, direction, reduction, layout, backend, allow_tf32,
        deterministic, check_finite: as in :func:`streamkl.attention_kl`.

    Example:
        >>> import torch
        >>> from streamkl import AttentionKLLoss
        >>> loss_fn = AttentionKLLoss(causal=True, temperature=2.0)
        >>> q_t, k_t, q_s, k_s = (torch.randn(1, 2, 8, 16) for _ in range(4))
        >>> loss = loss_fn(q_t, k_t, q_s, k_s)
        >>> loss.shape, bool(loss >= 0)
        (torch.Size([]), True)
    """

    def __init__(
        self,
        *,
        causal: bool = False,
        scale_t: float | None = None,
        scale_s: float | None = None,
        temperature: float = 1.0,
        direction: str = "forward",
        reduction: str = "mean",
        layout: str = "bhnd",
        backend: str = "auto",
        allow_tf32: bool = False,
        deterministic: bool = True,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        check_options(
            causal=causal,
            scale_t=scale_t,
            scale_s=scale_s,
            temperature=temperature,
            direction=direction,
            reduction=reduction,
            layout=layout,
            backend=backend,
        )
        self.causal = causal
        self.scale_t = scale_t
        self.scale_s = scale_s
        self.temperature = temperature
        self.direction = direction
        self.reduction = reduction
        self.layout = layout
        self.backend = backend
        self.allow_tf32 = allow_tf32
        self.deterministic = deterministic
        self.check_finite = check_finite

    def forward(
        self,
        q_t: torch.Tensor,
        k_t: torch.Tensor,
        q_s: torch.Tensor,
        k_s: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute the loss; see :func:`streamkl.attention_kl` for shapes and masks."""
        return attention_kl(
            q_t,
            k_t,
            q_s,
            k_s,
            causal=self.causal,
            scale_t=self.scale_t,
            scale_s=self.scale_s,
            temperature=self.temperature,
            direction=self.direction,
            reduction=self.reduction,
            key_padding_mask=key_padding_mask,
            query_mask=query_mask,
            layout=self.layout,
            backend=self.backend,
            allow_tf32=self.allow_tf32,
            deterministic=self.deterministic,
            check_finite=self.check_finite,
        )

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, temperature={self.temperature}, direction={self.direction!r}, "
            f"reduction={self.reduction!r}, layout={self.layout!r}, backend={self.backend!r}"
        )
