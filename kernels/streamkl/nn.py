"""Module interface: :class:`AttentionKLLoss` holds the options of :func:`streamkl.attention_kl`."""

from __future__ import annotations

import torch
from torch import nn

from ._validation import check_options
from .api import attention_kl


class AttentionKLLoss(nn.Module):
    r"""KL divergence between teacher and student attention distributions, as an ``nn.Module``.

    The constructor takes the options of :func:`streamkl.attention_kl` (checked immediately, so a bad
    value fails where it is written); ``forward`` takes the tensors and the per-batch ones: masks, sinks and
    packed-sequence offsets.

    Args:
        causal, scale_t, scale_s, temperature, direction, reduction, layout, backend, window, softcap_t,
        softcap_s, allow_tf32, deterministic, check_finite: as in :func:`streamkl.attention_kl`.

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
        window: tuple[int, int] | None = None,
        softcap_t: float | None = None,
        softcap_s: float | None = None,
        allow_tf32: bool | None = None,
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
            window=window,
            softcap_t=softcap_t,
            softcap_s=softcap_s,
        )
        self.causal = causal
        self.scale_t = scale_t
        self.scale_s = scale_s
        self.temperature = temperature
        self.direction = direction
        self.reduction = reduction
        self.layout = layout
        self.backend = backend
        self.window = None if window is None else tuple(window)
        self.softcap_t = softcap_t
        self.softcap_s = softcap_s
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
        *,
        sinks_t: torch.Tensor | None = None,
        sinks_s: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        """Compute the loss; see :func:`streamkl.attention_kl` for shapes, masks, sinks and packed offsets."""
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
            window=self.window,
            softcap_t=self.softcap_t,
            softcap_s=self.softcap_s,
            sinks_t=sinks_t,
            sinks_s=sinks_s,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            allow_tf32=self.allow_tf32,
            deterministic=self.deterministic,
            check_finite=self.check_finite,
        )

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, temperature={self.temperature}, direction={self.direction!r}, "
            f"reduction={self.reduction!r}, layout={self.layout!r}, backend={self.backend!r}"
            + (f", window={self.window}" if self.window is not None else "")
            + (f", softcap_t={self.softcap_t}" if self.softcap_t is not None else "")
            + (f", softcap_s={self.softcap_s}" if self.softcap_s is not None else "")
        )
